"""Beam drafting over the draft model: W beams scored by joint log q, cache kept per beam."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad.decoding.state import DecodeState


@dataclass
class BeamDraft:
    """The W final beams (device tensors) and which one is best."""

    tokens: torch.Tensor  # [W, g] token ids
    token_logq: torch.Tensor  # [W, g] per-token log q along each beam
    scores: torch.Tensor  # [W] joint log q of each beam
    best: torch.Tensor  # 0-d index of the highest-scoring beam


def beam_draft(st: DecodeState, g: int) -> BeamDraft:
    """Run g steps of beam search (or stochastic beam sampling) with ``st.settings.beams`` beams.

    Deterministic: keep the top-W of (beam log q + log q(next)) over W x V. Sampling: draw W
    successors without replacement from softmax(beam log q + log warp(q)) via Gumbel-top-k,
    which is exactly sampling without replacement and needs no host sync. The draft cache is
    reordered with the beams (``reorder_cache`` also fans the single context row out to W rows)
    and, at the end, reduced to the best beam's row.
    """
    width = st.settings.beams
    stochastic = st.settings.draft_mode == "beam-sample"
    draft = st.draft
    tokens = st.pending(draft)
    beam_scores = torch.zeros(1, device=st.device)
    hist = torch.empty(1, 0, dtype=torch.long, device=st.device)
    hist_lq = torch.empty(1, 0, device=st.device)
    parent = torch.zeros(1, dtype=torch.long, device=st.device)
    for s in range(g):
        lq = st.draft_logq(tokens)  # [B, C] over the draft's columns
        k = min(width, lq.numel())
        key = lq
        if stochastic:
            u = torch.rand(lq.shape, generator=st.generator, device=st.device)
            key = lq + -torch.log(-torch.log(u.clamp_min(1e-20)))
        # the top k of (beam score + key) over B x C lie among each row's own top k (a row shares
        # its beam score): two small top-k's instead of one over B x C, a sort-free 3x less work
        row_key, row_col = key.topk(min(k, key.shape[-1]), dim=-1)
        pick = torch.topk((beam_scores[:, None] + row_key).view(-1), k).indices
        parent = pick // row_key.shape[-1]
        col = row_col.view(-1)[pick]
        lq_x = lq[parent, col]
        tok = st.draft_tokens(col)
        beam_scores = beam_scores[parent] + lq_x
        hist = torch.cat([hist[parent], tok[:, None]], dim=1)
        hist_lq = torch.cat([hist_lq[parent], lq_x[:, None]], dim=1)
        if s < g - 1:
            draft.cache.reorder(parent)
            tokens = tok[:, None]
    best = beam_scores.argmax()
    draft.cache.select_rows(parent.index_select(0, best.view(1)))
    return BeamDraft(tokens=hist, token_logq=hist_lq, scores=beam_scores, best=best)
