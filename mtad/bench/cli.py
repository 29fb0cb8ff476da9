"""``python -m mtad.bench``: prompts x methods x settings -> the paper's tables, JSON, CSV and sweep plots.

This module is the command line; the running is in ``mtad.bench.run``, the aggregation in
``mtad.bench.aggregate`` and the table and files in ``mtad.bench.report``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from mtad.bench.aggregate import aggregate
from mtad.bench.report import environment, git_commit, render_table, weight_read_bound, write_outputs
from mtad.bench.run import Case, build_cases, run_bench
from mtad.decoding import encode_prompt, refusal
from mtad.decoding.precompile import warm_up_pair
from mtad.decoding.spec import method_names, registry, uses_draft
from mtad.energy import EnergyMeter
from mtad.flags import add_pair_args, add_sampling_args, add_tuning_args, load_pair_from_args, sampling_settings
from mtad.models.pair import ModelPair
from mtad.models.presets import default_pair_name, presets
from mtad.models.static_llama import uncompiled_shapes
from mtad.prompts import Prompt, read_prompts
from mtad.settings import Settings
from mtad.tasks import TASKS, Task


def parser() -> argparse.ArgumentParser:
    """The bench's flags (pair and sampling flags are shared with ``python -m mtad generate``)."""
    d = Settings()
    ap = argparse.ArgumentParser(
        prog="mtad bench",
        description="Benchmark ar, sd, mtad and transformers' assisted generation on one model pair.",
    )
    add_pair_args(ap)
    ap.add_argument(
        "--prompts",
        help="JSONL prompt file: ours ('prompt') or Spec-Bench question.jsonl ('turns'); "
        "default: the --pair preset's prompt set",
    )
    ap.add_argument("--limit", type=int, help="use the first N prompts")
    ap.add_argument(
        "--task",
        choices=sorted(TASKS),
        help="score every run on a downstream task: "
        + "; ".join(f"{t.name}: {t.description}" for t in TASKS.values())
        + ". Its prompt file, pair and --max-new-tokens are the defaults (docs/bench.md)",
    )
    names = method_names()
    ap.add_argument("--methods", help=f"comma list of {', '.join(names)} (default: all the pair can run)")
    add_sampling_args(ap)
    ap.set_defaults(max_new_tokens=None)  # the task's, else the settings' default (``prepare``)
    ap.add_argument(
        "--gamma",
        help=f"draft length, or a comma list to sweep (default: each method's paper value, {d.gamma}{own_gammas()})",
    )
    ap.add_argument("--beams", default=str(d.beams), help="MTAD beam count, or a comma list to sweep")
    ap.add_argument("--tau", default=str(d.tau), help="MTAD threshold, or a comma list to sweep (0,0.1,...,1)")
    add_tuning_args(ap)
    ap.add_argument("--seeds", default=str(d.seed), help="comma list of seeds; every method runs every seed")
    ap.add_argument("--repeats", type=int, default=1, help="measured runs per (method, settings, prompt, seed)")
    ap.add_argument("--raw", action="store_true", help="prompts as plain text, without a chat pair's template")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted warm-up runs per method and settings")
    ap.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="stop each method (row) after this many seconds of measured runs; the table then also compares "
        "perplexity over the prompts every row finished",
    )
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
    if any(not t for t in items):
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


def own_gammas() -> str:
    """The methods whose paper γ differs from the shared default, for --gamma's help: `` or BiLD's 10``."""
    return "".join(f" or {s.short}'s {s.defaults['gamma']}" for s in registry().values() if "gamma" in s.defaults)


def parse_methods(text: str) -> list[str]:
    """The --methods list, each one a registered method (``mtad.decoding.spec``)."""
    methods = parse_list(text, str, "methods")
    names = method_names()
    bad = [m for m in methods if m not in names]
    if bad:
        raise ValueError(f"unknown method {bad[0]!r}; --methods takes a comma list of {', '.join(names)}")
    return methods


def default_prompts(args: argparse.Namespace) -> str:
    """--prompts, else --task's prompt file, else the prompt set of the --pair preset (or the default pair)."""
    if args.prompts:
        return args.prompts
    if args.task:
        return str(TASKS[args.task].prompts)
    if not args.draft:
        preset = presets().get(args.pair or default_pair_name())
        if preset is not None and preset.prompts:
            return preset.prompts
    raise ValueError('give a prompt file with --prompts FILE.jsonl (one JSON object with "prompt" per line)')


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
    if args.time_budget is not None and not args.time_budget > 0:
        raise ValueError(f"--time-budget must be a number of seconds > 0; got {args.time_budget}")
    task = TASKS[args.task] if args.task else None
    if task is not None and not args.pair and not args.draft:
        args.pair = task.pair
    if args.max_new_tokens is None:
        args.max_new_tokens = task.max_new_tokens if task is not None else Settings().max_new_tokens
    cases = build_cases(
        parse_methods(args.methods or ",".join(method_names())),
        sampling_settings(args),
        parse_list(args.gamma, int, "gamma") if args.gamma is not None else None,
        parse_list(args.beams, int, "beams"),
        parse_list(args.tau, float, "tau"),
    )
    seeds = parse_list(args.seeds, int, "seeds")
    args.prompts_file = default_prompts(args)
    prompts = read_prompts(args.prompts_file, args.limit)
    if task is not None and (bare := next((p for p in prompts if p.reference is None), None)):
        raise ValueError(
            f'--task {task.name} scores replies against references: prompt {bare.id!r} of {args.prompts_file} has no "reference"'
        )
    return cases, seeds, prompts


