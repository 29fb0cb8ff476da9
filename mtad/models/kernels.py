"""Which linear-layer kernel a CPU model runs, chosen on this machine by measuring it.

A decoding forward multiplies a few rows of activations by every weight matrix, so the kernel that
streams the weights fastest for 1 row (AR, SD's drafts) and for γ + 1 rows (a verification) sets the
speed. Which one that is depends on the CPU and the dtype, and no flag predicts it well:

- ``mkl``: PyTorch's own ``F.linear``. On AVX2-only CPUs in fp32 its small-row sgemm makes a
  5-row product cost far more than a 1-row one, so a verification costs much more than a token.
- ``stationary``: the weight-first bf16 product (:mod:`mtad.models.cpu_linear`), fast on AMX Xeons; on a
  CPU without native bf16 it is slower than ``mkl``.
- ``onednn``: weights prepacked once for oneDNN (``torch.ops.mkldnn._reorder_linear_weight``) and
  multiplied by ``_linear_pointwise``; fp32 and bf16.

At load, :func:`choose` times every candidate on the model's own weight shapes for 1 and 5 rows,
interleaved, and keeps the fastest total (a short probe next to the load); ``MTAD_CPU_LINEAR`` names one
instead.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from mtad.models.cpu_attention import use_cpu_gqa_attention
from mtad.models.cpu_linear import StationaryLinear, replace_linears, stationary_linear
from mtad.models.devices import onednn_runs
from mtad.models.errors import PairError

KERNELS = ("mkl", "stationary", "onednn")
PROBE_ROWS = (1, 5)
"""Row counts a decoding forward multiplies: one token, and a γ = 4 verification (γ + 1 rows)."""


class OneDNNLinear(nn.Linear):
    """A linear layer whose weight is prepacked for oneDNN (CPU, fp32 or bf16, inference only).

    ``weight`` and ``bias`` stay the original parameters (a tied head stays tied, ``state_dict`` is
    unchanged); the forward reads only the packed copy, made when the layer is built and remade if
    the weight moves or changes dtype (``.to()``, a deep copy)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self._packed: tuple[tuple, torch.Tensor] | None = None
        self.packed()

    def packed(self) -> torch.Tensor | None:
        """The weight prepacked for oneDNN, made once per weight tensor; None where oneDNN cannot run its
        dtype here (a layer moved to bf16 on a CPU without oneDNN's bf16 path), which then runs ``F.linear``."""
        if not onednn_runs(self.weight.dtype):
            return None
        made_from = (self.weight.data_ptr(), self.weight.dtype)
        if self._packed is None or self._packed[0] != made_from:
            self._packed = (made_from, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None))
        return self._packed[1]

    def __deepcopy__(self, memo: dict) -> OneDNNLinear:
        """A copy with its own parameters (shared ones stay shared through ``memo``) and its own packing:
        a packed tensor has no storage to copy."""
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight = copy.deepcopy(self.weight, memo)
        plain.bias = copy.deepcopy(self.bias, memo)
        new = OneDNNLinear(plain)
        memo[id(self)] = new
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = None if x.requires_grad or x.dtype != self.weight.dtype or x.device.type != "cpu" else self.packed()
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """Kernels that can run ``dtype`` on this CPU: ``stationary`` is a bf16 kernel, oneDNN needs
    PyTorch's mkldnn build and, for bf16, the instructions its bf16 path needs (:func:`onednn_runs`)."""
    out = ["mkl"]
    if dtype == torch.bfloat16:
        out.append("stationary")
    if onednn_runs(dtype):
        out.append("onednn")
    return tuple(out)


