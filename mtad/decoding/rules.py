"""The acceptance rules as pure functions, shared by the decoders and the UI's re-judging."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def mtad_passes(log_p: Sequence[float], log_q: Sequence[float], tau: float) -> list[bool]:
    """Prefix j passes iff min(1, p_j / q_j) > tau, judged in log space.

    tau = 1 passes nothing (min(1, .) never exceeds 1); tau = 0 passes every prefix the
    target gives non-zero probability. A prefix the draft gives probability 0 never passes: the
    draft cannot have proposed it (a beam search pads with such beams when warping leaves fewer
    than W candidates), and its ratio p/0 would otherwise pass any tau.
    """
    if tau >= 1.0:
        return [False] * len(log_p)
    return [d > log_tau(tau) for d in log_ratios(log_p, log_q)]


def log_tau(tau: float) -> float:
    """log τ, the rule's threshold in log space: −inf at τ = 0 and 0 at τ >= 1 (where nothing passes)."""
    return math.log(tau) if 0 < tau < 1 else (0.0 if tau >= 1 else -math.inf)


def log_ratios(log_p: Sequence[float], log_q: Sequence[float]) -> list[float]:
    """log p_j − log q_j per prefix: what the rule compares with log τ (−inf where p_j = 0 or q_j = 0)."""
    return [
        lp - lq if math.isfinite(lp) and math.isfinite(lq) else -math.inf for lp, lq in zip(log_p, log_q, strict=True)
    ]


def mtad_accept_length(log_p: Sequence[float], log_q: Sequence[float], tau: float) -> int:
    """Length of the LONGEST passing prefix (a later prefix may pass after an earlier fails)."""
    passed = mtad_passes(log_p, log_q, tau)
    return max((j + 1 for j, ok in enumerate(passed) if ok), default=0)


def mtad_accept_length_t(joint_p: torch.Tensor, joint_q: torch.Tensor, tau: float) -> torch.Tensor:
    """Device-side twin of :func:`mtad_accept_length` (no host sync): a 0-d long tensor."""
    return longest_passing(joint_p, joint_q, None if tau >= 1.0 else log_tau(tau))


def longest_passing(
    joint_p: torch.Tensor, joint_q: torch.Tensor, threshold: float | torch.Tensor | None
) -> torch.Tensor:
    """:func:`mtad_accept_length_t` with τ given as its log, ``threshold`` (:func:`log_tau`, a number or a
    0-d tensor; None where nothing passes, τ >= 1): a compiled rule takes a tensor, so that a new τ is an
    input to its graph, not a new graph."""
    g = joint_p.numel()
    if threshold is None or g == 0:
        return torch.zeros((), dtype=torch.long, device=joint_p.device)
    # float64, like the host twin, so re-judging the recorded joints gives the same answer.
    ok = (joint_p.double() - joint_q.double() > threshold) & torch.isfinite(joint_p) & torch.isfinite(joint_q)
    lengths = torch.arange(1, g + 1, device=joint_p.device)
    return (ok.long() * lengths).max()


def sd_accept_length_t(token_p: torch.Tensor, token_q: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Speculative sampling, on the device: accept x_i while u_i < min(1, p_i(x_i) / q_i(x_i)),
    stopping at the first rejection; a 0-d long tensor (no host sync)."""
    ok = uniforms * token_q < token_p
    return ok.long().cumprod(0).sum()
