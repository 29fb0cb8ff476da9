"""The bench's report: the table (pooled figures, docs/metrics.md) and the files (JSON, CSV, table, figures)."""

from __future__ import annotations

import csv
import functools
import json
import math
import os
import platform
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers

from mtad.bench.plots import ar_row, figure1_series, figure_names, save_sweep_figures
from mtad.bench.run import BenchResult
from mtad.decoding.context_bias import described
from mtad.decoding.fused import fused_enabled
from mtad.decoding.spec import registry, spec_of
from mtad.decoding.static_lm import products
from mtad.events import json_safe
from mtad.metrics import LOOP_REPETITION, REPEAT_N, Pooled, versus_weight_read_bound, weight_read_text
from mtad.models import devices
from mtad.models.bandwidth import read_bandwidth, weight_bytes
from mtad.models.devices import capped_isa, device_model
from mtad.models.pair import ModelPair
from mtad.models.static_llama import uncompiled_shapes


def fmt(value: float | None, digits: int | None = None) -> str:
    """A figure with 3 significant-ish digits; None (not measured / not defined) is ``n/a``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if digits is None:
        a = abs(value)
        digits = 0 if a >= 1000 else 1 if a >= 10 else 2 if a >= 0.1 or a == 0 else 3
    return f"{value:.{digits}f}"


def fmt_param(v: object) -> str:
    """A setting's cell: ``-`` where the method does not use it."""
    return "-" if v is None else v if isinstance(v, str) else f"{v:g}"


def time_split(row: dict) -> str:
    """Mean seconds per run in draft forwards / target forwards / everything else."""
    return " / ".join(fmt(row[f"{k}_seconds_mean"], 3) for k in ("draft", "target", "other"))


TABLE_COLUMNS = (
    ("method", lambda r: r["method"]),
    ("γ", lambda r: fmt_param(r["gamma"])),
    ("W", lambda r: fmt_param(r["beams"])),
    ("τ", lambda r: fmt_param(r["tau"])),
    ("draft", lambda r: fmt_param(r["draft_mode"])),
    ("speed (tok/s)", lambda r: fmt(r["tokens_per_second"])),
    ("J/token", lambda r: fmt(r["joules_per_token"])),
    ("perplexity", lambda r: fmt(r["perplexity"])),
    ("ppl common", lambda r: fmt(r["perplexity_common"])),
    ("rep. 4-grams", lambda r: fmt(r.get("repetition"))),
    ("block eff.", lambda r: fmt(r["block_efficiency"])),
    ("acceptance", lambda r: fmt(r["acceptance"])),
    ("draft / target / other (s/run)", time_split),
    ("runs", lambda r: str(r["runs"])),
)
LEFT = 5
"""The first columns (method and settings) are left-aligned, the figures right-aligned."""

LEGEND = (
    "speed, J/token, perplexity, block eff. and acceptance are pooled over the row's runs (total over total,\n"
    "see docs/metrics.md); 'ppl common' pools only the {common} prompt(s) every row finished; 'rep. 4-grams'\n"
    "is the share of repeated 4-grams (a looping text has a low perplexity); the time split is the mean per run.\n"
    "Per-run means and standard deviations are in summary.csv and bench.json."
)


