"""Each decoder iteration reads the device exactly once (``to_host``): counted on this CPU by intercepting every
host read torch offers (``_local_scalar_dense``, behind ``.item()``, ``bool()``, ``int()`` and indexing with a
0-d tensor; ``.tolist()``, ``.cpu()``, ``.numpy()``) and a number written into one element (a blocking copy in
on a GPU), and on a GPU with ``torch.cuda.set_sync_debug_mode``."""

from __future__ import annotations

import dataclasses
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
    """Counts ``aten._local_scalar_dense``, what every tensor-to-Python-number conversion runs, and a number
    written into one element (``t[i] = 0.0``: a ``copy_`` from a 0-d host tensor, a blocking host-to-device
    copy on a GPU, which ``set_sync_debug_mode`` counts as a sync)."""

    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts["scalar"] += 1
        elif func is torch.ops.aten.copy_.default and args[0].dim() == 0 and args[1].dim() == 0:
            self.counts["scalar_write"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """A Counter of host reads inside the block (by kind), with the warps' CPU-only reads off as on a GPU
    (``mtad.sampling.reads_free``: a read that is free on the CPU skips a rare branch there, or works out
    the draft's context bias on the host)."""
    counts: Counter = Counter()
    monkeypatch.setattr("mtad.sampling.reads_free", lambda t: False)
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
        x[1] = 7.0
        x.narrow(0, 2, 1).fill_(7.0)  # the number a kernel argument: no copy
    assert counts == Counter(scalar=4, tolist=1, scalar_write=1)


def test_the_warps_read_the_host_only_on_the_cpu() -> None:
    """The warps' own reads (which branch a distribution needs) happen on the CPU only: a tensor elsewhere (here
    on the meta device, which cannot be read at all) always takes the general path."""
    from mtad.sampling import _none_on_cpu

    assert _none_on_cpu(torch.zeros(3)) and not _none_on_cpu(torch.ones(3))
    assert not _none_on_cpu(torch.zeros(3, device="meta"))


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


@pytest.mark.parametrize("method", ["ar", "sd", "mtad"])
def test_one_host_read_per_iteration_over_fixed_input_forwards(
    monkeypatch: pytest.MonkeyPatch, embedded, method: str
) -> None:
    """The compiled engine as it runs on a GPU (CUDA graphs' fixed inputs, filled on the device), with plain
    calls here: still one host read an iteration."""
    monkeypatch.setattr("mtad.decoding.static_lm.graphs_enabled", lambda device: True)
    pair = dataclasses.replace(embedded, engine="compiled")
    settings = Settings(method=method, max_new_tokens=60, gamma=3, beams=3, tau=0.1, seed=1)
    st = DecodeState.start(pair, pair.encode("def add(a, b):\n    "), settings)
    assert st.target.graphs is not None
    for _ in range(4):
        with host_reads(monkeypatch) as counts:
            DECODERS[method].step(st)
        assert counts == Counter(tolist=1), counts


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
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_one_cuda_sync_per_iteration(method: str, engine: str) -> None:
    """On the compiled engine the forwards replay CUDA graphs, captured in the warm-up run."""
    pair = load_pair("embedded", device="cuda", engine=engine)
    settings = Settings(method=method, max_new_tokens=40, gamma=3, beams=3, tau=0.1, seed=0)
    list(decode(pair, pair.encode("def add(a, b):\n    "), settings))  # warm-up: the same shapes, captured
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = list(decode(pair, pair.encode("def add(a, b):\n    "), settings))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchronizing" in str(w.message)]
    assert len(syncs) == len(steps), [str(w.message) for w in syncs[:5]]


OWN_LOOPS = sorted(m for m in DECODERS if m != "hf-assisted")  # hf-assisted runs transformers' own loop


@pytest.mark.parametrize("method", OWN_LOOPS)
def test_no_decoder_writes_a_host_number_into_a_device_tensor(
    monkeypatch: pytest.MonkeyPatch, embedded, method: str
) -> None:
    """Every decoder, the ones whose host reads differ from one an iteration too: no ``t[i] = number``,
    which on a GPU is a blocking copy in, a sync the iteration's count does not allow for."""
    settings = Settings(method=method, max_new_tokens=40, gamma=3, beams=3, tau=0.1, seed=1)
    st = DecodeState.start(embedded, embedded.encode("def add(a, b):\n    "), settings)
    for _ in range(4):
        with host_reads(monkeypatch) as counts:
            DECODERS[method].step(st)
        assert counts["scalar_write"] == 0, counts
