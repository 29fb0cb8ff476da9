"""Multi-token assisted decoding (MTAD), one iteration in its three parts: the drafter (beam search over the
draft model, W beams scored by their joint log q, which MTJD runs over the target too), the verification (one
target forward over the best beam) and the rule (the longest prefix whose joint min(1, p/q) passes τ, then one
token from the target: :func:`~mtad.decoding.rules.longest_passing`). :class:`~mtad.decoding.iteration.Iteration`
runs them and commits what they decide."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad.decoding.fused import fused
from mtad.decoding.iteration import Decision, Iteration
from mtad.decoding.protocols import LanguageModel
from mtad.decoding.rules import longest_passing
from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState, kept_logprobs
from mtad.events import Step
from mtad.sampling import RowDistributions, Warp, log_probs, top_log_probs
from mtad.settings import PARAMS

# ---------------------------------------------------------------- the drafter: beam search


@dataclass
class Beams:
    """The W final beams (device tensors) and which one is best."""

    tokens: torch.Tensor  # [W, g] token ids
    token_logp: torch.Tensor  # [W, g] per-token log-probability along each beam (the run's distribution)
    scores: torch.Tensor  # [W] joint log-probability of each beam
    best: torch.Tensor  # 0-d index of the highest-scoring beam
    token_raw: torch.Tensor | None = None  # [W, g] per-token unwarped T = 1 log-probability, when asked for

    def of_best(self, rows: torch.Tensor) -> torch.Tensor:
        """The best beam's row of a per-beam tensor [W, ...] (``index_select``: indexing with the 0-d
        :attr:`best` would read it on the host)."""
        return rows.index_select(0, self.best.view(1))[0]


def beam_search(st: DecodeState, lm: LanguageModel, g: int, stop_at_eos: bool = False, raw: bool = False) -> Beams:
    """Run g steps of beam search (or stochastic beam sampling) with ``st.settings.beams`` beams over ``lm``,
    the draft (MTAD) or the target (MTJD), whose unseen context is ``st.pending(lm)``.

    Deterministic: keep the top-W of (beam log p + log p(next)) over W x V, p the run's distribution (warped when
    sampling, the plain T = 1 softmax when greedy). Sampling (``draft_mode`` ``beam-sample``): draw W
    successors without replacement from softmax(beam log p + log warp(p)) via Gumbel-top-k, which is
    exactly sampling without replacement and needs no host sync. The cache is reordered with the beams
    (``KVCache.reorder`` also fans the single context row out to W rows) and, at the end, reduced to the best
    beam's row: it then holds the context and the best beam's first g - 1 tokens.

    ``stop_at_eos``: a beam that has written an end-of-sequence token is finished: it goes on only with
    that token again at log-probability 0, so its score is the joint log p up to its EOS (``lm`` must have
    no shortlist). ``raw``: also keep each token's unwarped T = 1 log-probability (MTJD's perplexity).
    """
    if g < 1:
        raise ValueError(f"a beam search takes at least one step; got {g}")
    width = st.settings.beams
    stochastic = st.settings.draft_mode == "beam-sample"
    dev = st.device
    tokens = st.pending(lm)
    beam_scores = torch.zeros(1, device=dev)
    steps: list[tuple[torch.Tensor, ...]] = []  # per step: each beam's parent, token, log p (and raw log p)
    parent = torch.zeros(1, dtype=torch.long, device=dev)
    done = torch.zeros(1, dtype=torch.bool, device=dev)
    stop_at_eos = stop_at_eos and bool(st.eos_ids)
    if stop_at_eos:
        if lm.columns is not None:
            raise ValueError("stop_at_eos needs a model without a shortlist head")
        eos = sorted(st.eos_ids)  # Python ints: no host-to-device copy, no host read
        pad = torch.full((1, lm.vocab), float("-inf"), device=dev)
        # a finished beam's only continuation: EOS again, at no cost (``fill_`` takes the number as a kernel
        # argument; ``pad[0, i] = 0.0`` would copy a host scalar in, a host sync on a GPU)
        pad.narrow(1, eos[0], 1).fill_(0.0)
    plain = not (stochastic or stop_at_eos or raw)
    for s in range(g):
        logits = st.run_next(lm, tokens)  # [B, C] over the model's columns
        k = min(width, logits.numel())
        if plain:
            beam_scores, parent, col, lp_x = beam_step(logits, beam_scores, st.warp, k, fuse=st.fused)
        else:
            lp = st.judged(logits)
            if stop_at_eos:
                lp = torch.where(done[:, None], pad, lp)
            key = lp
            if stochastic:
                u = torch.rand(lp.shape, generator=st.generator, device=dev)
                key = lp + -torch.log(-torch.log(u.clamp_min(1e-20)))
            beam_scores, parent, col, lp_x = _advance(beam_scores, lp, key, k)
        tok = st.tokens_of(lm, col)
        steps.append(
            (parent, tok, lp_x, torch.log_softmax(logits, dim=-1)[parent, col]) if raw else (parent, tok, lp_x)
        )
        if stop_at_eos:
            done = done[parent]
            for e in eos:
                done = done | (tok == e)
        if s < g - 1:
            lm.cache.reorder(parent)
            tokens = tok[:, None]
    best = beam_scores.argmax()
    lm.cache.select_rows(parent.index_select(0, best.view(1)))
    hist = _histories(steps)
    return Beams(tokens=hist[0], token_logp=hist[1], scores=beam_scores, best=best, token_raw=hist[2] if raw else None)


@fused
def beam_step(
    logits: torch.Tensor, beam_scores: torch.Tensor, warp: Warp, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One deterministic beam step after the forward: the ``k`` best of (beam score + log p(next)) over
    [B, C] ``logits`` under the run's distribution; their scores, parent rows, columns and log p's. Compiled into a
    few kernels on a GPU (:mod:`mtad.decoding.fused`)."""
    n = min(k, logits.shape[-1])
    top = top_log_probs(logits, warp, n)
    if top is None:  # greedy, or top-k off: the whole rows' distribution
        lp = log_probs(logits, warp)
        return _advance(beam_scores, lp, lp, k)
    row_key, row_col = top  # each row's first n under the run's distribution, without the whole rows' distribution
    joint, pick, parent, col = _choose(beam_scores, row_key, row_col, k)
    return joint, parent, col, row_key.take(pick)


