"""MTAD verifying all W beams (the paper's future work): the longest passing prefix over every beam."""

from __future__ import annotations

import math

import torch

from mtad.decoding.autoregressive import ar_step
from mtad.decoding.beams import beam_draft
from mtad.decoding.multidraft import kept_lengths, layout, tree_verified, verified
from mtad.decoding.rules import mtad_accept_length_t
from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState, kept_logprobs, to_host
from mtad.events import Step
from mtad.sampling import pick
from mtad.settings import PARAMS


def mtad_tree_step(st: DecodeState) -> Step:
    """Beam-draft W beams, score all of them in one target forward (a token tree where the attention
    kernel allows, else W batch rows: :func:`mtad.decoding.multidraft.layout`), keep the beam with the longest
    passing prefix (ties: the draft's best beam, then the lowest index) plus one target token.

    With W = 1 this is MTAD exactly: the same draws, the same forward, the same rule."""
    g = st.draft_length()
    if g <= 0:
        return ar_step(st)
    t0 = st.begin()
    beams = beam_draft(st, g)  # leaves the draft cache on the best beam's row
    width = beams.tokens.shape[0]
    # A beam of joint q = 0 is padding (warping left fewer than W candidates): it takes no part. The tree
    # layout reads the beams' ids to merge their prefixes; their scores come in the same read, and the
    # padding stays out of the target's forward. Every layout zeroes its accepted length.
    live = torch.isfinite(beams.scores)
    if layout(st, width) == "tree":
        ids, scores = to_host(beams.tokens, beams.scores)
        ids = [ids[i * g : (i + 1) * g] for i in range(width)]
        checked = tree_verified(st, beams.tokens, ids, [math.isfinite(s) for s in scores])
    else:
        checked = verified(st, beams.tokens, "rows")
    logits = torch.stack([torch.stack([checked.at(w, i) for i in range(g + 1)]) for w in range(width)])
    log_p = st.judged(logits)
    lp_x = log_p[:, :g].gather(2, beams.tokens[:, :, None])[:, :, 0]
    joint_p, joint_q = lp_x.cumsum(1), beams.token_logq.cumsum(1)
    etas = torch.stack([mtad_accept_length_t(jp, jq, st.settings.tau) for jp, jq in zip(joint_p, joint_q, strict=True)])
    etas = etas * live
    rank = etas * (2 * width) + (torch.arange(width, device=st.device) == beams.best) * width
    chosen = (rank - torch.arange(width, device=st.device)).argmax()
    row = chosen.view(1)  # index_select, not [0-d tensor] indexing, which reads the index on the host
    eta = etas.index_select(0, row)[0]
    log_p_row = log_p.index_select(0, row)[0]
    extra = pick(log_p_row.index_select(0, eta.view(1))[0], st.settings, st.generator)
    kept_lp = kept_logprobs(logits.index_select(0, row)[0], beams.tokens.index_select(0, row)[0], eta, extra)
    jp_row, jq_row = joint_p.index_select(0, row)[0], joint_q.index_select(0, row)[0]
    host = to_host(beams.tokens, beams.scores, beams.best, jp_row, jq_row, chosen, eta, extra, kept_lp)
    all_beams, scores, best, jp, jq, chosen_i, eta_i, extra_i, kept_lps = host
    all_beams = [all_beams[i * g : (i + 1) * g] for i in range(width)]
    checked.keep(chosen_i, eta_i)
    if chosen_i != best:  # the draft cache holds the best beam: keep only what it shares with the chosen one
        shared = kept_lengths([all_beams[best]], all_beams[chosen_i])[0]
        st.draft.rollback(len(st.ids) + shared)
    draft_ids = all_beams[chosen_i]
    step = Step(
        index=0,
        method=st.settings.method,
        draft_ids=draft_ids,
        log_p=jp,
        log_q=jq,
        accepted=eta_i,
        from_target=[False] * eta_i + [True],
        target_logprobs=kept_lps[: eta_i + 1],
        beams=all_beams,
        beam_scores=scores,
        best_beam=best,
        candidates=all_beams,
        chosen=chosen_i,
        candidate_kept=kept_lengths(all_beams, draft_ids[:eta_i]),
        draft_calls=g,
    )
    return st.finish(t0, step, draft_ids[:eta_i] + [extra_i], eta_i)


SPEC = MethodSpec(
    name="mtad-tree",
    label="MTAD, all beams verified",
    short="MTAD tree",
    colour="#b45309",
    params=(PARAMS["beams"], PARAMS["gamma"], PARAMS["tau"], PARAMS["draft_mode"]),
    step=mtad_tree_step,
    panel="mtad",
)
