"""``python -m mtad.tuning``: the draft settings fastest on this machine (``show``), and a pair's acceptance
table (``measure``, on held-out prompts)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from mtad.flags import add_pair_args, add_sampling_args, load_pair_from_args, sampling_settings
from mtad.settings import Settings


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mtad tuning", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="time the candidates here and rank them by predicted speed")
    measure = sub.add_parser("measure", help="measure a pair's tokens per target call per candidate")
    for p in (show, measure):
        add_pair_args(p)
        add_sampling_args(p)
        p.add_argument("--tau", type=float, default=Settings().tau, help="MTAD threshold in [0, 1]")
    show.add_argument("--acceptance", type=Path, help="an acceptance table (default: the one the pair's preset names)")
    show.add_argument("--refresh", action="store_true", help="time again even if this machine timed before")
    measure.add_argument("--prompts", required=True, help="held-out JSONL prompts (never the benchmark's)")
    measure.add_argument("--limit", type=int, help="use the first N prompts")
    measure.add_argument("--seeds", default="0", help="comma list of seeds")
    measure.add_argument("--greedy-too", action="store_true", help="also measure greedy decoding's table")
    measure.add_argument("--out", type=Path, help="where to write the table (default: the file the preset names)")
    measure.add_argument(
        "--extend", action="store_true", help="pool these seeds into the table already at --out (or the preset's)"
    )
    measure.add_argument("--no-progress", action="store_true")
    return ap


def base_settings(args: argparse.Namespace) -> Settings:
    return sampling_settings(args).with_(tau=args.tau).validate()


def run_show(args: argparse.Namespace) -> int:
    from mtad.decoding.precompile import warm_up_pair
    from mtad.tuning.choose import fastest
    from mtad.tuning.table import GAMMAS, AcceptanceTable

    base = base_settings(args)
    table = AcceptanceTable.load(args.acceptance) if args.acceptance else None
    pair = load_pair_from_args(args)
    if pair.engine == "compiled":
        warm_up_pair(pair, max(GAMMAS) + 1)
    tuning = fastest(pair, base, table=table, refresh=args.refresh)
    print(render(tuning, pair))
    return 0


def render(tuning, pair) -> str:  # noqa: ANN001
    """The ranking as a table, and each method's fastest."""
    import torch

    from mtad.models.devices import capped_isa, device_model

    capped = ", ".join(f"{k}={v}" for k, v in capped_isa().items())
    threads = f", {torch.get_num_threads()} torch threads" if pair.device.type == "cpu" else ""
    where = f"{device_model(pair.device)}{f' ({capped})' if capped else ''}{threads}, "
    where += f"{str(pair.dtype).replace('torch.', '')}, {pair.engine} engine"
    lines = [
        f"predicted on {where} ({'seconds timed before, from disk' if tuning.from_disk else 'timed now'}); "
        f"AR: {1000 * tuning.ar_seconds:.1f} ms a token",
        "",
        f"{'setting':<16}{'tokens/call':>12}{'ms/iteration':>14}{'tokens/s':>10}{'× AR':>7}",
    ]
    for p in tuning.predictions:
        lines.append(
            f"{p.candidate.label:<16}{p.block_efficiency:>12.2f}{1000 * p.iteration_seconds:>14.1f}"
            f"{p.tokens_per_second:>10.1f}{p.speedup:>7.2f}"
        )
    lines.append("")
    for method in sorted({p.candidate.method for p in tuning.predictions}):
        b = tuning.best(method)
        lines.append(f"fastest {method}: {b.candidate.label} (predicted {b.speedup:.2f}× AR)")
    return "\n".join(lines)


def run_measure(args: argparse.Namespace) -> int:
    from mtad.bench.cli import parse_list
    from mtad.bench.report import git_commit
    from mtad.decoding import encode_prompt
    from mtad.decoding.precompile import warm_up_pair
    from mtad.models.presets import default_pair_name
    from mtad.prompts import read_prompts
    from mtad.tuning.table import GAMMAS, AcceptanceTable, blank, measure, table_path

    base = base_settings(args)
    warps = [base] + ([base.with_(greedy=True)] if args.greedy_too and not base.is_greedy else [])
    seeds = parse_list(args.seeds, int, "seeds")
    prompts = read_prompts(args.prompts, args.limit)
    refuse_benchmark_prompts(args, prompts)
    out = args.out or (None if args.draft else table_path(args.pair or default_pair_name()))
    if out is None:
        raise ValueError("this pair's preset names no acceptance table: say where to write it with --out")
    earlier = AcceptanceTable.load(out) if args.extend else None  # refused seeds: before, not after, measuring
    if earlier is not None and earlier.seeds and set(seeds) & set(earlier.seeds):
        raise ValueError(
            f"{out} already holds seed(s) {sorted(set(seeds) & set(earlier.seeds))}: extend with new seeds"
        )
    pair = load_pair_from_args(args)
    if earlier is not None:  # the same pair, prompts, budget, dtype and warps, or nothing is measured
        earlier.merged(blank(pair, prompts, warps, seeds, prompts_name=args.prompts))
    encoded = [encode_prompt(pair, p.text, base.with_(gamma=max(GAMMAS))) for p in prompts]
    if pair.engine == "compiled":
        warm_up_pair(pair, max(GAMMAS) + 1)
    table = measure(
        pair,
        prompts,
        encoded,
        warps,
        seeds,
        progress=not args.no_progress,
        commit=git_commit(),
        prompts_name=args.prompts,
    )
    if earlier is not None:
        table = earlier.merged(table)
    table.save(out)
    print(f"wrote {out} (seeds {', '.join(map(str, table.seeds))})")
    return 0


def refuse_benchmark_prompts(args: argparse.Namespace, prompts: Sequence) -> None:  # noqa: ANN001
    """ValueError when a prompt is one of the preset's benchmark prompts: what is tuned on is never checked on."""
    from mtad.models.presets import default_pair_name, presets
    from mtad.prompts import read_prompts

    preset = None if args.draft else presets().get(args.pair or default_pair_name())
    if preset is None or not preset.prompts:
        return
    bench = {p.text for p in read_prompts(preset.prompts)}
    shared = [p.id for p in prompts if p.text in bench]
    if shared:
        raise ValueError(
            f"{len(shared)} of these prompts ({', '.join(shared[:3])}...) are the benchmark's ({preset.prompts}): "
            "measure on held-out prompts, so that the benchmark checks the choice"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """0 on success, 2 with a message for bad input."""
    args = parser().parse_args(argv)
    try:
        return run_show(args) if args.command == "show" else run_measure(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
