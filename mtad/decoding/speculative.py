"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): exact in distribution."""

from __future__ import annotations

import torch

from mtad.decoding.draft_distributions import DraftDistributions
from mtad.decoding.fused import fused
from mtad.decoding.iteration import Decision, Drafts, Iteration, iid_draft, verify_row
from mtad.decoding.rules import sd_accept_length_t
from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState, kept_logprobs
from mtad.sampling import RowDistributions, Warp, probs, sample
from mtad.settings import PARAMS


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where to resample after a rejection: norm(max(0, p - q)) (normalised by ``sample``)."""
    return (p - q).clamp_min(0)


def sd_accept(st: DecodeState, drafts: Drafts, logits: torch.Tensor) -> Decision:
    """Accept draft i with min(1, p/q) until the first rejection; then resample from the residual, or
    after g accepted drafts draw the bonus token from p. Greedy: keep drafts while they are argmax p."""
    draft, q = drafts.tokens[0], drafts.distributions.seq(0)
    # the acceptance tests' uniforms, then the one the extra token is drawn at (None when greedy)
    tests = None if st.settings.is_greedy else torch.rand(draft.numel(), generator=st.generator, device=st.device)
    lp_x, lq_x, n, extra, kept_lp = sd_rule(logits, draft, q, st.warp, tests, st.uniforms(), fuse=st.fused)
    return Decision(draft, lp_x.cumsum(0), lq_x.cumsum(0), n, extra, kept_lp, draft_calls=draft.numel(), uniforms=tests)


@fused
def sd_rule(
    logits: torch.Tensor,
    draft: torch.Tensor,
    q: DraftDistributions,
    warp: Warp,
    tests: torch.Tensor | None,
    u: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """SD's rule on the target's [g + 1, V] ``logits`` over ``draft`` [g] drawn from the distributions ``q`` [g], with
    the acceptance tests' uniforms ``tests`` [g] and the target token's ``u`` (None when greedy): log p and
    log q of each draft, how many are kept, the target's token after them (recovered after a rejection, the
    bonus token after none) and the kept tokens' unwarped log p's.
    Compiled into a few kernels on a GPU (:mod:`mtad.decoding.fused`)."""
    g = draft.numel()
    p_rows = RowDistributions(logits, warp)
    lp_x = p_rows.of(draft)
    lq_x = q.of(draft)
    if tests is None:  # greedy: keep drafts while they are argmax p, whole rows at T = 1
        n = (p_rows.full[:g].argmax(dim=-1) == draft).long().cumprod(0).sum()
        extra = p_rows.full.index_select(0, n.view(1))[0].argmax()
    else:
        n = sd_accept_length_t(lp_x.exp(), lq_x.exp(), tests)
        row = n.view(1)  # index_select, not [0-d tensor] indexing, which reads the index on the host
        # only row n's p_rows: the target's p there, and q there after a rejection (none after g accepted)
        p, tokens = p_rows.probs_at(row)  # where p lives on its top-k list, so does the residual: q is read there
        at = row.clamp(max=g - 1)
        q_p = (probs(q.row(at)) if tokens is None else q.at(at, tokens)[0].exp()) * (n < g)
        table = residual(p, q_p)  # after g accepted drafts, p itself: the bonus token
        extra = sample(torch.where(table.sum() > 0, table, p), u)
        if tokens is not None:
            extra = tokens[0].take(extra)
    return lp_x, lq_x, n, extra, kept_logprobs(logits, draft, n, extra)


SD = Iteration(propose=iid_draft, verify=verify_row, accept=sd_accept)
"""Draft g tokens from warp(q), verify them in one target forward, accept with min(1, p/q)."""


SPEC = MethodSpec(
    name="sd",
    label="Speculative decoding",
    short="SD",
    colour="#2563eb",
    params=(PARAMS["gamma"],),
    step=SD,
    exact=True,
    panel="sd",
    feature_draft=True,
)