def _advance(
    beam_scores: torch.Tensor, lp: torch.Tensor, key: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` best of (beam score + ``key``) over whole rows (``key``: ``lp``, the rows' distribution, or it
    perturbed): their scores under ``lp``, parent rows, columns and log p's."""
    _, _, parent, col = _choose(beam_scores, *key.topk(min(k, key.shape[-1]), dim=-1), k)
    lp_x = lp[parent, col]
    return beam_scores.index_select(0, parent) + lp_x, parent, col, lp_x


def _choose(
    beam_scores: torch.Tensor, row_key: torch.Tensor, row_col: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` best of (beam score + key) over every row's listed columns: their joint keys, flat
    positions, parent rows and columns. The top k over B x C lie among each row's own top k (a row shares
    its beam score): two small top-k's instead of one over B x C."""
    # take and index_select: a flat or row gather dispatches faster than advanced indexing
    joint, pick = torch.topk((beam_scores[:, None] + row_key).view(-1), k)
    return joint, pick, pick // row_key.shape[-1], row_col.take(pick)


def _histories(steps: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    """Each final beam's tokens and log p's [W, g] (and raw log p's), followed back through the steps'
    parents once at the end rather than gathered and extended at every step."""
    columns: list[list[torch.Tensor]] = [[] for _ in steps[0][1:]]
    rows = None  # the final beams: each step's own rows at the last step
    for i in range(len(steps) - 1, -1, -1):
        parent, *values = steps[i]
        for column, v in zip(columns, values, strict=True):
            column.append(v if rows is None else v.index_select(0, rows))
        if i:
            rows = parent if rows is None else parent.index_select(0, rows)
    return [torch.stack(column[::-1], dim=1) for column in columns]


def beam_draft(st: DecodeState, g: int) -> Beams:
    """MTAD's draft: :func:`beam_search` over the draft model, W beams scored by joint log q."""
    return beam_search(st, st.draft, g)


# ---------------------------------------------------------------- verification and rule


def verify_best(st: DecodeState, beams: Beams) -> torch.Tensor:
    """One target forward over the draft's best beam; logits [g + 1, V]."""
    return st.run_target(beams.of_best(beams.tokens))


def mtad_accept(st: DecodeState, beams: Beams, logits: torch.Tensor) -> Decision:
    """Keep the longest prefix eta of the best beam whose joint min(1, p/q) exceeds tau, then the
    target's token at eta + 1; the Step records every beam."""
    draft, lq_x = beams.of_best(beams.tokens), beams.of_best(beams.token_logp)
    joint_p, joint_q, eta, extra, kept_lp = mtad_rule(
        logits, draft, lq_x, st.warp, st.log_tau, st.uniforms(), fuse=st.fused
    )
    more = (beams.tokens, beams.scores, beams.best)
    return Decision(
        draft, joint_p, joint_q, eta, extra, kept_lp, draft_calls=draft.numel(), more=more, record=record_beams
    )


@fused
def mtad_rule(
    logits: torch.Tensor,
    draft: torch.Tensor,
    lq_x: torch.Tensor,
    warp: Warp,
    threshold: float | torch.Tensor | None,
    u: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """MTAD's rule on the target's [g + 1, V] ``logits`` over ``draft`` [g], whose log q's are ``lq_x``,
    with log τ ``threshold`` (:func:`~mtad.decoding.rules.longest_passing`): the joint log p's and log q's,
    eta, the target's token at eta + 1 (drawn at uniform ``u``, None when greedy) and the kept tokens'
    unwarped log p's. Compiled into a few kernels on a GPU (:mod:`mtad.decoding.fused`)."""
    p_rows = RowDistributions(logits, warp)
    joint_p, joint_q = p_rows.of(draft).cumsum(0), lq_x.cumsum(0)
    eta = longest_passing(joint_p, joint_q, threshold)
    extra = p_rows.sample(eta.view(1), warp, u)
    return joint_p, joint_q, eta, extra, kept_logprobs(logits, draft, eta, extra)


def record_beams(step: Step, values: list) -> None:
    """The draft's beams, their joint log q and the best one's index, for the page's beam table."""
    step.beams, step.beam_scores, step.best_beam = values[:3]


MTAD = Iteration(propose=beam_draft, verify=verify_best, accept=mtad_accept)
"""Beam-draft W beams, verify the best one jointly, keep its longest passing prefix plus a target token."""


SPEC = MethodSpec(
    name="mtad",
    label="MTAD",
    short="MTAD",
    colour="#ea580c",
    params=(PARAMS["beams"], PARAMS["gamma"], PARAMS["tau"], PARAMS["draft_mode"]),
    step=MTAD,
    panel="mtad",
    feature_draft=True,
)