def score_runs(task: Task, records: list[dict], prompts: Sequence[Prompt]) -> None:
    """Each run's reply scored against its prompt's reference (``mtad.tasks``): ``prediction`` and ``scores``."""
    for r in records:
        prediction = task.prediction(r["text"])
        r["prediction"] = prediction
        r["scores"] = task.score(r["text"], prompts[r["prompt_index"]].reference)


def runnable(cases: list[Case], pair: ModelPair, explicit: bool) -> list[Case]:
    """The cases the pair can run: a method it cannot (``mtad.decoding.refusal``) is an error when asked
    for by name, and left out with a note when it came with the default list."""
    kept = []
    for case in cases:
        why = refusal(pair, case.method)
        if why is None:
            kept.append(case)
        elif explicit:
            raise ValueError(why)
    left = sorted({c.method for c in cases} - {c.method for c in kept}, key=method_names().index)
    if left:
        print(f"note: {', '.join(left)} left out: {refusal(pair, left[0]).split(';')[0]}", file=sys.stderr)
    return kept


def tune_cases(pair: ModelPair, cases: list[Case], table: Path | None) -> tuple[list[Case], dict[str, dict]]:
    """SD's and MTAD's cases with the draft settings predicted fastest here (``mtad.tuning.tuned``), one row
    each where sweeps of γ or W collapse to the same choice, and each choice's prediction; prints the choices."""
    from mtad.tuning import AcceptanceTable, tuned

    acceptance = AcceptanceTable.load(table) if table else None
    out: list[Case] = []
    chosen: dict[str, dict] = {}
    for case in cases:
        settings, best = tuned(pair, case.settings, acceptance)
        new = Case(settings)
        if new in out:
            continue
        out.append(new)
        if best is not None:
            chosen[new.label] = {"predicted_speedup": round(best.speedup, 3), "block_efficiency": best.block_efficiency}
            print(f"tuned: {new.label} (predicted {best.speedup:.2f}× AR)", file=sys.stderr)
    return out, chosen


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 when a case failed (its error is in the table and files), 2 (with a
    message on stderr) for any bad input, 130 when interrupted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed its message
        return int(exc.code) if isinstance(exc.code, int) else 2
    try:
        cases, seeds, prompts = prepare(args)
        out = output_dir(args.out)
        pair = load_pair_from_args(args)
        cases = runnable(cases, pair, explicit=args.methods is not None)
        tuned = None
        if args.tuned:
            cases, tuned = tune_cases(pair, cases, args.acceptance)
        longest = max(cases, key=lambda c: uses_draft(c.method)).settings  # the draft's context counts too
        encoded = []
        for p in prompts:
            try:
                encoded.append(encode_prompt(pair, p.text, longest, raw=args.raw))
            except ValueError as exc:
                raise ValueError(f"prompt {p.id!r}: {exc}") from None
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meter = EnergyMeter(pair.device)
    commit = git_commit()
    compile_seconds = None
    if pair.engine == "compiled":  # compile every shape AR and the verifications need before timing
        longest = max(c.settings.gamma for c in cases) + 1
        compile_seconds = warm_up_pair(pair, longest)
        print(
            f"compiled engine: {compile_seconds:.0f} s to compile the models for 1 to {longest} tokens", file=sys.stderr
        )
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
        time_budget=args.time_budget,
    )
    task = TASKS[args.task] if args.task else None
    if task is not None:
        score_runs(task, result.records, prompts)
    rows = aggregate(
        result.records,
        [{"case": c.label, "method": c.method, **c.params} for c in cases],
        result.failures,
        runs_per_prompt=len(seeds) * args.repeats,
        budget_stopped=result.budget_stopped,
        scores=task.score_names if task is not None else (),
    )
    table = render_table(rows, None if meter.available else meter.reason)
    bound = weight_read_bound(pair, rows)
    if bound["text"]:
        table += "\n\n" + bound["text"]  # a line of its own, after any table
    if result.interrupted:
        table += f"\ninterrupted: {len(result.records)} runs measured, the table is partial"
    print(table)
    if pair.engine == "compiled" and uncompiled_shapes():
        print(f"warning: these forwards ran uncompiled (slower): {'; '.join(uncompiled_shapes())}", file=sys.stderr)
    if out is not None:
        env = environment(pair, argv, meter.reason, meter.source, commit)
        env["compile_seconds"] = compile_seconds
        env["weight_read_bound"] = bound
        env["tuned"] = tuned
        env["prompt_format"] = "chat template, one user turn" if pair.chat and not args.raw else "raw text"
        config = {
            "methods": sorted({c.method for c in cases}, key=method_names().index),
            "cases": [{"case": c.label, **c.settings.to_dict()} for c in cases],
            "seeds": seeds,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "time_budget_seconds": args.time_budget,
            "prompts_file": str(args.prompts_file),
            "task": args.task,
            "interrupted": result.interrupted,
            "prompts": [
                {"id": p.id, "category": p.category, "tokens": len(e)} for p, e in zip(prompts, encoded, strict=True)
            ],
        }
        for path in write_outputs(out, env, config, result, rows, table, args.plotlyjs):
            print(f"wrote {path}", file=sys.stderr)
    return 130 if result.interrupted else 1 if result.failures else 0
