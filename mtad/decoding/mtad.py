"""Multi-token assisted decoding (MTAD): beam draft, joint verification, longest passing prefix."""

from __future__ import annotations

import torch

from mtad.decoding.beams import Beams, beam_draft
from mtad.decoding.fused import fused
from mtad.decoding.iteration import Iteration, Verdict
from mtad.decoding.rules import longest_passing
from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState, kept_logprobs
from mtad.events import Step
from mtad.sampling import Law, RowLaws
from mtad.settings import PARAMS


def verify_best(st: DecodeState, beams: Beams) -> torch.Tensor:
    """One target forward over the draft's best beam; logits [g + 1, V]."""
    return st.run_target(beams.of_best(beams.tokens))


def mtad_accept(st: DecodeState, beams: Beams, logits: torch.Tensor) -> Verdict:
    """Keep the longest prefix eta of the best beam whose joint min(1, p/q) exceeds tau, then the
    target's token at eta + 1; the Step records every beam."""
    draft, lq_x = beams.of_best(beams.tokens), beams.of_best(beams.token_logq)
    joint_p, joint_q, eta, extra, kept_lp = judge(logits, draft, lq_x, st.law, st.log_tau, st.uniforms(), fuse=st.fused)
    more = (beams.tokens, beams.scores, beams.best)
    return Verdict(
        draft, joint_p, joint_q, eta, extra, kept_lp, draft_calls=draft.numel(), more=more, record=record_beams
    )


@fused
def judge(
    logits: torch.Tensor,
    draft: torch.Tensor,
    lq_x: torch.Tensor,
    law: Law,
    threshold: float | torch.Tensor | None,
    u: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """MTAD's rule on the target's [g + 1, V] ``logits`` over ``draft`` [g], whose log q's are ``lq_x``,
    with log τ ``threshold`` (:func:`~mtad.decoding.rules.longest_passing`): the joint log p's and log q's,
    eta, the target's token at eta + 1 (drawn at uniform ``u``, None when greedy) and the kept tokens'
    unwarped log p's. Compiled into a few kernels on a GPU (:mod:`mtad.decoding.fused`)."""
    laws = RowLaws(logits, law)
    joint_p, joint_q = laws.of(draft).cumsum(0), lq_x.cumsum(0)
    eta = longest_passing(joint_p, joint_q, threshold)
    extra = laws.pick(eta.view(1), law, u)
    return joint_p, joint_q, eta, extra, kept_logprobs(logits, draft, eta, extra)


def record_beams(step: Step, values: list) -> None:
    """The draft's beams, their joint log q and the best one's index, for the page's beam table."""
    step.beams, step.beam_scores, step.best_beam = values[:3]


MTAD = Iteration(propose=beam_draft, verify=verify_best, accept=mtad_accept)
"""Beam-draft W beams, verify the best one jointly, keep its longest passing prefix plus a target token."""


def mtad_step(st: DecodeState) -> Step:
    """One MTAD iteration (:data:`MTAD`): eta accepted drafts plus one token from the target at eta+1."""
    return MTAD(st)


SPEC = MethodSpec(
    name="mtad",
    label="MTAD",
    short="MTAD",
    colour="#ea580c",
    params=(PARAMS["beams"], PARAMS["gamma"], PARAMS["tau"], PARAMS["draft_mode"]),
    step=mtad_step,
    panel="mtad",
    feature_draft=True,
)
