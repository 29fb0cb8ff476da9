"""BiLD (Kim et al. 2023): big-little decoding with a fallback and a rollback threshold; approximate."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mtad.decoding.iteration import Decision, Drafts, Iteration, iid_draft, logprobs_of, verify_row
from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState, to_host
from mtad.events import Step
from mtad.sampling import sample_logp
from mtad.settings import PARAMS


def bild_rollback(token_nll: list[float], tau2: float) -> int:
    """How many drafts survive: those before the first whose target NLL exceeds ``tau2``."""
    for i, nll in enumerate(token_nll):
        if not nll <= tau2:  # NaN/inf (a token the target rules out) rolls back too
            return i
    return len(token_nll)


@dataclass
class LittleDraft(Drafts):
    """The little model's draft, and its top log q at each position it checked against tau1 (one more than
    the drafts when it fell back), for the panel."""

    tops: list[float]


def bild_draft(st: DecodeState, g: int) -> LittleDraft:
    """Draft from warp(q) until the little model's top probability for the next token falls below tau1
    (fallback: the big one writes that position) or g tokens are out. The fallback check reads each
    draft distribution on the host (one sync per draft token)."""
    log_tau1 = math.log(st.settings.tau1) if st.settings.tau1 > 0 else -math.inf
    tops: list[float] = []

    def unsure(lq: torch.Tensor) -> bool:
        """Whether the little model's likeliest next token falls below tau1 (read on the host)."""
        tops.append(float(lq.max()))  # the fallback test's own read, kept for the panel
        return tops[-1] < log_tau1

    drafts = iid_draft(st, g, stop=unsure)
    return LittleDraft(drafts.tokens, drafts.distributions, drafts.calls, tops)


def bild_accept(st: DecodeState, drafts: LittleDraft, logits: torch.Tensor) -> Decision:
    """Keep the drafts before the first whose negative log-likelihood under the target (the distribution
    the run samples from) exceeds tau2; the target adds its own token at that position (after a rollback,
    or at a fallback, or as the bonus after gamma kept drafts)."""
    draft = drafts.tokens[0]
    n_draft = draft.numel()
    log_p = st.judged(logits)
    lp_x = log_p[:n_draft].gather(1, draft[:, None])[:, 0]
    lq_x = drafts.log_q[0].gather(1, draft[:, None])[:, 0]
    draft_ids, nll = to_host(draft, -lp_x) if n_draft else ([], [])
    n = bild_rollback(nll, st.settings.tau2)
    extra = sample_logp(log_p[n], st.settings, generator=st.generator)
    kept_lp = logprobs_of(logits, torch.cat([draft[:n], extra.view(1)]))

    def record(step: Step, values: list) -> None:
        """The little model's top probability at each position it checked, for the panel."""
        step.draft_top_q = [math.exp(t) for t in drafts.tops]

    return Decision(
        draft_ids, lp_x.cumsum(0), lq_x.cumsum(0), n, extra, kept_lp, draft_calls=drafts.calls, record=record
    )


BILD = Iteration(propose=bild_draft, verify=verify_row, accept=bild_accept)
"""One BiLD iteration: the draft ("little") writes tokens from warp(q) until its top probability for the next
token falls below τ1 (fallback) or γ tokens are out; the target ("big") scores them in one forward, keeps
those before the first whose NLL exceeds τ2, and adds its own token. Not exact in distribution: a kept draft
token is the draft's draw, merely vetted by the target."""


SPEC = MethodSpec(
    name="bild",
    label="BiLD",
    short="BiLD",
    colour="#7c3aed",
    params=(PARAMS["gamma"].own(default=10), PARAMS["tau1"], PARAMS["tau2"]),  # γ 10: Table 13 of the MTAD paper
    step=BILD,
    panel="rollback",
    rule="BiLD keeps draft tokens until the first whose negative log-likelihood under the target exceeds τ2, "
    "then the target writes that position (not exact: kept tokens are the draft's)",
    feature_draft=True,
)