def text_table(header: Sequence[str], body: Sequence[Sequence[str]], left: int, right: int | None = None) -> str:
    """Aligned plain-text columns under a dashed rule: the first ``left`` columns (and those from
    ``right`` on) left-aligned, the figures between them right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(header)]
    last = len(header) if right is None else right

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left or i >= last else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(row) for row in body)])


def task_columns(aggregates: Sequence[dict]) -> list[tuple[str, object]]:
    """A column per task score (``mtad.tasks``), after the repetition column, where the run scored a task."""
    names = next((list(r["task_scores"]) for r in aggregates if r.get("task_scores")), [])

    def cell(name: str) -> object:
        return lambda r: fmt(((r.get("task_scores") or {}).get(name) or {}).get("mean"), 1)

    return [(name, cell(name)) for name in names]


FEW_PROMPTS = 10
"""Below this many prompts a percentile interval from resampling them is too narrow to lean on."""


def task_lines(aggregates: Sequence[dict]) -> list[str]:
    """Each task score with its interval, then each row's difference to SD's on prompt pairs, saying when its
    interval includes 0."""
    out = []
    for name, _ in task_columns(aggregates):
        rows = [(r["case"], r["task_scores"][name]) for r in aggregates if (r.get("task_scores") or {}).get(name)]
        width = max(len(case) for case, _ in rows)
        out.append(f"{name} (0-100, the mean over the row's runs; 95 % interval, prompts resampled):")
        out.extend(
            f"  {case.ljust(width)}  {s['mean']:.1f}  [{s['low']:.1f}, {s['high']:.1f}]  {s['prompts']} prompts"
            for case, s in rows
        )
        gaps = [(r["case"], r["task_vs_sd"][name]) for r in aggregates if (r.get("task_vs_sd") or {}).get(name)]
        if gaps:
            out.append(f"{name} minus SD's, paired by prompt, seed and repeat (95 % interval, prompts resampled):")
            out.extend(
                f"  {case.ljust(width)}  {g['difference']:+.1f}  [{g['low']:+.1f}, {g['high']:+.1f}]  "
                + ("includes 0: no difference measured" if g["includes_zero"] else "excludes 0")
                + f"  ({g['pairs']} pairs, {g['prompts']} prompts)"
                for case, g in gaps
            )
            if min(g["prompts"] for _, g in gaps) < FEW_PROMPTS:
                out.append(
                    f"  under {FEW_PROMPTS} prompts, resampling them understates the spread: read such an interval as"
                    " too narrow (AR minus SD, the same distribution, can then exclude 0)"
                )
    return out


def render_table(aggregates: Sequence[dict], energy_note: str | None = None) -> str:
    """The paper's Table 4 shape: one row per method and settings, pooled figures (and a task's scores, its
    Table 6); failed rows say why."""
    columns = list(TABLE_COLUMNS)
    at = [name for name, _ in columns].index("rep. 4-grams") + 1
    columns[at:at] = task_columns(aggregates)
    header = [name for name, _ in columns]
    out = [text_table(header, [[cell(r) for _, cell in columns] for r in aggregates], LEFT)]
    common = aggregates[0]["common_prompts"] if aggregates else 0
    out.append(LEGEND.format(common=common))
    for method in dict.fromkeys(r["method"] for r in aggregates):  # where a method's columns read differently
        remark = spec_of(method).remark if method in registry() else ""
        if remark:
            out.append(f"{method}: {remark}")
    curves = [(r["case"], r.get("acceptance_by_position") or []) for r in aggregates]
    if any(c for _, c in curves):
        out.append("acceptance by draft position (token i kept, given tokens 1..i-1 were):")
        width = max(len(case) for case, c in curves if c)
        out.extend(f"  {case.ljust(width)}  {'  '.join(fmt(v) for v in c)}" for case, c in curves if c)
    calls = [r for r in aggregates if r.get("target_call_seconds")]
    if calls:
        out.append("a target call, ms, and against AR's (a verification's cost over a one-token forward's):")
        width = max(len(r["case"]) for r in calls)
        out.extend(
            f"  {r['case'].ljust(width)}  {fmt(r['target_call_seconds'] * 1e3)}"
            + (f"  {r['target_call_vs_ar']:.2f}×" if r.get("target_call_vs_ar") and r["method"] != "ar" else "")
            for r in calls
        )
    equations = [r for r in aggregates if r.get("speed_equation")]
    if equations:
        out.append(
            "× AR = tokens a target call ÷ (verification + drafting + rest), each a target call's seconds in AR's"
            " seconds a token:"
        )
        width = max(len(r["case"]) for r in equations)
        out.extend(f"  {r['case'].ljust(width)}  {r['speed_equation']['text']}" for r in equations)
    gaps = [(r["case"], r["perplexity_vs_sd"]) for r in aggregates if r.get("perplexity_vs_sd")]
    if gaps:
        out.append("perplexity minus SD's over the common prompts (95 % interval, prompts resampled):")
        width = max(len(case) for case, _ in gaps)
        out.extend(
            f"  {case.ljust(width)}  {g['difference']:+.3f}  [{g['low']:+.3f}, {g['high']:+.3f}]" for case, g in gaps
        )
    gaps = [
        (r["case"], r["perplexity_vs_sd_without_loops"]) for r in aggregates if r.get("perplexity_vs_sd_without_loops")
    ]
    if gaps:
        out.append(
            f"the same over the runs where neither text loops (>= {LOOP_REPETITION * 100:.0f} % repeated {REPEAT_N}-grams), "
            "and how many those are:"
        )
        width = max(len(case) for case, _ in gaps)
        out.extend(
            f"  {case.ljust(width)}  {g['difference']:+.3f}  [{g['low']:+.3f}, {g['high']:+.3f}]  {g['pairs']} of {g['of']}"
            for case, g in gaps
        )
    out.extend(task_lines(aggregates))
    for r in aggregates:
        if r["error"]:
            out.append(f"{r['case']} failed after {r['runs']} run(s): {r['error']}")
        if r["budget_stopped"]:
            out.append(f"{r['case']} ran out of its time budget after {r['runs']} run(s)")
    if energy_note:
        out.append(f"J/token n/a: {energy_note}")
    figure1 = figure1_table(aggregates)
    if figure1 is not None:
        out.append("\n" + figure1)
    return "\n".join(out)


def figure1_table(aggregates: Sequence[dict]) -> str | None:
    """The paper's Figure 1 as text: per MTJD row swept over K, its K, W, search, pooled perplexity,
    repetition, speed and target forwards per token, AR's row first when it ran; None without such a sweep."""
    groups = figure1_series(aggregates)
    if not groups:
        return None

    def figures(r: dict) -> list[str]:
        be = r.get("block_efficiency")
        return [fmt(r.get(k)) for k in ("perplexity", "repetition", "tokens_per_second")] + [
            fmt(1 / be if be else None),
            str(r["runs"]),
        ]

    header = ["K", "W", "search", "perplexity", "rep. 4-grams", "speed (tok/s)", "target calls/token", "runs"]
    ar = ar_row(aggregates)
    body = [["AR", "-", "-", *figures(ar)]] if ar is not None else []
    body += [
        [f"{r['gamma']:g}", f"{r['beams']:g}", r["draft_mode"], *figures(r)] for rows in groups.values() for r in rows
    ]
    return "\n".join(
        [
            "MTJD against K (the paper's Figure 1): K tokens a step by beam search over the target; K = 1 is the",
            "target's own decoding. A perplexity drop that comes with more repeated 4-grams is a loop, not better text.",
            text_table(header, body, 3),
        ]
    )


