"""Multi-token assisted decoding (MTAD): beam draft, joint verification, longest passing prefix."""

from __future__ import annotations

from mtad.decoding.autoregressive import ar_step
from mtad.decoding.beams import beam_draft
from mtad.decoding.rules import mtad_accept_length_t
from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState, kept_logprobs, to_host
from mtad.events import Step
from mtad.sampling import pick
from mtad.settings import PARAMS


def mtad_step(st: DecodeState) -> Step:
    """One MTAD iteration: eta accepted drafts plus one token from the target at eta+1."""
    g = st.draft_length()
    if g <= 0:
        return ar_step(st)
    t0 = st.begin()
    beams = beam_draft(st, g)
    best = beams.best.view(1)  # index_select, not [0-d tensor] indexing, which reads the index on the host
    draft = beams.tokens.index_select(0, best)[0]
    lq_x = beams.token_logq.index_select(0, best)[0]

    logits = st.run_target(draft)
    log_p = st.judged(logits)
    lp_x = log_p[:g].gather(1, draft[:, None])[:, 0]
    joint_p, joint_q = lp_x.cumsum(0), lq_x.cumsum(0)
    eta = mtad_accept_length_t(joint_p, joint_q, st.settings.tau)
    extra = pick(log_p.index_select(0, eta.view(1))[0], st.settings, st.generator)

    kept_lp = kept_logprobs(logits, draft, eta, extra)
    host = to_host(beams.tokens, beams.scores, beams.best, joint_p, joint_q, eta, extra, kept_lp)
    all_beams, scores, best, jp, jq, eta_i, extra_i, kept_lps = host
    width = len(scores)
    all_beams = [all_beams[i * g : (i + 1) * g] for i in range(width)]
    draft_ids = all_beams[best]

    step = Step(
        index=0,
        method="mtad",
        draft_ids=draft_ids,
        log_p=jp,
        log_q=jq,
        accepted=eta_i,
        from_target=[False] * eta_i + [True],
        target_logprobs=kept_lps[: eta_i + 1],
        beams=all_beams,
        beam_scores=scores,
        best_beam=best,
        draft_calls=g,
    )
    return st.finish(t0, step, draft_ids[:eta_i] + [extra_i], eta_i)


SPEC = MethodSpec(
    name="mtad",
    label="MTAD",
    short="MTAD",
    colour="#ea580c",
    params=(PARAMS["beams"], PARAMS["gamma"], PARAMS["tau"], PARAMS["draft_mode"]),
    step=mtad_step,
    panel="mtad",
)
