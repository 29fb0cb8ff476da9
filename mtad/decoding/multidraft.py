"""Several draft sequences verified in one target forward: i.i.d. drafting, the batch-of-rows
forward, and the position-by-position walk that Spectr (K-SEQ) and SpecInfer (MSS) share.

Verification layout: one batch row per candidate, the target's cache fanned out to the rows with
``DynamicCache.batch_repeat_interleave`` (as the draft's beams are) and reduced to the kept row with
``batch_select_indices``. It needs nothing from the model but a standard ``DynamicCache``, so it
runs on every architecture the presets use (Llama, OPT, Qwen2); :mod:`mtad.decoding.tree` holds the
one-row tree-attention alternative and says which is used where, and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtad.decoding.autoregressive import ar_step
from mtad.decoding.state import CachedLM, DecodeState, to_host
from mtad.events import Step
from mtad.sampling import sample

Rule = Callable[[torch.Tensor, torch.Tensor, list[int], torch.Generator], tuple[int | None, torch.Tensor]]
"""A multi-candidate acceptance rule at one position: (p, q, candidate tokens, generator) ->
(index of the accepted candidate, or None and the distribution to sample the replacement from)."""


def fan_out(lm: CachedLM, rows: int) -> None:
    """Repeat the cache's single row ``rows`` times (nothing to do while it is still empty)."""
    if rows > 1 and lm.length:
        lm.cache.batch_repeat_interleave(rows)


def keep_row(lm: CachedLM, row: int) -> None:
    """Reduce a fanned-out cache to one of its rows."""
    keys = lm.cache.layers[0].keys if lm.length else None
    if keys is not None and keys.shape[0] > 1:
        lm.cache.batch_select_indices(torch.tensor([row], device=keys.device))


@dataclass
class Drafts:
    """m draft sequences [m, g] and the draft's distributions they were drawn from [m, g, V]."""

    tokens: torch.Tensor
    log_q: torch.Tensor


def iid_draft(st: DecodeState, g: int, m: int) -> Drafts:
    """m independent sequences of g tokens from warp(q) (argmax when greedy), one batched draft
    forward per position; the draft cache is left with m rows (see :func:`keep_row`)."""
    pending = st.pending(st.draft)
    fan_out(st.draft, m)
    tokens = pending.expand(m, -1)
    drafted, q_rows = [], []
    for _ in range(g):
        lq = st.judged(st.run_draft(tokens))  # [m, V]
        tok = lq.argmax(dim=-1) if st.settings.is_greedy else sample(lq.exp(), st.generator)
        drafted.append(tok)
        q_rows.append(lq)
        tokens = tok[:, None]
    return Drafts(tokens=torch.stack(drafted, dim=1), log_q=torch.stack(q_rows, dim=1))


def verify_rows(st: DecodeState, drafts: torch.Tensor) -> torch.Tensor:
    """One target forward over every candidate [m, g] as m batch rows; logits [m, g + 1, V].

    The target cache is left with m rows: reduce it with :func:`keep_row` before committing."""
    m, g = drafts.shape
    pending = st.pending(st.target)
    fan_out(st.target, m)
    tokens = torch.cat([pending.expand(m, -1), drafts], dim=1)
    t0 = st.clock.now()
    logits = st.target.feed(tokens, keep=g + 1)
    st.target_seconds += st.clock.now() - t0
    return logits


@dataclass
class Walk:
    """The outcome of a verification walk: which candidate was followed and how far."""

    chosen: int
    accepted: int
    extra: int


def walk(
    cands: list[list[int]],
    p_at: Callable[[int, int], torch.Tensor],
    q_at: Callable[[int, int], torch.Tensor],
    rule: Rule,
    generator: torch.Generator,
    greedy: bool,
) -> Walk:
    """Verify candidate sequences position by position, as Spectr and SpecInfer do.

    At depth i the live candidates are those that agree with the accepted prefix; their i-th tokens
    (one per candidate, duplicates included: they are the i.i.d. draws the rule's exactness rests on)
    go to ``rule`` with the target's p and the draft's q at that prefix (``p_at(w, i)``: probabilities
    after candidate w's first i tokens). An accepted token narrows the live set to the candidates
    carrying it; a rejection ends the walk with a draw from the rule's residual. Greedy: accept the
    candidate equal to argmax p, else the target's argmax.
    """
    live = list(range(len(cands)))
    depth = len(cands[0])
    for i in range(depth):
        p = p_at(live[0], i)
        tokens = [cands[w][i] for w in live]
        if greedy:
            best = int(p.argmax())
            if best not in tokens:
                return Walk(live[0], i, best)
            x = best
        else:
            k, residual = rule(p, q_at(live[0], i), tokens, generator)
            if k is None:
                return Walk(live[0], i, int(sample(residual, generator)))
            x = tokens[k]
        live = [w for w in live if cands[w][i] == x]
    p = p_at(live[0], depth)
    extra = int(p.argmax()) if greedy else int(sample(p, generator))
    return Walk(live[0], depth, extra)


def kept_lengths(cands: list[list[int]], kept: list[int]) -> list[int]:
    """Per candidate, how many of its leading tokens equal the kept accepted prefix."""
    out = []
    for c in cands:
        n = 0
        while n < len(kept) and c[n] == kept[n]:
            n += 1
        out.append(n)
    return out


def multi_step(st: DecodeState, rule: Rule) -> Step:
    """One iteration of a multi-draft method: m i.i.d. drafts, one batched target forward, the
    walk with ``rule``; appends the accepted prefix of the followed candidate plus one target token."""
    g = st.draft_length()
    if g <= 0:
        return ar_step(st)
    t0 = st.begin()
    drafts = iid_draft(st, g, st.settings.num_drafts)
    logits = verify_rows(st, drafts.tokens)
    log_p = st.judged(logits)
    p, q = log_p.double().exp(), drafts.log_q.double().exp()
    cands = drafts.tokens.tolist()
    out = walk(cands, lambda w, i: p[w, i], lambda w, i: q[w, i], rule, st.generator, st.settings.is_greedy)
    keep_row(st.target, out.chosen)
    keep_row(st.draft, out.chosen)

    n, draft = out.accepted, drafts.tokens[out.chosen]
    lp_x = log_p[out.chosen, :g].gather(1, draft[:, None])[:, 0]
    lq_x = drafts.log_q[out.chosen].gather(1, draft[:, None])[:, 0]
    kept = cands[out.chosen][:n] + [out.extra]
    rows = torch.arange(n + 1, device=st.device)
    kept_lp = torch.log_softmax(logits[out.chosen], dim=-1)[rows, torch.tensor(kept, device=st.device)]
    jp, jq, kept_lps = to_host(lp_x.cumsum(0), lq_x.cumsum(0), kept_lp)
    step = Step(
        index=0,
        method=st.settings.method,
        draft_ids=cands[out.chosen],
        log_p=jp,
        log_q=jq,
        accepted=n,
        from_target=[False] * n + [True],
        target_logprobs=kept_lps,
        candidates=cands,
        chosen=out.chosen,
        candidate_kept=kept_lengths(cands, kept[:n]),
        draft_calls=g,
    )
    return st.finish(t0, step, kept, n)
