"""MTAD verifying all W beams (the paper's future work): the longest passing prefix over every beam."""

from __future__ import annotations

import math

import torch

from mtad.decoding.iteration import Decision, Iteration
from mtad.decoding.mtad import Beams, beam_draft, record_beams
from mtad.decoding.multidraft import Verified, kept_lengths, layout, tree_verified, verified
from mtad.decoding.rules import mtad_accept_length_t
from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState, kept_logprobs, to_host
from mtad.events import Step
from mtad.sampling import sample_logp
from mtad.settings import PARAMS


def verify_beams(st: DecodeState, beams: Beams) -> Verified:
    """Score every beam in one target forward: a token tree where the attention kernel allows, else W batch
    rows (:func:`mtad.decoding.multidraft.layout`).

    A beam of joint q = 0 is padding (warping left fewer than W candidates): it takes no part. The tree
    layout reads the beams' ids to merge their prefixes (this method's second host read); their scores
    come in the same read, and the padding stays out of the target's forward."""
    width, g = beams.tokens.shape
    if layout(st, width) == "tree":
        ids, scores = to_host(beams.tokens, beams.scores)
        ids = [ids[i * g : (i + 1) * g] for i in range(width)]
        return tree_verified(st, beams.tokens, ids, [math.isfinite(s) for s in scores])
    return verified(st, beams.tokens, "rows")


def mtad_tree_accept(st: DecodeState, beams: Beams, checked: Verified) -> Decision:
    """MTAD's rule on every beam: keep the beam with the longest passing prefix (ties: the draft's best
    beam, then the lowest index; padding never), then the target's token after it."""
    width, g = beams.tokens.shape
    live = torch.isfinite(beams.scores)  # every layout zeroes a padded beam's accepted length
    logits = torch.stack([torch.stack([checked.at(w, i) for i in range(g + 1)]) for w in range(width)])
    log_p = st.judged(logits)
    lp_x = log_p[:, :g].gather(2, beams.tokens[:, :, None])[:, :, 0]
    joint_p, joint_q = lp_x.cumsum(1), beams.token_logp.cumsum(1)
    etas = torch.stack([mtad_accept_length_t(jp, jq, st.settings.tau) for jp, jq in zip(joint_p, joint_q, strict=True)])
    etas = etas * live
    rank = etas * (2 * width) + (torch.arange(width, device=st.device) == beams.best) * width
    chosen = (rank - torch.arange(width, device=st.device)).argmax()
    row = chosen.view(1)  # index_select, not [0-d tensor] indexing, which reads the index on the host
    eta = etas.index_select(0, row)[0]
    log_p_row = log_p.index_select(0, row)[0]
    extra = sample_logp(log_p_row.index_select(0, eta.view(1))[0], st.settings, generator=st.generator)
    draft = beams.tokens.index_select(0, row)[0]
    kept_lp = kept_logprobs(logits.index_select(0, row)[0], draft, eta, extra)
    jp_row, jq_row = joint_p.index_select(0, row)[0], joint_q.index_select(0, row)[0]

    def record(step: Step, values: list) -> None:
        """Every beam as a candidate, the chosen one; both caches reduced to what the chosen beam keeps."""
        record_beams(step, values)
        all_beams, chosen_i = step.beams, values[3]
        checked.keep(chosen_i, step.accepted)
        if chosen_i != step.best_beam:  # the draft cache holds the best beam: keep what it shares with the chosen
            shared = kept_lengths([all_beams[step.best_beam]], all_beams[chosen_i])[0]
            st.draft.rollback(len(st.ids) + shared)
        step.candidates, step.chosen = all_beams, chosen_i
        step.candidate_kept = kept_lengths(all_beams, step.draft_ids[: step.accepted])

    more = (beams.tokens, beams.scores, beams.best, chosen)
    return Decision(draft, jp_row, jq_row, eta, extra, kept_lp, draft_calls=g, more=more, record=record)


MTAD_TREE = Iteration(propose=beam_draft, verify=verify_beams, accept=mtad_tree_accept)
"""Beam-draft W beams (the draft cache left on the best one's row), verify all of them, keep the beam with the
longest passing prefix plus one target token. With W = 1 this is MTAD exactly: the same draws, the same
forward, the same rule."""


SPEC = MethodSpec(
    name="mtad-tree",
    label="MTAD, all beams verified",
    short="MTAD tree",
    colour="#b45309",
    params=(PARAMS["beams"], PARAMS["gamma"], PARAMS["tau"], PARAMS["draft_mode"]),
    step=MTAD_TREE,
    panel="mtad",
    verify_tokens=lambda s: 1 + s.beams * s.gamma,  # the pending token, then a token tree of every candidate
)
