"""The ``mtad`` command (``python -m mtad`` too): ``mtad generate`` decodes one prompt with any decoder and
shows which drafts were accepted; ``bench``, ``tuning``, ``audit``, ``kernels`` and ``mtjd-agreement`` run
their own modules' command lines."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mtad.decoding.spec import check, method_names, registry, settings_for
from mtad.flags import add_pair_args, add_sampling_args, add_tuning_args, load_pair_from_args, sampling_settings, span
from mtad.settings import Settings

GREEN, YELLOW, RED, DIM, RESET = "\033[32m", "\033[33m", "\033[31m", "\033[2m", "\033[0m"


def _bench(argv: Sequence[str]) -> int:
    from mtad.bench.cli import main as bench

    return bench(argv)


def _tuning(argv: Sequence[str]) -> int:
    from mtad.tuning.cli import main as tuning

    return tuning(argv)


def _audit(argv: Sequence[str]) -> int:
    from mtad.audit import main as audit

    return audit(list(argv))


def _kernels(argv: Sequence[str]) -> int:
    from mtad.kernel_report import main as kernels

    return kernels(list(argv))


def _mtjd_agreement(argv: Sequence[str]) -> int:
    from mtad.mtjd_agreement import main as agreement

    return agreement(list(argv))


COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], int]]] = {
    "bench": ("the paper's tables: prompts x methods x settings, with JSON, CSV and plots", _bench),
    "tuning": ("the draft settings fastest on this machine, and a pair's acceptance table", _tuning),
    "audit": ("check, token by token, that each decoder of a bench run samples as the target does", _audit),
    "kernels": ("what each CPU linear kernel costs here, and which one a load would choose", _kernels),
    "mtjd-agreement": ("MTAD against the multi-token joint decoding it approximates", _mtjd_agreement),
}
"""The subcommands whose command lines live in their own modules (``generate`` lives here)."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mtad", description="Multi-token assisted decoding")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser("generate", help="decode one prompt and show which drafts were accepted")
    for name, (what, _) in COMMANDS.items():
        sub.add_parser(name, help=f"{what} (mtad {name} --help)", add_help=False)
    add_pair_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--method", choices=method_names(), default="mtad")
    add_sampling_args(g)
    d = Settings()
    own = "".join(f", {s.short} {s.defaults['gamma']}" for s in registry().values() if "gamma" in s.defaults)
    g.add_argument("--gamma", type=int, help=f"draft length ({span('gamma')}; default {d.gamma}{own})")
    g.add_argument("--beams", type=int, default=d.beams, help=f"MTAD beam count ({span('beams')})")
    g.add_argument("--tau", type=float, default=d.tau, help=f"MTAD threshold in {span('tau')}")
    add_tuning_args(g)
    g.add_argument(
        "-m",
        "--num-drafts",
        type=int,
        default=d.num_drafts,
        help=f"Spectr/SpecInfer draft sequences ({span('num_drafts')})",
    )
    g.add_argument("--tau1", type=float, default=d.tau1, help=f"BiLD fallback threshold in {span('tau1')}")
    g.add_argument(
        "--tau2", type=float, default=d.tau2, help=f"BiLD rollback threshold (target NLL, nats, {span('tau2')})"
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of coloured text")
    g.add_argument("--raw", action="store_true", help="continue the prompt as plain text (no chat template)")
    return ap


def settings_from_args(args: argparse.Namespace, method: str) -> Settings:
    """The whole ``generate`` settings: the shared sampling flags plus the method's own (gamma defaults
    to the method's paper value when not given)."""
    gamma = settings_for(method).gamma if args.gamma is None else args.gamma
    own = {"beams": args.beams, "tau": args.tau, "num_drafts": args.num_drafts, "tau1": args.tau1, "tau2": args.tau2}
    return check(sampling_settings(args).with_(method=method, gamma=gamma, seed=args.seed, **own))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mtad COMMAND ...``: 0 on success, 2 with a message for bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][1](argv[1:])
    return run_generate(parser().parse_args(argv))


