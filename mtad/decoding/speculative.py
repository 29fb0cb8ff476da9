"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): exact in distribution."""

from __future__ import annotations

import torch

from mtad.decoding.autoregressive import ar_step
from mtad.decoding.rules import sd_accept_length_t
from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState, kept_logprobs, to_host
from mtad.events import Step
from mtad.sampling import probs, sample
from mtad.settings import PARAMS


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where to resample after a rejection: norm(max(0, p - q)) (normalised by ``sample``)."""
    return (p - q).clamp_min(0)


def sd_step(st: DecodeState) -> Step:
    """Draft g tokens from warp(q), verify in one target forward, accept with min(1, p/q)."""
    g = st.draft_length()
    if g <= 0:
        return ar_step(st)
    t0 = st.begin()
    greedy = st.settings.is_greedy

    tokens = st.pending(st.draft)
    drafted, q_rows = [], []
    for _ in range(g):
        lq = st.draft_logq(tokens)[0]
        tok = st.draft_tokens(lq.argmax() if greedy else sample(probs(lq), st.generator))
        drafted.append(tok)
        q_rows.append(lq)
        tokens = tok.view(1, 1)
    draft = torch.stack(drafted)
    log_q = st.draft_full(torch.stack(q_rows))

    logits = st.run_target(draft)
    log_p = st.judged(logits)
    lp_x = log_p[:g].gather(1, draft[:, None])[:, 0]
    lq_x = log_q.gather(1, draft[:, None])[:, 0]
    if greedy:
        uniforms = None
        n = (log_p[:g].argmax(dim=-1) == draft).long().cumprod(0).sum()
    else:
        uniforms = torch.rand(g, generator=st.generator, device=st.device)
        n = sd_accept_length_t(lp_x.exp(), lq_x.exp(), uniforms)

    row = n.view(1)  # index_select, not [0-d tensor] indexing, which reads the index on the host
    if greedy:
        extra = log_p.index_select(0, row)[0].argmax()
    else:
        p, q = probs(log_p), probs(log_q)
        table = torch.cat([residual(p[:g], q), p[g:]], dim=0).index_select(0, row)[0]
        extra = sample(torch.where(table.sum() > 0, table, p.index_select(0, row)[0]), st.generator)

    kept_lp = kept_logprobs(logits, draft, n, extra)
    draft_ids, jp, jq, n_i, extra_i, kept_lps, us = to_host(
        draft, lp_x.cumsum(0), lq_x.cumsum(0), n, extra, kept_lp, uniforms
    )

    step = Step(
        index=0,
        method="sd",
        draft_ids=draft_ids,
        log_p=jp,
        log_q=jq,
        accepted=n_i,
        from_target=[False] * n_i + [True],
        target_logprobs=kept_lps[: n_i + 1],
        uniforms=us,
        draft_calls=g,
    )
    return st.finish(t0, step, draft_ids[:n_i] + [extra_i], n_i)


SPEC = MethodSpec(
    name="sd",
    label="Speculative decoding",
    short="SD",
    colour="#2563eb",
    params=(PARAMS["gamma"],),
    step=sd_step,
    exact=True,
    panel="sd",
)
