"""The compiled engine's repeated forwards as CUDA graphs: one launch for a whole forward of the model.

On a GPU a one-token forward of a small model is host-bound: the GPU's work is a few milliseconds, the
host's launches of hundreds of kernels more. A forward shape decoding repeats (one token, a verification
of γ + 1, a beam step over W rows) is captured once as a CUDA graph over fixed input tensors and the
model's key/value buffers, and replayed after its inputs are copied in. Fixed shapes: a captured forward
attends over the cache's whole capacity with a mask, so a growing context replays the same graph; new
buffers (a larger capacity) void the graphs captured over the old ones.

Without ``capture`` (a CPU, where there are no graphs) the same fixed inputs feed a plain call, so the
bookkeeping here is tested on any machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtad.models.devices import to_device


def graphs_enabled(device: torch.device) -> bool:
    """Whether the compiled engine captures CUDA graphs on ``device``: on CUDA, unless the operator's
    ``MTAD_CUDA_GRAPHS=0`` turns them off (to measure what they bring)."""
    return device.type == "cuda" and os.environ.get("MTAD_CUDA_GRAPHS", "1") != "0"


@dataclass
class Captured:
    """One forward shape's fixed inputs, its graph (None without capture) and its output tensor."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None


class ForwardGraphs:
    """The captured forwards of one model over one set of key/value buffers (a
    :class:`~mtad.decoding.static_lm.StaticKV`), keyed by rows, tokens, kept positions and layer form."""

    def __init__(self, capture: bool) -> None:
        self.capture = capture
        self.epoch = -1
        self.shapes: dict[tuple, Captured] = {}

    def run(
        self,
        key: tuple,
        tokens: torch.Tensor,
        past: int,
        capacity: int,
        epoch: int,
        forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        positions: torch.Tensor | None = None,
        allow: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward(tokens, positions, slots, mask)`` of ``tokens`` [rows, n] written at slots ``past …``,
        replayed from its graph (captured on first use). ``positions`` [n] (rotary) default to the slots
        and ``allow`` [n, past + n] to causal attention; a mask over the whole ``capacity`` hides the
        slots past them. ``epoch``: the buffers' (:attr:`StaticKV.epoch`); a new one voids every graph.
        The logits are a copy: the graph's own output is overwritten by its next replay."""
        if epoch != self.epoch:
            self.shapes.clear()
            self.epoch = epoch
        n = tokens.shape[1]
        device = tokens.device
        entry = self.shapes.get(key)
        new = entry is None
        if new:
            entry = self.shapes[key] = Captured(
                tokens=torch.empty_like(tokens),
                positions=torch.empty(n, dtype=torch.long, device=device),
                slots=torch.empty(n, dtype=torch.long, device=device),
                mask=torch.empty(n, capacity, dtype=torch.bool, device=device),
            )
        self._fill(entry, tokens, past, capacity, positions, allow)
        if new and self.capture:
            entry.graph, entry.out = self._capture(
                lambda: forward(entry.tokens, entry.positions, entry.slots, entry.mask)
            )
        if entry.graph is None:
            return forward(entry.tokens, entry.positions, entry.slots, entry.mask)
        entry.graph.replay()
        return entry.out.clone()

    @staticmethod
    def _fill(
        entry: Captured,
        tokens: torch.Tensor,
        past: int,
        capacity: int,
        positions: torch.Tensor | None,
        allow: torch.Tensor | None,
    ) -> None:
        """Copy one forward's inputs into the fixed tensors, on the device (no host read, no pageable copy)."""
        n = tokens.shape[1]
        entry.tokens.copy_(tokens)
        torch.arange(past, past + n, out=entry.slots)
        if positions is None:
            entry.positions.copy_(entry.slots)
        else:
            entry.positions.copy_(to_device(positions, tokens.device))
        if allow is None:  # query i sits at slot past + i and sees every slot up to it
            torch.le(torch.arange(capacity, device=tokens.device)[None, :], entry.slots[:, None], out=entry.mask)
        else:
            entry.mask.zero_()
            entry.mask[:, : allow.shape[1]].copy_(to_device(allow, tokens.device))

    @staticmethod
    def _capture(run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """PyTorch's recipe: run twice on a side stream (compiles, lazy initialisations), then capture. The
        forward writes the same keys and values each time, so running it more than once changes nothing.
        ``thread_local``: another thread's CUDA work (the page's other lane) does not break the capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = run()
        return graph, out
