"""SpecInfer (Miao et al. 2023): m draft sequences merged into a token tree, verified with
multi-step speculative sampling (MSS), exact in distribution."""

from __future__ import annotations

import torch

from mtad.decoding.multidraft import Trial, multi_draft, residual_top
from mtad.decoding.spec import MethodSpec
from mtad.settings import PARAMS


def mss_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """After a rejection the next candidate is judged against norm(max(0, p - q))."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def mss(
    p: torch.Tensor, q: torch.Tensor, cands: list[int], generator: torch.Generator, trial: Trial | None = None
) -> tuple[int | None, torch.Tensor]:
    """MSS on k i.i.d. candidates from q: candidate i is accepted with min(1, p_i(x) / q(x)), where
    p_1 = p and p_{i+1} is the residual of p_i; if all fail, draw from the last residual. ``trial``
    receives the draws, p_i(x) and q(x) of each candidate tried, and each residual's top tokens."""
    u = torch.rand(len(cands), generator=generator, device=p.device, dtype=p.dtype)
    if trial is not None:
        trial.u = u
    for i, x in enumerate(cands):
        if trial is not None:
            trial.p.append(p[x])
            trial.q.append(q[x])
        if u[i] * q[x] < p[x]:
            return i, p
        p = mss_residual(p, q)
        if trial is not None:
            trial.residuals.append(residual_top(p))
    return None, p


SPECINFER = multi_draft(mss)
"""m i.i.d. drafts verified in one target forward (a token tree), walked with MSS."""


SPEC = MethodSpec(
    name="specinfer",
    label="SpecInfer",
    short="SpecInfer",
    colour="#db2777",
    params=(PARAMS["num_drafts"], PARAMS["gamma"]),
    step=SPECINFER,
    exact=True,
    panel="mss",
    rule="SpecInfer's MSS walks the token tree: children are tried in turn against p, then against "
    "norm(max(0, p − q)) after each rejection; the last residual gives the token when all fail (exact)",
    verify_tokens=lambda s: 1 + s.num_drafts * s.gamma,  # the pending token, then a token tree of every candidate
)