def run_generate(args: argparse.Namespace) -> int:
    """``mtad generate``: decode ``args.prompt``, print its text with the accepted drafts marked and a summary."""
    try:
        from mtad.decoding import check_prompt_text, generate

        check_prompt_text(args.prompt)  # before loading anything: a byte that is not UTF-8 is refused by name
        settings = settings_from_args(args, args.method)
        from mtad.metrics import summarize

        if args.engine == "auto" and not os.environ.get("MTAD_ENGINE"):
            args.engine = "eager"  # one prompt: compiling its shapes takes longer than decoding it eagerly
        pair = load_pair_from_args(args)
        if args.tuned:
            settings = tuned_settings(pair, settings, args.acceptance)
        if pair.engine == "compiled":  # compiled before the clock starts, so the speed printed is decoding's
            from mtad.decoding.precompile import warm_up_pair, warm_up_settings

            t0 = time.perf_counter()
            warm_up_pair(pair, settings.gamma + 1)
            warm_up_settings(pair, settings)  # a token tree's or several drafts' shapes
            seconds = time.perf_counter() - t0
            print(f"compiled engine: {seconds:.0f} s to compile the models", file=sys.stderr)
        run = generate(pair, args.prompt, settings, raw=args.raw)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    metrics = summarize(run.steps)
    if args.json:
        out = run.to_dict()
        out["pair"] = pair.name
        out["metrics"] = metrics.to_dict()
        print(json.dumps(out, allow_nan=False))
    else:
        shown = f"{args.prompt}\n\n" if pair.chat and not args.raw else None
        print(render(pair, run, color=sys.stdout.isatty() or bool(os.environ.get("FORCE_COLOR")), prompt=shown))
        print(summary_line(metrics), file=sys.stderr)
    return 0


def tuned_settings(pair, settings: Settings, table: Path | None = None) -> Settings:  # noqa: ANN001
    """``settings`` with the draft settings predicted fastest here (``mtad.tuning``), said on stderr; ValueError
    for a method whose draft settings are not chosen."""
    from mtad.tuning import METHODS, AcceptanceTable, tuned

    if settings.method not in METHODS:
        raise ValueError(f"--tuned chooses the draft settings of {' and '.join(METHODS)}, not of {settings.method}")
    settings, best = tuned(pair, settings, AcceptanceTable.load(table) if table else None)
    label = best.candidate.label
    print(f"tuned: {label} (predicted {best.speedup:.2f}× AR on this machine)", file=sys.stderr)
    return settings


def render(pair, run, color: bool = True, prompt: str | None = None) -> str:  # noqa: ANN001
    """The prompt (as typed, for a chat pair, not its template), then each iteration's accepted
    drafts (green) and target token (yellow)."""
    from mtad.text import token_pieces

    out = [pair.decode(run.prompt_ids) if prompt is None else prompt]
    context = list(run.prompt_ids)
    for step in run.steps:
        pieces = token_pieces(pair.tokenizer, context, step.appended_ids)
        for piece, from_target in zip(pieces, step.from_target, strict=True):
            out.append(f"{YELLOW if from_target else GREEN}{piece}{RESET}" if color else piece)
        context.extend(step.appended_ids)
    text = "".join(out)
    return text + (f"\n{DIM}[green: accepted draft tokens, yellow: the target's own token]{RESET}" if color else "")


def summary_line(m) -> str:  # noqa: ANN001
    acc = "n/a" if m.acceptance is None else f"{m.acceptance:.2f}"
    return (
        f"{m.new_tokens} new tokens in {m.seconds:.2f}s ({m.tokens_per_second:.1f} tok/s), "
        f"{m.target_calls} target calls, block efficiency {m.block_efficiency:.2f}, acceptance {acc}, "
        f"perplexity {m.perplexity:.2f}; time split draft {m.draft_seconds:.2f}s / target "
        f"{m.target_seconds:.2f}s / other {m.other_seconds:.2f}s"
    )


if __name__ == "__main__":
    sys.exit(main())
