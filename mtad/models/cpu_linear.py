"""Linear layers computed the way a CPU reads bf16 weights fastest.

A decoding forward multiplies a few rows of activations by every weight matrix, so it costs what
it reads. On AMX and AVX512-BF16 CPUs (oneDNN) the bf16 product written ``x @ W.T`` (``F.linear``)
streams the weights slower than the same product written weight-first, ``(W @ x.T).T``, once there are two rows or more; for a single row both take a
matrix-vector path that is slower still, so one row is computed as two identical rows. fp32 and
other devices keep ``F.linear``, which is as fast or faster there. The values are the same product
(fp32 accumulation, one bf16 rounding), not bit for bit the same sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


def stationary_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, as ``(weight @ x.T).T`` for bf16 on the CPU (see the module)."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.requires_grad:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows == 1:
        flat = flat.expand(2, -1)  # two rows take the matrix-matrix kernel; one takes a slower path
    out = weight @ flat.t() if bias is None else torch.addmm(bias[:, None], weight, flat.t())
    out = out.t()[:rows].contiguous()  # contiguous: later ops read it row by row
    return out.reshape(*x.shape[:-1], weight.shape[0])


class StationaryLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`stationary_linear`; same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stationary_linear(x, self.weight, self.bias)


def replace_linears(root: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Put ``make(layer)`` in place of every ``nn.Linear`` under ``root`` (``make`` may hand a layer
    back to keep it); returns how many were replaced."""
    replaced = 0
    for module in list(root.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and (new := make(child)) is not child:
                setattr(module, name, new)
                replaced += 1
    return replaced
