"""SpecInfer (Miao et al. 2023): m draft sequences merged into a token tree, verified with
multi-step speculative sampling (MSS), exact in distribution."""

from __future__ import annotations

import torch

from mtad.decoding.multidraft import multi_step
from mtad.decoding.state import DecodeState
from mtad.events import Step


def mss_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """After a rejection the next candidate is judged against norm(max(0, p - q))."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def mss(
    p: torch.Tensor, q: torch.Tensor, cands: list[int], generator: torch.Generator
) -> tuple[int | None, torch.Tensor]:
    """MSS on k i.i.d. candidates from q: candidate i is accepted with min(1, p_i(x) / q(x)), where
    p_1 = p and p_{i+1} is the residual of p_i; if all fail, draw from the last residual."""
    u = torch.rand(len(cands), generator=generator, device=p.device, dtype=p.dtype)
    for i, x in enumerate(cands):
        if u[i] * q[x] < p[x]:
            return i, p
        p = mss_residual(p, q)
    return None, p


def specinfer_step(st: DecodeState) -> Step:
    """One SpecInfer iteration: ``num_drafts`` i.i.d. drafts of gamma tokens, MSS down their token tree."""
    return multi_step(st, mss)
