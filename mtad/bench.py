"""``python -m mtad.bench``: prompts x methods x settings -> the paper's tables, JSON, CSV and sweep plots.

Every run is one (method, settings, prompt, seed, repeat); each gets its own clock and its own
energy window, and its metrics come from ``mtad.metrics.summarize`` on its Steps, never from here.
Methods run one at a time with the same prompts and seeds, so comparisons are paired.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mtad.cli import add_pair_args, add_sampling_args, sampling_settings
from mtad.decoding.hf_assisted import assisted_generate, assisted_steps
from mtad.energy import EnergyMeter, EnergyReading
from mtad.events import Step, json_safe
from mtad.metrics import Metrics, summarize
from mtad.prompts import Prompt, read_prompts
from mtad.settings import Settings

if TYPE_CHECKING:
    from mtad.pair import ModelPair

METHODS = ("ar", "sd", "bild", "spectr", "specinfer", "mtad", "mtad-tree", "hf-assisted")
SWEPT: dict[str, tuple[str, ...]] = {
    "ar": (),
    "sd": ("gamma",),
    "hf-assisted": ("gamma",),
    "mtad": ("gamma", "beams", "tau"),
    "mtad-tree": ("gamma", "beams", "tau"),
    "bild": ("gamma",),
    "spectr": ("gamma",),
    "specinfer": ("gamma",),
}
"""The settings each method depends on (and so is swept over); the others are not swept for it."""
METRIC_FIELDS = tuple(f.name for f in fields(Metrics) if f.name != "energy_note")
"""Every numeric field of ``Metrics``: each is aggregated as mean and std."""


@dataclass(frozen=True)
class Case:
    """One table row: a method and the settings it runs with (``settings.method`` is the engine's)."""

    method: str
    settings: Settings

    @property
    def params(self) -> dict[str, object]:
        """gamma/beams/tau/draft_mode, None where the method does not use them."""
        swept = SWEPT[self.method]
        out: dict[str, object] = {
            k: getattr(self.settings, k) if k in swept else None for k in ("gamma", "beams", "tau")
        }
        out["draft_mode"] = self.settings.draft_mode if self.method == "mtad" else None
        return out

    @property
    def label(self) -> str:
        """E.g. ``mtad γ=4 W=8 τ=0.1``."""
        names = {"gamma": "γ", "beams": "W", "tau": "τ"}
        parts = [f"{names[k]}={getattr(self.settings, k):g}" for k in SWEPT[self.method]]
        return " ".join([self.method, *parts])


# ----------------------------------------------------------------------------------------------------------------------
# Command line


def parser() -> argparse.ArgumentParser:
    """The bench's flags (pair and sampling flags are shared with ``python -m mtad generate``)."""
    d = Settings()
    ap = argparse.ArgumentParser(
        prog="python -m mtad.bench",
        description="Benchmark ar, sd, mtad and transformers' assisted generation on one model pair.",
    )
    add_pair_args(ap)
    ap.add_argument(
        "--prompts",
        help="JSONL prompt file: ours ('prompt') or Spec-Bench question.jsonl ('turns'); "
        "default: the --pair preset's prompt set",
    )
    ap.add_argument("--limit", type=int, help="use the first N prompts")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    add_sampling_args(ap)
    ap.add_argument(
        "--gamma", default=str(d.gamma), help="draft length, or a comma list to sweep (sd, mtad, hf-assisted)"
    )
    ap.add_argument("--beams", default=str(d.beams), help="MTAD beam count, or a comma list to sweep")
    ap.add_argument("--tau", default=str(d.tau), help="MTAD threshold, or a comma list to sweep (0,0.1,...,1)")
    ap.add_argument("--seeds", default=str(d.seed), help="comma list of seeds; every method runs every seed")
    ap.add_argument("--repeats", type=int, default=1, help="measured runs per (method, settings, prompt, seed)")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted warm-up runs per method and settings")
    ap.add_argument("--out", help="directory for bench.json, runs.csv, summary.csv, table.txt and sweep figures")
    ap.add_argument(
        "--plotlyjs",
        choices=("inline", "cdn"),
        default="inline",
        help="inline: self-contained HTML figures (~5 MB, open offline); cdn: small files that load plotly.js online",
    )
    ap.add_argument("--save-steps", action="store_true", help="also store every run's Step trace in bench.json")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return ap


def parse_list(text: str, cast: Callable[[str], object], name: str) -> list:
    """A comma list such as ``0,0.1,0.5`` (duplicates dropped, order kept); ValueError names the flag."""
    items = [t.strip() for t in str(text).split(",")]
    if not items or any(not t for t in items):
        raise ValueError(f"--{name} must be a value or a comma-separated list of values; got {text!r}")
    out = []
    for t in items:
        try:
            v = cast(t)
        except ValueError:
            raise ValueError(f"--{name}: {t!r} is not a valid {cast.__name__}") from None
        if v not in out:
            out.append(v)
    return out


def parse_methods(text: str) -> list[str]:
    """The --methods list, each one of METHODS."""
    methods = parse_list(text, str, "methods")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown method {bad[0]!r}; --methods takes a comma list of {', '.join(METHODS)}")
    return methods


def build_cases(
    methods: Sequence[str], base: Settings, gammas: Sequence[int], beams: Sequence[int], taus: Sequence[float]
) -> list[Case]:
    """The rows: each method crossed with the sweeps of only the settings it uses. Validates each."""
    values = {"gamma": list(gammas), "beams": list(beams), "tau": list(taus)}
    cases = []
    for method in methods:
        swept = SWEPT[method]
        engine = "sd" if method == "hf-assisted" else method
        first = {k: v[0] for k, v in values.items()}
        for combo in itertools.product(*(values[k] for k in swept)):
            settings = base.with_(method=engine, **{**first, **dict(zip(swept, combo, strict=True))}).validate()
            cases.append(Case(method, settings))
    return cases


def default_prompts(args: argparse.Namespace) -> str:
    """--prompts, else the prompt set of the --pair preset (or the default pair)."""
    if args.prompts:
        return args.prompts
    if not args.draft:
        from mtad.pair import default_pair_name, presets

        preset = presets().get(args.pair or default_pair_name())
        if preset is not None and preset.prompts:
            return preset.prompts
    raise ValueError('give a prompt file with --prompts FILE.jsonl (one JSON object with "prompt" per line)')


# ----------------------------------------------------------------------------------------------------------------------
# One run


def run_case(
    pair: ModelPair,
    case: Case,
    prompt_ids: list[int],
    seed: int,
    meter: EnergyMeter | None = None,
) -> tuple[list[Step], EnergyReading | None]:
    """Decode one prompt with one case and seed; the meter (if any) wraps exactly the generation."""
    settings = case.settings.with_(seed=seed)
    if case.method == "hf-assisted":
        if meter:
            meter.start()
        trace = assisted_generate(pair, prompt_ids, settings)
        reading = meter.stop() if meter else None
        return assisted_steps(pair, prompt_ids, trace), reading
    from mtad.decoding import decode

    if meter:
        meter.start()
    steps = list(decode(pair, prompt_ids, settings))
    reading = meter.stop() if meter else None
    return steps, reading


def make_record(
    case: Case,
    prompt: Prompt,
    index: int,
    prompt_ids: list[int],
    seed: int,
    repeat: int,
    steps: list[Step],
    reading: EnergyReading | None,
    text: str,
) -> dict:
    """One run's flat record: what ran, then every field of ``summarize`` exactly as it returned it."""
    joules = reading.joules if reading else None
    note = reading.note if reading else "not measured"
    metrics = summarize(steps, joules=joules, energy_note=note)
    s = case.settings
    return {
        "case": case.label,
        "method": case.method,
        **case.params,
        "greedy": s.is_greedy,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "max_new_tokens": s.max_new_tokens,
        "seed": seed,
        "repeat": repeat,
        "prompt_index": index,
        "prompt_id": prompt.id,
        "prompt_category": prompt.category,
        "prompt_tokens": len(prompt_ids),
        **metrics.to_dict(),
        "energy_source": reading.source if reading else "unavailable",
        "energy_window_seconds": reading.seconds if reading else None,
        "text": text,
        "new_ids": [t for st in steps for t in st.appended_ids],
    }


# ----------------------------------------------------------------------------------------------------------------------
# The whole benchmark


@dataclass
class BenchResult:
    """All measured runs (records), their per-case aggregates, and the step traces if kept."""

    records: list[dict] = field(default_factory=list)
    aggregates: list[dict] = field(default_factory=list)
    steps: list[list[dict]] = field(default_factory=list)
    interrupted: bool = False


def run_bench(
    pair: ModelPair,
    cases: Sequence[Case],
    prompts: Sequence[Prompt],
    encoded: Sequence[list[int]],
    seeds: Sequence[int],
    repeats: int,
    warmup: int,
    progress: bool = True,
    keep_steps: bool = False,
    meter: EnergyMeter | None = None,
) -> BenchResult:
    """Run every case on every prompt and seed, ``repeats`` times, one run at a time, after
    ``warmup`` uncounted runs per case; return records and aggregates."""
    from tqdm import tqdm

    meter = meter or EnergyMeter(pair.device)
    total = len(cases) * (warmup + len(prompts) * len(seeds) * repeats)
    result = BenchResult()
    with tqdm(total=total, file=sys.stderr, disable=not progress, unit="run", dynamic_ncols=True) as bar:
        try:
            for case in cases:  # one at a time: warm-up first, then prompts x seeds x repeats
                bar.set_description(case.label)
                for _ in range(warmup):
                    run_case(pair, case, encoded[0], seeds[0])
                    bar.update()
                for (i, prompt), seed, rep in itertools.product(enumerate(prompts), seeds, range(repeats)):
                    steps, reading = run_case(pair, case, encoded[i], seed, meter)
                    text = pair.decode([t for st in steps for t in st.appended_ids])
                    result.records.append(make_record(case, prompt, i, encoded[i], seed, rep, steps, reading, text))
                    if keep_steps:
                        result.steps.append([st.to_dict() for st in steps])
                    bar.update()
        except KeyboardInterrupt:  # keep what was measured: the table and files say it is partial
            result.interrupted = True
    result.aggregates = aggregate(result.records)
    return result


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, sample std, n) over the values that are not None/NaN; std is None below two values."""
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return None, None, 0
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else None, len(vals)


def aggregate(records: Sequence[dict]) -> list[dict]:
    """One row per case (in first-seen order): mean and std of every metric over its runs."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["case"], []).append(r)
    rows = []
    for label, rs in groups.items():
        first = rs[0]
        row = {"case": label, "method": first["method"]}
        row.update({k: first[k] for k in ("gamma", "beams", "tau", "draft_mode")})
        row["runs"] = len(rs)
        for m in METRIC_FIELDS:
            mean, std, _ = mean_std([r[m] for r in rs])
            row[f"{m}_mean"], row[f"{m}_std"] = mean, std
        notes = sorted({r["energy_note"] for r in rs if r["energy_note"]})
        row["energy_source"] = first["energy_source"]
        row["energy_note"] = "; ".join(notes) if notes else None
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# The table


