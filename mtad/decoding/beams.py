"""Beam search over one model's cache: MTAD drafts with it over the draft model, MTJD decodes with it over
the target. W beams scored by their joint log-probability under the run's law, cache kept per beam."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad.decoding.state import CachedLM, DecodeState
from mtad.sampling import top_log_probs


@dataclass
class Beams:
    """The W final beams (device tensors) and which one is best."""

    tokens: torch.Tensor  # [W, g] token ids
    token_logp: torch.Tensor  # [W, g] per-token log-probability along each beam (the run's law)
    scores: torch.Tensor  # [W] joint log-probability of each beam
    best: torch.Tensor  # 0-d index of the highest-scoring beam
    token_raw: torch.Tensor | None = None  # [W, g] per-token unwarped T = 1 log-probability, when asked for

    @property
    def token_logq(self) -> torch.Tensor:
        """MTAD's name for :attr:`token_logp` when the searched model is the draft."""
        return self.token_logp

    def of_best(self, rows: torch.Tensor) -> torch.Tensor:
        """The best beam's row of a per-beam tensor [W, ...] (``index_select``: indexing with the 0-d
        :attr:`best` would read it on the host)."""
        return rows.index_select(0, self.best.view(1))[0]


BeamDraft = Beams
"""MTAD's beams over the draft model (the name its decoders and tests use)."""


def beam_search(st: DecodeState, lm: CachedLM, g: int, stop_at_eos: bool = False, raw: bool = False) -> Beams:
    """Run g steps of beam search (or stochastic beam sampling) with ``st.settings.beams`` beams over ``lm``,
    the draft (MTAD) or the target (MTJD), whose unseen context is ``st.pending(lm)``.

    Deterministic: keep the top-W of (beam log p + log p(next)) over W x V, p the run's law (warped when
    sampling, the plain T = 1 softmax when greedy). Sampling (``draft_mode`` ``beam-sample``): draw W
    successors without replacement from softmax(beam log p + log warp(p)) via Gumbel-top-k, which is
    exactly sampling without replacement and needs no host sync. The cache is reordered with the beams
    (``KVCache.reorder`` also fans the single context row out to W rows) and, at the end, reduced to the best
    beam's row: it then holds the context and the best beam's first g - 1 tokens.

    ``stop_at_eos``: a beam that has written an end-of-sequence token is finished: it goes on only with
    that token again at log-probability 0, so its score is the joint log p up to its EOS (``lm`` must have
    no shortlist). ``raw``: also keep each token's unwarped T = 1 log-probability (MTJD's perplexity).
    """
    width = st.settings.beams
    stochastic = st.settings.draft_mode == "beam-sample"
    dev = st.device
    tokens = st.pending(lm)
    beam_scores = torch.zeros(1, device=dev)
    hist = torch.empty(1, 0, dtype=torch.long, device=dev)
    hist_lp = torch.empty(1, 0, device=dev)
    hist_raw = torch.empty(1, 0, device=dev)
    parent = torch.zeros(1, dtype=torch.long, device=dev)
    done = torch.zeros(1, dtype=torch.bool, device=dev)
    stop_at_eos = stop_at_eos and bool(st.eos_ids)
    if stop_at_eos:
        if lm.columns is not None:
            raise ValueError("stop_at_eos needs a model without a shortlist head")
        eos = sorted(st.eos_ids)  # Python ints: no host-to-device copy, no host read
        pad = torch.full((1, lm.vocab), float("-inf"), device=dev)
        pad[0, eos[0]] = 0.0  # a finished beam's only continuation: EOS again, at no cost
    for s in range(g):
        logits = st.run_next(lm, tokens)  # [B, C] over the model's columns
        k = min(width, logits.numel())
        # the top k of (beam score + key) over B x C lie among each row's own top k (a row shares
        # its beam score): two small top-k's instead of one over B x C, a sort-free 3x less work
        top = None if stochastic or stop_at_eos or raw else top_log_probs(logits, st.settings, min(k, logits.shape[-1]))
        if top is not None:  # each row's first k under the run's law, without the whole rows' law
            row_key, row_col = top
        else:
            lp = st.judged(logits)
            if stop_at_eos:
                lp = torch.where(done[:, None], pad, lp)
            key = lp
            if stochastic:
                u = torch.rand(lp.shape, generator=st.generator, device=dev)
                key = lp + -torch.log(-torch.log(u.clamp_min(1e-20)))
            row_key, row_col = key.topk(min(k, key.shape[-1]), dim=-1)
        # take and index_select: a flat or row gather dispatches faster than advanced indexing
        joint, pick = torch.topk((beam_scores[:, None] + row_key).view(-1), k)
        parent = pick // row_key.shape[-1]
        col = row_col.take(pick)
        lp_x = row_key.take(pick) if top is not None else lp[parent, col]
        tok = st.tokens_of(lm, col)
        beam_scores = joint if top is not None else beam_scores.index_select(0, parent) + lp_x
        hist = torch.cat([hist.index_select(0, parent), tok[:, None]], dim=1)
        hist_lp = torch.cat([hist_lp.index_select(0, parent), lp_x[:, None]], dim=1)
        if raw:
            raw_x = torch.log_softmax(logits, dim=-1)[parent, col]
            hist_raw = torch.cat([hist_raw[parent], raw_x[:, None]], dim=1)
        if stop_at_eos:
            done = done[parent]
            for e in eos:
                done = done | (tok == e)
        if s < g - 1:
            lm.cache.reorder(parent)
            tokens = tok[:, None]
    best = beam_scores.argmax()
    lm.cache.select_rows(parent.index_select(0, best.view(1)))
    return Beams(tokens=hist, token_logp=hist_lp, scores=beam_scores, best=best, token_raw=hist_raw if raw else None)


def beam_draft(st: DecodeState, g: int) -> Beams:
    """MTAD's draft: :func:`beam_search` over the draft model, W beams scored by joint log q."""
    return beam_search(st, st.draft, g)
