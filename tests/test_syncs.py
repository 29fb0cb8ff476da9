"""Each decoder iteration reads the device exactly once (``to_host``): counted on this CPU by intercepting every
host read torch offers (``_local_scalar_dense``, behind ``.item()``, ``bool()``, ``int()`` and indexing with a
0-d tensor; ``.tolist()``, ``.cpu()``, ``.numpy()``), and on a GPU with ``torch.cuda.set_sync_debug_mode``."""

from __future__ import annotations

import warnings
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtad.decoding import DECODERS, decode
from mtad.decoding.state import DecodeState
from mtad.models.pair import load_pair
from mtad.settings import Settings


class _ScalarReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: what every tensor-to-Python-number conversion runs."""

    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts["scalar"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """A Counter of host reads inside the block (by kind)."""
    counts: Counter = Counter()
    for name in ("tolist", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            counts[_name] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    with _ScalarReads(counts):
        yield counts
    monkeypatch.undo()


@pytest.fixture(scope="module")
def embedded():  # noqa: ANN201
    return load_pair("embedded", device="cpu")  # a pair whose drafts are often accepted


def test_the_counter_sees_every_kind_of_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    x, i = torch.arange(6.0), torch.tensor(2)
    with host_reads(monkeypatch) as counts:
        x[i]  # noqa: B018 - the hidden read this test exists for
        x[:i]  # noqa: B018
        bool(x[0] > 0)
        x.sum().item()
        x.tolist()
        x.index_select(0, i.view(1))  # device-side: no read
    assert counts == Counter(scalar=4, tolist=1)


@pytest.mark.parametrize("method", ["ar", "sd", "mtad", "mtjd"])
@pytest.mark.parametrize("greedy", [True, False])
def test_one_host_read_per_iteration(monkeypatch: pytest.MonkeyPatch, embedded, method: str, greedy: bool) -> None:
    settings = Settings(method=method, greedy=greedy, max_new_tokens=60, gamma=3, beams=3, tau=0.1, seed=1)
    st = DecodeState.start(embedded, embedded.encode("def add(a, b):\n    "), settings)
    accepted = 0
    for _ in range(5):
        with host_reads(monkeypatch) as counts:
            step = DECODERS[method].step(st)
        assert counts == Counter(tolist=1), (step.index, counts)
        accepted += step.accepted
    assert method in ("ar", "mtjd") or accepted > 0  # the paths after an acceptance ran too


@pytest.mark.parametrize("greedy", [True, False])
def test_mtad_tree_reads_the_host_twice_per_iteration(monkeypatch: pytest.MonkeyPatch, embedded, greedy: bool) -> None:
    """MTAD over all beams reads the beams' token ids once to lay out the token tree (its shared
    prefixes), then its result once; nothing else (no 0-d tensor indexing)."""
    settings = Settings(method="mtad-tree", greedy=greedy, max_new_tokens=60, gamma=3, beams=3, tau=0.1, seed=1)
    st = DecodeState.start(embedded, embedded.encode("def add(a, b):\n    "), settings)
    for _ in range(4):
        with host_reads(monkeypatch) as counts:
            step = DECODERS["mtad-tree"].step(st)
        assert counts == Counter(tolist=2), (step.index, counts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: set_sync_debug_mode counts real syncs")
@pytest.mark.parametrize("method", ["ar", "sd", "mtad", "mtjd"])
def test_one_cuda_sync_per_iteration(method: str) -> None:
    pair = load_pair("embedded", device="cuda")
    settings = Settings(method=method, max_new_tokens=40, gamma=3, beams=3, tau=0.1, seed=0)
    list(decode(pair, pair.encode("def add(a, b):\n    "), settings))  # warm-up
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = list(decode(pair, pair.encode("def add(a, b):\n    "), settings))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchronizing" in str(w.message)]
    assert len(syncs) == len(steps), [str(w.message) for w in syncs[:5]]
