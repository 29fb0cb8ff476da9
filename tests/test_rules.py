"""The acceptance rules on hand-made cases where the right answer is known."""

import math

import pytest
import torch

from mtad.decoding.rules import mtad_accept_length, mtad_accept_length_t, mtad_passes, sd_accept_length_t

L = math.log


def joint(*probs: float) -> list[float]:
    out, acc = [], 0.0
    for p in probs:
        acc += L(p)
        out.append(acc)
    return out


def both(log_p: list[float], log_q: list[float], tau: float) -> int:
    """Host rule and device rule must agree; return their answer."""
    host = mtad_accept_length(log_p, log_q, tau)
    dev = mtad_accept_length_t(torch.tensor(log_p, dtype=torch.float64), torch.tensor(log_q, dtype=torch.float64), tau)
    assert dev.dtype == torch.long and dev.dim() == 0
    assert host == int(dev)
    return host


def test_later_prefix_passes_after_earlier_fails() -> None:
    # prefix 1: p/q = 0.05/0.5 = 0.1 (fails tau 0.3); prefix 2: (0.05*0.9)/(0.5*0.1) = 0.9 (passes)
    log_p, log_q = joint(0.05, 0.9), joint(0.5, 0.1)
    assert mtad_passes(log_p, log_q, 0.3) == [False, True]
    assert both(log_p, log_q, 0.3) == 2


def test_longest_not_first_failure() -> None:
    # ratios by prefix: 1.0, 0.2, 0.8, 0.08 -> with tau 0.5 prefixes 1 and 3 pass; longest = 3
    log_p = [L(0.5), L(0.1), L(0.4), L(0.04)]
    log_q = [L(0.5)] * 4
    assert mtad_passes(log_p, log_q, 0.5) == [True, False, True, False]
    assert both(log_p, log_q, 0.5) == 3


def test_tau_zero_accepts_all_and_tau_one_none() -> None:
    log_p, log_q = joint(0.01, 0.01, 0.01, 0.01), joint(0.9, 0.9, 0.9, 0.9)
    assert both(log_p, log_q, 0.0) == 4
    assert both(log_p, log_q, 1.0) == 0
    # even a draft the target likes more than the draft does: min(1, p/q) = 1, never > 1
    assert both(joint(0.9, 0.9), joint(0.1, 0.1), 1.0) == 0


def test_zero_target_probability_never_passes() -> None:
    # the warped target gives the 2nd token probability 0: prefixes 2.. fail even at tau = 0
    log_p = [L(0.5), -math.inf, -math.inf]
    log_q = joint(0.5, 0.5, 0.5)
    assert both(log_p, log_q, 0.0) == 1


def test_boundary_is_strict() -> None:
    # ratio exactly tau does not pass (min(1, p/q) > tau is strict)
    log_p, log_q = [L(0.25)], [L(0.5)]
    assert both(log_p, log_q, 0.5) == 0
    assert both(log_p, log_q, 0.49) == 1


def test_mismatched_joints_are_refused() -> None:
    with pytest.raises(ValueError):
        mtad_passes([L(0.5), L(0.25)], [L(0.5)], 0.1)


@pytest.mark.parametrize(
    ("p", "q", "u", "n"),
    [
        ([0.5, 0.5], [0.5, 0.5], [0.99, 0.99], 2),  # p >= q always accepts
        ([0.1, 0.9], [0.5, 0.1], [0.3, 0.0], 0),  # 0.3 >= 0.1/0.5 rejects the first
        ([0.4, 0.1], [0.5, 0.5], [0.7, 0.1], 2),  # 0.7 < 0.8, 0.1 < 0.2
        ([0.4, 0.1], [0.5, 0.5], [0.7, 0.3], 1),  # second: 0.3 >= 0.2 rejects
        ([0.0, 0.5], [0.5, 0.5], [0.0, 0.0], 0),  # p = 0 (warped away) is never accepted, even at u = 0
        ([0.25], [0.5], [0.5], 0),  # u = p/q exactly rejects: accept iff u < p/q
    ],
)
def test_sd_rule(p: list[float], q: list[float], u: list[float], n: int) -> None:
    assert int(sd_accept_length_t(torch.tensor(p), torch.tensor(q), torch.tensor(u))) == n


def test_a_prefix_the_draft_gives_zero_probability_never_passes() -> None:
    # a beam search pads with beams of joint q = 0 when warping leaves fewer than W tokens: p/0 would
    # pass any tau, so such a prefix must fail, while the finite prefix before it is judged as usual
    log_p, log_q = [-0.1, -0.2], [-0.5, -math.inf]
    assert mtad_passes(log_p, log_q, 0.1) == [True, False]
    assert both(log_p, log_q, 0.1) == 1
    assert both(log_p, log_q, 0.0) == 1  # even at tau = 0
    assert both([-0.1, -0.2], [-math.inf, -math.inf], 0.0) == 0
