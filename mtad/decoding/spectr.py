"""Spectr (Sun et al. 2023): m i.i.d. drafts verified with k-sequential selection (K-SEQ), exact."""

from __future__ import annotations

import math

import torch

from mtad.decoding.multidraft import Trial, multi_draft, residual_top
from mtad.decoding.spec import MethodSpec
from mtad.settings import PARAMS


def kseq_rho(p: torch.Tensor, q: torch.Tensor, k: int, iters: int = 40) -> float:
    """The smallest rho in [1, k] with 1 - (1 - beta)^k <= rho * beta, beta = sum min(q, p / rho).

    That inequality is what keeps K-SEQ's residual non-negative (so the output distribution is p); the
    acceptance 1 - (1 - beta)^k falls as rho grows, so the smallest feasible rho is the best. Both
    sides are monotone in rho, so bisection finds it; the upper end (always feasible) is returned.
    min(q, p / rho) is zero wherever p or q is, so the bisection runs on the (top-k sized) tokens
    where both are positive, as Python floats: 41 sums over the vocabulary cost more than the draft."""
    both = (p > 0) & (q > 0)
    pairs = list(zip(q[both].tolist(), p[both].tolist(), strict=True))

    def feasible(rho: float) -> bool:
        beta = math.fsum(min(qx, px / rho) for qx, px in pairs)
        return 1 - (1 - beta) ** k <= rho * beta + 1e-12

    lo, hi = 1.0, float(k)
    if feasible(lo):
        return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


def kseq_residual(p: torch.Tensor, q: torch.Tensor, k: int, rho: float) -> torch.Tensor:
    """Where to draw from when no candidate passed: p minus the mass the k tries already gave."""
    accept = torch.minimum(q, p / rho)
    beta = float(accept.sum())
    if beta <= 0:
        return p
    return (p - accept * (1 - (1 - beta) ** k) / beta).clamp_min(0)


def kseq(
    p: torch.Tensor, q: torch.Tensor, cands: list[int], generator: torch.Generator, trial: Trial | None = None
) -> tuple[int | None, torch.Tensor]:
    """K-SEQ on k i.i.d. candidates from q: try each in turn, accepting x with min(1, p(x) / (rho q(x)));
    if none passes, draw from :func:`kseq_residual`. With k = 1 it is speculative sampling. ``trial``
    receives rho, the draws, p(x) and q(x) of each candidate tried, and the residual's top tokens."""
    k = len(cands)
    rho = kseq_rho(p, q, k)
    u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
    if trial is not None:
        trial.rho, trial.u = rho, u
    for i, x in enumerate(cands):
        if trial is not None:
            trial.p.append(p[x])
            trial.q.append(q[x])
        if u[i] * rho * q[x] < p[x]:
            return i, p
    residual = kseq_residual(p, q, k, rho)
    if trial is not None:
        trial.residuals.append(residual_top(residual / residual.sum()))
    return None, residual


SPECTR = multi_draft(kseq)
"""m i.i.d. drafts verified in one target forward, walked with K-SEQ."""


SPEC = MethodSpec(
    name="spectr",
    label="Spectr",
    short="Spectr",
    colour="#0d9488",
    params=(PARAMS["num_drafts"], PARAMS["gamma"]),
    step=SPECTR,
    exact=True,
    panel="kseq",
    rule="Spectr's K-SEQ tries the candidates' tokens in turn at each position (accept x with "
    "min(1, p/(ρq))), follows the candidates carrying the accepted token, and resamples from its residual "
    "when none passes (exact)",
    verify_tokens=lambda s: 1 + s.num_drafts * s.gamma,  # the pending token, then a token tree of every candidate
)