def fmt(value: float | None, digits: int | None = None) -> str:
    """A figure with 3 significant-ish digits; None (not measured / not defined) is ``n/a``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if digits is None:
        a = abs(value)
        digits = 0 if a >= 1000 else 1 if a >= 10 else 2 if a >= 0.1 or a == 0 else 3
    return f"{value:.{digits}f}"


def pm(row: dict, metric: str) -> str:
    """``mean ± std`` for one aggregated metric (just the mean when there is one run)."""
    mean, std = row[f"{metric}_mean"], row[f"{metric}_std"]
    if mean is None:
        return "n/a"
    a = abs(mean)
    digits = 0 if a >= 1000 else 1 if a >= 10 else 2 if a >= 0.1 or a == 0 else 3
    return fmt(mean, digits) if std is None else f"{fmt(mean, digits)} ± {fmt(std, digits)}"


TABLE_COLUMNS = (
    ("method", lambda r: r["method"]),
    ("γ", lambda r: fmt_param(r["gamma"])),
    ("W", lambda r: fmt_param(r["beams"])),
    ("τ", lambda r: fmt_param(r["tau"])),
    ("speed (tok/s)", lambda r: pm(r, "tokens_per_second")),
    ("J/token", lambda r: pm(r, "joules_per_token")),
    ("perplexity", lambda r: pm(r, "perplexity")),
    ("block eff.", lambda r: pm(r, "block_efficiency")),
    ("acceptance", lambda r: pm(r, "acceptance")),
    ("draft / target / other (s)", lambda r: time_split(r)),
    ("runs", lambda r: str(r["runs"])),
)


def fmt_param(v: object) -> str:
    """A setting's cell: ``-`` where the method does not use it."""
    return "-" if v is None else f"{v:g}"


