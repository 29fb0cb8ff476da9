"""The flags every command shares (the pair, its device and dtype, the engine, the sampling settings) and the
pair they name: ``mtad generate``, ``mtad bench``, ``mtad tuning``, ``mtad audit`` read them here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtad.settings import DRAFT_MODES, PARAMS, Settings


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
        "--gamma and --beams (mtad tuning show; the first time on a machine, every candidate is timed)",
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