def check_runs(kernel: str, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` with the reason where ``kernel`` cannot run ``dtype`` on this CPU: oneDNN's bf16
    path without the instructions it needs (any other pairing runs, if not fastest)."""
    if kernel not in KERNELS:
        raise ValueError(f"linear kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
    if kernel == "onednn" and dtype == torch.bfloat16 and not onednn_runs(dtype):
        raise ValueError(
            f"the onednn linear kernel cannot run {dtype} here: oneDNN's bf16 path needs AVX512-BW/VL/DQ or "
            f"AVX-NE-CONVERT, which this CPU (or its instruction-set cap) lacks; choose one of {', '.join(candidates(dtype))}"
        )


def product(kernel: str, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ weight.T`` computed by ``kernel``."""
    if kernel == "mkl":
        return lambda x: F.linear(x, weight)
    if kernel == "stationary":
        return lambda x: stationary_linear(x, weight)
    if kernel == "onednn":
        check_runs(kernel, weight.dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    raise ValueError(f"linear kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")


@torch.inference_mode()
def probe(weights: list[torch.Tensor], kernels: tuple[str, ...], rows: tuple[int, ...] = PROBE_ROWS) -> dict:
    """The fastest of several rounds, in seconds, each kernel takes for ``weights``' products at each row
    count, summed over the weights: rounds of every kernel in turn, so a busy machine slows them alike,
    and the minimum, the round least disturbed by other work."""
    fns = {k: [product(k, w) for w in weights] for k in kernels}
    xs = {r: [torch.randn(r, w.shape[1], dtype=w.dtype) for w in weights] for r in rows}
    times: dict[str, dict[int, list[float]]] = {k: {r: [] for r in rows} for k in kernels}
    for round_ in range(8):
        for k in kernels:
            for r in rows:
                t0 = time.perf_counter()
                for fn, x in zip(fns[k], xs[r], strict=True):
                    fn(x)
                if round_:  # the first round warms the kernels up
                    times[k][r].append(time.perf_counter() - t0)
    return {k: {r: min(ts) for r, ts in by_rows.items()} for k, by_rows in times.items()}


def probe_weights(model: nn.Module) -> list[torch.Tensor]:
    """One weight of each shape the model multiplies by (a decoder layer's and the output head's), in
    the model's dtype: a sample of what a forward streams. An int8 layer counts with its dequantised matrix,
    which is what its several-row products multiply by."""
    from mtad.models.shortlist_draft import Int8Linear

    dtype = next(model.parameters()).dtype
    seen, out = set(), []
    for m in model.modules():
        if type(m) in (nn.Linear, StationaryLinear, OneDNNLinear):
            weight = m.weight
        elif isinstance(m, Int8Linear):
            weight = m.qweight
        else:
            continue
        shape = tuple(weight.shape)
        if shape not in seen:  # the vocabulary head too: on AVX2 in fp32 it is where the kernels differ most
            seen.add(shape)
            out.append(m.dense(dtype) if isinstance(m, Int8Linear) else weight.detach())
    return out


def choose(model: nn.Module) -> str:
    """The linear kernel for a CPU model: ``MTAD_CPU_LINEAR`` when set, else the fastest by :func:`probe`
    over 1 and 5 rows (their times added), ``mkl`` when there is nothing to compare."""
    dtype = next(model.parameters()).dtype
    allowed = candidates(dtype)
    wanted = os.environ.get("MTAD_CPU_LINEAR", "auto")
    if wanted != "auto":
        if wanted not in KERNELS:
            raise ValueError(f"MTAD_CPU_LINEAR must be auto or one of {', '.join(KERNELS)}; got {wanted!r}")
        if wanted not in allowed:
            raise ValueError(f"MTAD_CPU_LINEAR={wanted} cannot run {dtype} here; choose one of {', '.join(allowed)}")
        return wanted
    weights = probe_weights(model)
    if len(allowed) == 1 or not weights:
        return allowed[0]
    timed = probe(weights, allowed)
    return min(allowed, key=lambda k: sum(timed[k].values()))


def choose_threads(model: nn.Module) -> int:
    """Run on the torch thread count under which ``model``'s products (1 and 5 rows, :func:`probe`) are
    fastest here, of one less than the cores (what loading sets: a core left to a page's server) and all
    of them; ``MTAD_CPU_THREADS`` when set. Returns the count now in use.

    On a 2-core machine with nothing else running, both cores make a small model's forwards faster than one;
    with the other core busy, two threads spin and are far slower, which the same measurement sees. The bench
    and the CLI call this; the page does not."""
    if os.environ.get("MTAD_CPU_THREADS"):
        return torch.get_num_threads()
    cores = os.cpu_count() or 1
    options = sorted({max(1, cores - 1), cores})
    weights = probe_weights(model)
    if len(options) == 1 or not weights:
        return torch.get_num_threads()
    kernel = getattr(model, "mtad_linear_kernel", "mkl")
    timed = {}
    for n in options * 2:  # twice each, alternating, so a passing disturbance hits both
        torch.set_num_threads(n)
        took = sum(probe(weights, (kernel,))[kernel].values())
        timed[n] = min(timed.get(n, took), took)
    torch.set_num_threads(min(options, key=timed.__getitem__))
    return torch.get_num_threads()


def use_linear_kernel(model: nn.Module, kernel: str) -> int:
    """Put ``kernel``'s layer in place of every plain ``nn.Linear`` (or one a previous choice made) in
    ``model``, and have int8 layers multiply their dequantised matrix with it; returns how many layers
    were replaced."""
    from mtad.models.shortlist_draft import Int8Linear

    params = next(model.parameters(), None)
    if params is not None:
        check_runs(kernel, params.dtype)
    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.kernel = "onednn" if kernel == "onednn" else "stationary"

    def make(child: nn.Linear) -> nn.Module:
        if type(child) not in (nn.Linear, StationaryLinear, OneDNNLinear):
            return child
        if kernel == "mkl":
            return child if type(child) is nn.Linear else _rebuilt(nn.Linear, child)
        if kernel == "stationary":
            return child if type(child) is StationaryLinear else _rebuilt(StationaryLinear, child)
        return child if type(child) is OneDNNLinear else OneDNNLinear(child)

    return replace_linears(model, make)


def use_cpu_kernels(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU model's faster paths, same products: grouped-query attention left to the kernel
    (``mtad.models.cpu_attention``) and the linear-layer kernel measured fastest here (:func:`choose`),
    recorded as ``model.mtad_linear_kernel``."""
    use_cpu_gqa_attention(model)
    try:
        kernel = choose(model)
    except ValueError as exc:
        raise PairError(str(exc)) from exc
    use_linear_kernel(model, kernel)
    model.mtad_linear_kernel = kernel
    return model


def _rebuilt(cls: type[nn.Linear], child: nn.Linear) -> nn.Linear:
    """A ``cls`` layer holding ``child``'s own parameters (no copy)."""
    new = cls(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
    new.weight, new.bias = child.weight, child.bias
    return new


@torch.inference_mode()
def forward_ms(
    models: dict[str, nn.Module], tokens: tuple[int, ...] = PROBE_ROWS, context: int = 100, reps: int = 7
) -> dict:
    """Median milliseconds of one forward of each count of new tokens after a ``context``-token cache,
    for each model, in rounds that alternate the models (so a busy machine slows them alike)."""
    from transformers import DynamicCache

    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in tokens} for k in models}
    for _ in range(reps):
        for name, model in models.items():
            vocab = model.config.vocab_size
            for n in tokens:
                cache = DynamicCache(config=model.config)
                model(
                    input_ids=torch.randint(0, vocab, (1, context)),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                t0 = time.perf_counter()
                model(
                    input_ids=torch.randint(0, vocab, (1, n)), past_key_values=cache, use_cache=True, logits_to_keep=n
                )
                times[name][n].append(time.perf_counter() - t0)
    return {k: {n: statistics.median(ts) * 1000 for n, ts in by_n.items()} for k, by_n in times.items()}