def time_split(row: dict) -> str:
    """Mean seconds per run in draft forwards / target forwards / everything else."""
    return " / ".join(fmt(row[f"{k}_seconds_mean"], 3) for k in ("draft", "target", "other"))


def render_table(aggregates: Sequence[dict], energy_note: str | None = None) -> str:
    """The paper's Table 4 shape: one row per method and settings, mean ± std over runs."""
    header = [name for name, _ in TABLE_COLUMNS]
    body = [[cell(r) for _, cell in TABLE_COLUMNS] for r in aggregates]
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [line(header), "  ".join("-" * w for w in widths), *(line(row) for row in body)]
    if energy_note:
        out.append(f"J/token n/a: {energy_note}")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------------------
# Files


def environment(pair: ModelPair, argv: Sequence[str], meter_reason: str | None, meter_source: str) -> dict:
    """Where and how the figures were measured: date, device, versions, the exact command."""
    import transformers

    dev = pair.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    draft_params, target_params = pair.parameters()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m mtad.bench " + shlex.join(argv),
        "device": str(dev),
        "device_name": name,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "dtype": str(pair.dtype).replace("torch.", ""),
        "pair": pair.name,
        "draft_parameters": draft_params,
        "target_parameters": target_params,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "energy_source": meter_source,
        "energy_unavailable_reason": meter_reason,
        "git_commit": git_commit(),
    }