def weight_read_bound(pair: ModelPair, aggregates: Sequence[dict]) -> dict:
    """The target's weight-read bound on this device (``mtad.models.bandwidth``) and the one AR row's seconds a
    token against it, with the sentence the table prints (None without one AR row)."""
    weights = weight_bytes(pair.target)
    rate = read_bandwidth(pair.device)
    ar = [r for r in aggregates if r["method"] == "ar" and r.get("new_tokens")]
    times = (
        versus_weight_read_bound(Pooled(**{f.name: ar[0][f.name] for f in fields(Pooled)}), weights / rate)
        if len(ar) == 1
        else None
    )
    return {
        "target_weight_bytes": weights,
        "read_bytes_per_second": rate,
        "seconds_per_token": weights / rate,
        "ar_times_bound": times,
        "text": weight_read_text(times, weights, rate) if times is not None else None,
    }


def environment(
    pair: ModelPair, argv: Sequence[str], meter_reason: str | None, meter_source: str, commit: str | None
) -> dict:
    """Where and how the figures were measured: date, device, versions, the exact command, and the commit
    the code was loaded from (read before the run: a long run may outlive it)."""
    dev = pair.device
    draft_params, target_params = pair.parameters()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m mtad.bench " + shlex.join(argv),
        "device": str(dev),
        "device_name": device_model(dev),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "dtype": str(pair.dtype).replace("torch.", ""),
        "linear_kernels": dict(pair.kernels),
        "engine": pair.engine,
        # forward shapes dynamo declined to compile (past its graph limits, or a failed compile): they ran slower
        "uncompiled_shapes": uncompiled_shapes(),
        "compiled_products": products(pair),
        "bookkeeping": "compiled" if fused_enabled(pair) else "as written",  # mtad.decoding.fused
        "cpu_flags": cpu_flags() if dev.type == "cpu" else None,
        "pair": pair.name,
        # where each model was loaded from: two drafts benched under one pair name (MTAD_PAIRS) differ here
        "draft_source": getattr(pair.draft, "name_or_path", None),
        "target_source": getattr(pair.target, "name_or_path", None),
        "draft_parameters": draft_params,
        "context_bias": described(pair.draft),  # the draft's n-gram weights (mtad.decoding.context_bias)
        "target_parameters": target_params,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "energy_source": meter_source,
        "energy_unavailable_reason": meter_reason,
        "git_commit": commit,
    }


