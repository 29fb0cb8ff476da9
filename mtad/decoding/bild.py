"""BiLD (Kim et al. 2023): big-little decoding with a fallback and a rollback threshold; approximate."""

from __future__ import annotations

import math

import torch

from mtad.decoding.autoregressive import ar_step
from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState, to_host
from mtad.events import Step
from mtad.sampling import pick
from mtad.settings import PARAMS


def bild_rollback(token_nll: list[float], tau2: float) -> int:
    """How many drafts survive: those before the first whose target NLL exceeds ``tau2``."""
    for i, nll in enumerate(token_nll):
        if not nll <= tau2:  # NaN/inf (a token the target rules out) rolls back too
            return i
    return len(token_nll)


def bild_step(st: DecodeState) -> Step:
    """One BiLD iteration. The draft ("little") writes tokens from warp(q) until its top probability
    for the next token falls below tau1 (fallback) or gamma tokens are out; the target ("big") scores
    them in one forward, keeps those before the first whose negative log-likelihood under the target
    (the distribution the run samples from) exceeds tau2, and adds its own token at that position
    (after a rollback, or at a fallback, or as the bonus after gamma kept drafts).

    Not exact in distribution: a kept draft token is the draft's draw, merely vetted by the target.
    The fallback check reads each draft distribution on the host (one sync per draft token)."""
    g = st.draft_length()
    if g <= 0:
        return ar_step(st)
    t0 = st.begin()
    s = st.settings
    log_tau1 = math.log(s.tau1) if s.tau1 > 0 else -math.inf
    tokens = st.pending(st.draft)
    drafted, q_rows, calls, tops = [], [], 0, []
    while len(drafted) < g:
        lq = st.draft_logq(tokens)[0]
        calls += 1
        tops.append(float(lq.max()))  # the fallback test's own read, kept for the panel
        if tops[-1] < log_tau1:
            break  # fallback: the little model is unsure; the big one writes this position
        col = pick(lq, s, st.generator)
        tok = st.draft_tokens(col)
        drafted.append(tok)
        q_rows.append(lq.gather(0, col.view(1))[0])
        tokens = tok.view(1, 1)
    n_draft = len(drafted)
    draft = torch.stack(drafted) if drafted else None
    logits = st.run_target(draft)
    log_p = st.judged(logits)
    lp_x = log_p[:n_draft].gather(1, draft[:, None])[:, 0] if drafted else log_p[:0, 0]
    lq_x = torch.stack(q_rows) if drafted else lp_x
    draft_ids, nll = to_host(draft, -lp_x) if drafted else ([], [])
    n = bild_rollback(nll, s.tau2)
    extra = pick(log_p[n], s, st.generator)
    kept_ids = draft_ids[:n]
    rows = torch.arange(n + 1, device=st.device)
    kept = torch.cat([draft[:n], extra.view(1)]) if n else extra.view(1)
    kept_lp = torch.log_softmax(logits, dim=-1)[rows, kept]
    jp, jq, extra_i, kept_lps = to_host(lp_x.cumsum(0), lq_x.cumsum(0), extra, kept_lp)
    step = Step(
        index=0,
        method=s.method,
        draft_ids=draft_ids,
        log_p=jp,
        log_q=jq,
        accepted=n,
        from_target=[False] * n + [True],
        target_logprobs=kept_lps,
        draft_calls=calls,
        draft_top_q=[math.exp(t) for t in tops],
    )
    return st.finish(t0, step, kept_ids + [extra_i], n)


SPEC = MethodSpec(
    name="bild",
    label="BiLD",
    short="BiLD",
    colour="#7c3aed",
    params=(PARAMS["gamma"].own(default=10), PARAMS["tau1"], PARAMS["tau2"]),  # γ 10: Table 13 of the MTAD paper
    step=bild_step,
    panel="rollback",
    rule="BiLD keeps draft tokens until the first whose negative log-likelihood under the target exceeds τ2, "
    "then the target writes that position (not exact: kept tokens are the draft's)",
)