def git_commit() -> str | None:
    """The repository's HEAD commit, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    """Rows as CSV with the union of their keys as columns (lists as JSON, None as empty)."""
    keys: list[str] = []
    for r in rows:
        keys.extend(k for k in r if k not in keys)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys, restval="")
        w.writeheader()
        for r in rows:
            w.writerow(
                {k: json.dumps(v) if isinstance(v, (list, dict)) else "" if v is None else v for k, v in r.items()}
            )


def write_outputs(
    out: Path, env: dict, config: dict, result: BenchResult, table: str, plotlyjs: str = "inline"
) -> list[Path]:
    """bench.json, runs.csv, summary.csv, table.txt and the sweep figures; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"environment": env, "config": config, "aggregates": result.aggregates, "runs": result.records}
    if result.steps:
        doc["steps"] = result.steps
    paths = [out / "bench.json", out / "runs.csv", out / "summary.csv", out / "table.txt"]
    paths[0].write_text(
        json.dumps(json_safe(doc), indent=1, allow_nan=False, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    write_csv(paths[1], json_safe(result.records))
    write_csv(paths[2], json_safe(result.aggregates))
    paths[3].write_text(
        f"{env['command']}\n{env['date']} on {env['device']} ({env['device_name']})\n\n{table}\n", encoding="utf-8"
    )
    from mtad.bench_plots import save_sweep_figures

    subtitle = f"{env['pair']} on {env['device_name']}, {env['date']}"
    paths.extend(save_sweep_figures(result.aggregates, out, subtitle=subtitle, plotlyjs=plotlyjs))
    return paths


# ----------------------------------------------------------------------------------------------------------------------
# Entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 2 (with a message on stderr) for any bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed its message
        return int(exc.code) if isinstance(exc.code, int) else 2
    try:
        cases, seeds, prompts = prepare(args)
        out = output_dir(args.out)
        from mtad.cli import load_pair_from_args
        from mtad.decoding import encode_prompt

        pair = load_pair_from_args(args)
        longest = max(cases, key=lambda c: c.settings.method != "ar").settings
        encoded = []
        for p in prompts:
            try:
                encoded.append(encode_prompt(pair, p.text, longest))
            except ValueError as exc:
                raise ValueError(f"prompt {p.id!r}: {exc}") from None
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meter = EnergyMeter(pair.device)
    result = run_bench(
        pair,
        cases,
        prompts,
        encoded,
        seeds,
        args.repeats,
        args.warmup,
        progress=not args.no_progress,
        keep_steps=args.save_steps,
        meter=meter,
    )
    unavailable = None if meter.available else meter.reason
    table = render_table(result.aggregates, unavailable)
    if result.interrupted:
        table += f"\ninterrupted: {len(result.records)} runs measured, the table is partial"
    print(table)
    if out is not None:
        env = environment(pair, argv, meter.reason, meter.source)
        config = {
            "methods": sorted({c.method for c in cases}, key=METHODS.index),
            "cases": [{"case": c.label, "method": c.method, **c.settings.to_dict()} for c in cases],
            "seeds": seeds,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "prompts_file": str(args.prompts_file),
            "interrupted": result.interrupted,
            "prompts": [
                {"id": p.id, "category": p.category, "tokens": len(e)} for p, e in zip(prompts, encoded, strict=True)
            ],
        }
        for path in write_outputs(out, env, config, result, table, args.plotlyjs):
            print(f"wrote {path}", file=sys.stderr)
    return 130 if result.interrupted else 0


def output_dir(path: str | None) -> Path | None:
    """Create --out before any model loads, so an unwritable place fails fast (ValueError)."""
    if not path:
        return None
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".mtad-bench-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"cannot write to the output directory {out}: {exc.strerror or exc}") from None
    return out


def prepare(args: argparse.Namespace) -> tuple[list[Case], list[int], list[Prompt]]:
    """Check every flag and read the prompts before any model is loaded; ValueError on bad input."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1; got {args.repeats}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more; got {args.warmup}")
    methods = parse_methods(args.methods)
    cases = build_cases(
        methods,
        sampling_settings(args),
        parse_list(args.gamma, int, "gamma"),
        parse_list(args.beams, int, "beams"),
        parse_list(args.tau, float, "tau"),
    )
    seeds = parse_list(args.seeds, int, "seeds")
    args.prompts_file = default_prompts(args)
    prompts = read_prompts(args.prompts_file, args.limit)
    return cases, seeds, prompts


if __name__ == "__main__":
    sys.exit(main())
