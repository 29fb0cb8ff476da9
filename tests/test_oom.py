"""Out-of-memory recovery frees what the failed run held (mtad/ui/runner.py): on this CPU a target forward
raises CUDA's OOM error midway through a real decode, and weak references show whether the KV caches and
logits are gone by the time the cache is emptied (on a GPU: docs/dev/gpu-checks.md)."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch

from mtad.decoding.kv import CachedLM
from mtad.models.errors import PairError
from mtad.settings import Settings
from mtad.ui import runner


@pytest.fixture
def release_log(monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    """(refs, alive): weak references to tensors a failed run held, and at each release which were alive."""
    refs: list[weakref.ref] = []
    alive: list[list[bool]] = []
    monkeypatch.setattr(runner, "free_device_memory", lambda: alive.append([r() is not None for r in refs]))
    return refs, alive


@pytest.mark.parametrize("method", ["ar", "sd", "mtad"])
def test_an_oom_mid_run_releases_caches_and_logits_before_emptying(
    monkeypatch: pytest.MonkeyPatch, tiny_pair, release_log, method: str
) -> None:
    refs, alive = release_log
    real_feed = CachedLM.feed
    calls = {"n": 0}

    def feed(self: CachedLM, tokens: torch.Tensor, keep: int = 1, columns: bool = False) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 6:
            refs.extend(weakref.ref(t) for t in self.cache.tensors())
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        logits = real_feed(self, tokens, keep, columns)
        refs.append(weakref.ref(logits))
        return logits

    monkeypatch.setattr(CachedLM, "feed", feed)
    settings = Settings(method=method, max_new_tokens=40, gamma=2, beams=2, tau=0.5, seed=0)
    worker = runner.LaneWorker(tiny_pair, tiny_pair.encode("abcab"), settings, threading.Event())
    worker.run()  # in this thread: the worker's own code path, synchronously
    events = list(worker.events.queue)
    assert events[-1][:3] == ("end", "error", runner.OOM_MESSAGE)
    assert calls["n"] == 6 and len(refs) > 4  # the failure came mid-run, with caches filled
    assert alive == [[False] * len(refs)]  # released once, with nothing of the run left alive


def test_a_pair_that_does_not_fit_is_released_before_emptying(monkeypatch: pytest.MonkeyPatch, release_log) -> None:
    refs, alive = release_log

    def load_pair(name: str):  # noqa: ANN202
        half_loaded = torch.ones(1000)
        refs.append(weakref.ref(half_loaded))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 26.00 GiB")

    monkeypatch.setattr(runner, "load_pair", load_pair)
    with pytest.raises(PairError, match="does not fit in the GPU's memory") as info:
        runner.PairCache().get("embedded")
    assert alive == [[False]]
    assert info.value.__cause__ is None and info.value.__context__ is None  # no traceback keeps the frame alive
