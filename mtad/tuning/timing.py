"""An iteration's seconds on this machine, timed with the decoders themselves and kept on disk.

What a decoding iteration costs (γ draft steps, one verification of γ + 1 tokens, the bookkeeping) depends
on the CPU or GPU, the dtype, the engine, the kernels and the thread count, and hardly on the text: a few
iterations of each candidate, interleaved over rounds, give it. The figures are kept under ``$MTAD_CACHE``
keyed by everything that changes them, so a machine times once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch

from mtad.decoding import decode
from mtad.models.devices import capped_isa, device_model
from mtad.models.gguf_cache import cache_root
from mtad.models.pair import ModelPair
from mtad.settings import Settings

TIMING_PROMPT = "Explain how a refrigerator keeps food cold, step by step."
"""What the iterations are timed on: any text the target answers at length will do (the seconds hardly
depend on it)."""


def machine_key(pair: ModelPair) -> dict[str, object]:
    """Everything an iteration's seconds depend on besides the settings: the pair and where and how it runs."""
    from mtad.bench.report import git_commit

    return {
        "pair": pair.name,
        "draft": str(getattr(pair.draft, "name_or_path", "")),
        "target": str(getattr(pair.target, "name_or_path", "")),
        "device": device_model(pair.device),
        "emulation": capped_isa(),
        "dtype": str(pair.dtype).replace("torch.", ""),
        "engine": pair.engine,
        "kernels": dict(pair.kernels),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "commit": git_commit(),
    }


def cache_file(key: dict[str, object]) -> Path:
    """Where the seconds measured under ``key`` are kept."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "tuning" / f"{digest}.json"


Progress = Callable[[int, int, Settings], None]
"""Told before each timing: how many timings were done, of how many, and the settings about to be timed."""


def time_iterations(
    pair: ModelPair,
    runs: Sequence[Settings],
    prompt_ids: list[int],
    iterations: int = 5,
    rounds: int = 3,
    progress: Progress | None = None,
) -> list[float]:
    """Each setting's seconds an iteration: over ``rounds`` rounds that take the settings in turn (so a
    machine whose speed drifts weighs on all alike), the least of each round's mean over ``iterations``
    iterations after the first (which reads the prompt): other work on the machine only ever adds time. An
    untimed round first compiles what is new."""
    seconds: list[list[float]] = [[] for _ in runs]
    for r in range(rounds + 1):
        for i, settings in enumerate(runs):
            if progress is not None:
                progress(r * len(runs) + i, (rounds + 1) * len(runs), settings)
            steps = []
            long_enough = (iterations + 2) * (settings.gamma + 1)  # a full iteration writes γ + 1 tokens
            settings = settings.with_(max_new_tokens=max(settings.max_new_tokens, long_enough))
            with contextlib.closing(decode(pair, prompt_ids, settings)) as stream:
                for step in stream:
                    steps.append(step)
                    if len(steps) > (iterations if r else 1):
                        break
            later = steps[1:]
            if not later:
                raise ValueError(f"{settings.method} ended the text in its first iteration: time on a longer prompt")
            if r:
                seconds[i].append(sum(st.seconds for st in later) / len(later))
    return [min(s) for s in seconds]


def kept_seconds(pair: ModelPair) -> dict[str, float]:
    """The seconds this machine timed for ``pair`` before, by run name (empty when it never did)."""
    path = cache_file(machine_key(pair))
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return dict(json.loads(path.read_text())["seconds"])
    return {}


def cached_iteration_seconds(
    pair: ModelPair,
    runs: dict[str, Settings],
    prompt_ids: list[int],
    refresh: bool = False,
    progress: Progress | None = None,
    **how: int,
) -> tuple[dict[str, float], bool]:
    """``time_iterations`` for the named ``runs``, from the disk where this machine timed them before (unless
    ``refresh``); the seconds by name and whether they came from the disk."""
    key = machine_key(pair)
    path = cache_file(key)
    kept = {} if refresh else kept_seconds(pair)
    missing = [name for name in runs if name not in kept]
    if not missing:
        return {name: kept[name] for name in runs}, True
    measured = time_iterations(pair, [runs[n] for n in missing], prompt_ids, progress=progress, **how)
    kept |= dict(zip(missing, measured, strict=True))
    with contextlib.suppress(OSError):  # a read-only cache only costs the next start a timing
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"key": key, "date": datetime.now(UTC).isoformat(timespec="seconds"), "seconds": kept}
        path.write_text(json.dumps(record, indent=1) + "\n")
    return {name: kept[name] for name in runs}, False
