"""Multi-token joint decoding (MTJD): the decoder MTAD approximates, run on the target alone.

Each iteration writes the next K tokens from the target's joint distribution p(x_{t+1:t+K} | x_{1:t}), approximated
as the paper does by a beam search of width W over the target itself (or beam sampling), keeping the best
beam. It costs K target forwards of W rows for K tokens: a reference, not a fast decoder. K = 1 is the
target's own sampling (or greedy) decoding, token for token and draw for draw (the exact K = 1 case: the
joint distribution of one token is the target's next-token distribution).
"""

from __future__ import annotations

from mtad.decoding.iteration import TARGET, read
from mtad.decoding.mtad import Beams, beam_search
from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState
from mtad.events import Step
from mtad.settings import PARAMS


def block_length(st: DecodeState) -> int:
    """K, or fewer where the budget ends sooner."""
    return min(st.settings.gamma, st.remaining)


def target_beams(st: DecodeState, k: int) -> Beams:
    """The beam search over the target for the next ``k`` tokens after ``st.ids``: W beams scored by joint
    log p under the run's distribution (a beam ends at its EOS), each token's unwarped log p kept for perplexity.
    The target's cache is left holding the context and the best beam's first k - 1 tokens."""
    return beam_search(st, st.target, k, stop_at_eos=True, raw=True)


def cut_at_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    """``tokens`` up to and including their first end-of-sequence token."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


def mtjd_step(st: DecodeState) -> Step:
    """One MTJD iteration: the best of W beams of K tokens over the target, all K appended (fewer at the
    budget or an EOS). A one-token block is the target's own draw (:data:`~mtad.decoding.iteration.TARGET`)."""
    k = block_length(st)
    if k <= 1:
        return TARGET(st)
    t0 = st.begin()
    beams = target_beams(st, k)
    joint, raw = beams.of_best(beams.token_logp).cumsum(0), beams.of_best(beams.token_raw)
    all_beams, scores, best, jp, raw_lps = read(beams.tokens, beams.scores, beams.best, joint, raw)
    all_beams = [cut_at_eos(beam, st.eos_ids) for beam in all_beams]
    block = all_beams[best]
    step = Step(
        index=0,
        method="mtjd",
        log_p=jp[: len(block)],
        from_target=[True] * len(block),
        target_logprobs=raw_lps[: len(block)],
        beams=all_beams,
        beam_scores=scores,
        best_beam=best,
    )
    # the target's cache holds the best beam's first k - 1 tokens: all kept, as AR keeps all but the newest
    return st.finish(t0, step, block, k - 1)


SPEC = MethodSpec(
    name="mtjd",
    label="MTJD (reference, slow)",
    short="MTJD",
    colour="#4d7c0f",
    params=(
        PARAMS["gamma"].own(name="K (MTJD block length, gamma)", symbol="K"),
        PARAMS["beams"].own(name="beams (MTJD's beam width W over the target)"),
        PARAMS["draft_mode"].own(symbol=""),
    ),
    step=mtjd_step,
    drafts=False,
    panel="target-beams",
    remark="γ is its block length K and W its beam width over the target; it drafts nothing.",
)
"""The reference MTAD approximates: K = gamma tokens a step by beam search (W = beams) over the target."""
