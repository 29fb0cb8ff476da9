"""``python -m mtad generate``: decode one prompt with any decoder (ar, sd, mtad, bild, ...) and show the trace."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from mtad.decoding.spec import method_names, registry
from mtad.settings import DRAFT_MODES, PARAMS, Settings

GREEN, YELLOW, RED, DIM, RESET = "\033[32m", "\033[33m", "\033[31m", "\033[2m", "\033[0m"


def add_pair_args(p: argparse.ArgumentParser) -> None:
    """--pair or --draft/--target, with device, dtype and device map (shared with the bench)."""
    p.add_argument("--pair", help="preset name from assets/pairs.toml (default: embedded)")
    p.add_argument("--draft", help="draft model: local directory or Hub id")
    p.add_argument("--target", help="target model: local directory or Hub id")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1 ...")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (MTAD_DTYPE, else the preset's, else bf16 on CUDA >= sm80 and CPUs with native bf16, "
        "fp16 on older GPUs, fp32 on other CPUs), float32, bfloat16, float16",
    )
    p.add_argument(
        "--device-map",
        choices=("auto", "none"),
        default=None,
        help="auto: split the target over all GPUs (then the CPU) with accelerate, draft on its first device; "
        "--device cpu keeps the pair whole on the CPU (default: MTAD_DEVICE_MAP, else none)",
    )
    add_engine_arg(p)


def add_engine_arg(p: argparse.ArgumentParser) -> None:
    """--engine: how the target runs (shared with the bench)."""
    p.add_argument(
        "--engine",
        choices=("auto", "eager", "compiled"),
        default="auto",
        help="eager: transformers' forward; compiled: both models over static caches, their decoding shapes "
        "compiled with torch.compile before timing (about 20 s the first time on a 2-core CPU, seconds once inductor "
        "keeps the code on disk) and, on a GPU, replayed from CUDA graphs; auto: compiled wherever it can run the "
        "target, else eager "
        "(default: MTAD_ENGINE, else auto; generate's auto is eager: for one prompt compiling costs more than "
        "it saves)",
    )


def add_tuning_args(p: argparse.ArgumentParser) -> None:
    """--tuned and --acceptance: SD's and MTAD's draft settings chosen on this machine (shared with the bench)."""
    p.add_argument(
        "--tuned",
        action="store_true",
        help="sd and mtad: the draft length (and MTAD's beams) predicted fastest on this machine, instead of "
        "--gamma and --beams (python -m mtad.tuning show; the first time on a machine, every candidate is timed)",
    )
    p.add_argument(
        "--acceptance", type=Path, help="with --tuned: the pair's acceptance table (default: the one its preset names)"
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The decoding settings every method understands (shared with the bench)."""
    d = Settings()
    p.add_argument("--greedy", action="store_true", help="argmax everywhere (the T->0 limit)")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-k", type=int, default=d.top_k, help="0 turns top-k off")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--draft-mode", choices=DRAFT_MODES, default=d.draft_mode)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)


def load_pair_from_args(args: argparse.Namespace):  # noqa: ANN201
    """The pair the flags name: --draft/--target together, else --pair, else the default preset; on the
    CPU it then runs on the thread count its target's products measure fastest on (``choose_threads``)."""
    from mtad.models.devices import bf16_note

    pair = _load_pair_from_args(args)
    if note := bf16_note(pair.device, pair.dtype):
        print(f"note: {note}", file=sys.stderr)
    if pair.device.type == "cpu":
        from mtad.models.kernels import choose_threads

        choose_threads(pair.target)
    return pair


def _load_pair_from_args(args: argparse.Namespace):  # noqa: ANN202
    from transformers.utils import logging as hf_logging

    from mtad.models.errors import PairError
    from mtad.models.pair import load, load_pair
    from mtad.models.presets import default_pair_name

    hf_logging.disable_progress_bar()  # per-shard bars are noise on a terminal that wants the text

    if bool(args.draft) != bool(args.target):
        raise PairError("give both --draft and --target, or neither (then --pair chooses)")
    how = dict(device=args.device, dtype=args.dtype, device_map=args.device_map, engine=args.engine)
    if args.draft:
        if args.pair:
            raise PairError("give either --pair or --draft/--target, not both")
        return load(args.draft, args.target, **how)
    return load_pair(args.pair or default_pair_name(), **how)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mtad", description="Multi-token assisted decoding")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="decode one prompt and show which drafts were accepted")
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


def span(field: str) -> str:
    """A setting's engine range for a flag's help, from ``mtad.settings.PARAMS``: ``1-32``, ``[0, 1]``, ``>= 0``."""
    p = PARAMS[field]
    if p.kind is int:
        return f"{p.lo}-{p.hi}"
    return f">= {p.lo:g}" if p.hi == float("inf") else f"[{p.lo:g}, {p.hi:g}]"


def sampling_settings(args: argparse.Namespace) -> Settings:
    """The settings every method shares, from the flags of :func:`add_sampling_args` (bench too)."""
    return Settings(
        greedy=args.greedy,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        draft_mode=args.draft_mode,
        max_new_tokens=args.max_new_tokens,
    )


def settings_from_args(args: argparse.Namespace, method: str) -> Settings:
    """The whole ``generate`` settings: the shared sampling flags plus the method's own (gamma defaults
    to the method's paper value when not given)."""
    gamma = Settings.for_method(method).gamma if args.gamma is None else args.gamma
    own = {"beams": args.beams, "tau": args.tau, "num_drafts": args.num_drafts, "tau1": args.tau1, "tau2": args.tau2}
    return sampling_settings(args).with_(method=method, gamma=gamma, seed=args.seed, **own).validate()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = settings_from_args(args, args.method)
        from mtad.decoding import generate
        from mtad.metrics import summarize

        if args.engine == "auto" and not os.environ.get("MTAD_ENGINE"):
            args.engine = "eager"  # one prompt: compiling its shapes takes longer than decoding it eagerly
        pair = load_pair_from_args(args)
        if args.tuned:
            settings = tuned_settings(pair, settings, args.acceptance)
        if pair.engine == "compiled":  # compiled before the clock starts, so the speed printed is decoding's
            from mtad.decoding.static_lm import warm_up_pair, warm_up_settings

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