def cpu_flags() -> list[str]:
    """The CPU's vector and matrix extensions that decide which kernels are fast (AVX2, AVX-512, AMX),
    as the CPU reports them, the capability PyTorch's own kernels were dispatched to, and the variables
    that cap the instruction sets (how an AVX2-only CPU is emulated on a newer one)."""
    flags = devices.cpu_flags()
    wanted = ("avx2", "avx512_f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
    emulated = [f"{v}={value}" for v, value in capped_isa().items()]
    return [f for f in wanted if f in flags] + [f"aten:{torch.backends.cpu.get_cpu_capability()}"] + emulated


@functools.cache
def git_commit() -> str | None:
    """The repository's HEAD commit when first asked (the code this process loaded), or None outside a git
    checkout. Asked once: the page reads it in every visitor's timing key, which spawned git each time."""
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


OUTPUTS = ("bench.json", "runs.csv", "summary.csv", "table.txt")


def remove_earlier_outputs(out: Path) -> list[Path]:
    """Delete the files a bench writes (its JSON, CSVs, table and every figure it can draw) from ``out``; the
    paths removed. Anything else in the folder stays."""
    names = [*OUTPUTS, *(f"{figure}.{ext}" for figure in figure_names() for ext in ("html", "png"))]
    stale = [out / name for name in names if (out / name).is_file()]
    for path in stale:
        path.unlink()
    return stale


def write_outputs(
    out: Path,
    env: dict,
    config: dict,
    result: BenchResult,
    aggregates: list[dict],
    table: str,
    plotlyjs: str = "inline",
) -> list[Path]:
    """bench.json, runs.csv, summary.csv, table.txt and the sweep figures; returns the paths written. What an
    earlier bench wrote into ``out`` goes first (its files only, by name): a figure this run does not draw must
    not stand beside its figures as if it did."""
    out.mkdir(parents=True, exist_ok=True)
    remove_earlier_outputs(out)
    doc = {
        "environment": env,
        "config": config,
        "definitions": "docs/metrics.md",
        "aggregates": aggregates,
        "failures": [{"case": k, "error": v} for k, v in result.failures.items()],
        "runs": result.records,
    }
    if result.steps:
        doc["steps"] = result.steps
    paths = [out / "bench.json", out / "runs.csv", out / "summary.csv", out / "table.txt"]
    paths[0].write_text(
        json.dumps(json_safe(doc), indent=1, allow_nan=False, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    write_csv(paths[1], json_safe(result.records))
    write_csv(paths[2], json_safe(aggregates))
    paths[3].write_text(
        f"{env['command']}\n{env['date']} on {env['device']} ({env['device_name']})\n\n{table}\n", encoding="utf-8"
    )
    subtitle = f"{env['pair']} on {env['device_name']}, {env['date']}"
    paths.extend(save_sweep_figures(aggregates, out, subtitle=subtitle, plotlyjs=plotlyjs))
    return paths
