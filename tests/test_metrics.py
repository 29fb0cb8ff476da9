"""Every metric against values computed independently: hand-made steps with known answers, and real
sampled runs whose per-token log-probabilities are recomputed from one full target forward."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mtad.decoding import generate
from mtad.events import Step
from mtad.metrics import Metrics, excluded_by_position, perplexity, pool, summarize
from mtad.models.pair import ModelPair
from mtad.settings import Settings


def hand_made_steps() -> list[Step]:
    """An SD-like run: 3 drafted / 1 accepted / 2 appended, then 2 drafted / 0 accepted / 1 appended."""
    return [
        Step(
            index=0,
            method="sd",
            draft_ids=[5, 6, 7],
            accepted=1,
            appended_ids=[5, 8],
            from_target=[False, True],
            target_logprobs=[-1.0, -2.0],
            target_calls=1,
            draft_calls=3,
            draft_seconds=0.25,
            target_seconds=0.5,
            other_seconds=0.25,
        ),
        Step(
            index=1,
            method="sd",
            draft_ids=[1, 2],
            accepted=0,
            appended_ids=[4],
            from_target=[True],
            target_logprobs=[-3.0],
            target_calls=1,
            draft_calls=2,
            draft_seconds=0.125,
            target_seconds=0.5,
            other_seconds=0.375,
        ),
    ]


def test_perplexity_of_known_log_probs() -> None:
    assert perplexity([-1.0, -2.0, -3.0]) == pytest.approx(math.e**2)
    assert perplexity([-0.5]) == pytest.approx(math.exp(0.5))
    assert perplexity([0.0, 0.0]) == pytest.approx(1.0)
    assert perplexity([-3.0, -1.0]) == pytest.approx(math.e**2)  # order does not matter, the last one counts
    assert math.isnan(perplexity([]))


def test_summary_of_hand_made_steps() -> None:
    m = summarize(hand_made_steps(), joules=6.0)
    assert (m.new_tokens, m.iterations, m.target_calls, m.draft_calls) == (3, 2, 2, 5)
    assert (m.drafted, m.accepted) == (5, 1)
    assert m.block_efficiency == pytest.approx(1.5)  # 3 new tokens / 2 target calls
    assert m.acceptance == pytest.approx(0.2)  # 1 accepted / 5 drafted
    assert m.perplexity == pytest.approx(math.e**2)  # log-probs -1, -2, -3
    assert m.seconds == pytest.approx(2.0)
    assert (m.draft_seconds, m.target_seconds, m.other_seconds) == pytest.approx((0.375, 1.0, 0.625))
    assert m.tokens_per_second == pytest.approx(1.5)
    assert m.overhead_fraction == pytest.approx(0.3125)  # 0.625 s of bookkeeping in 2 s
    assert m.joules == 6.0 and m.joules_per_token == pytest.approx(2.0)


def test_a_target_call_is_timed_after_the_first_step_which_also_reads_the_prompt() -> None:
    steps = hand_made_steps()
    steps[1].target_seconds, steps[1].target_calls = 0.3, 2  # 0.15 s a call; the first step's 0.5 s is left out
    m = summarize(steps)
    assert (m.later_target_seconds, m.later_target_calls) == (pytest.approx(0.3), 2)
    assert m.target_call_seconds == pytest.approx(0.15) and m.target_seconds == pytest.approx(0.8)
    assert summarize(steps[:1]).target_call_seconds is None  # one step: no call after the prompt's
    assert pool([m, m]).target_call_seconds == pytest.approx(0.15)


def test_summary_without_drafts_or_meter() -> None:
    ar = [Step(index=i, method="ar", appended_ids=[i], target_logprobs=[-1.0], target_calls=1) for i in range(4)]
    m = summarize(ar)
    assert m.acceptance is None and m.drafted == 0
    assert m.block_efficiency == pytest.approx(1.0)
    assert m.perplexity == pytest.approx(math.e)
    assert m.joules is None and m.joules_per_token is None


def test_summary_of_a_sub_second_run_and_an_empty_one() -> None:
    fast = [Step(index=0, method="ar", appended_ids=[1], target_logprobs=[-1.0], target_calls=1, other_seconds=0.25)]
    m = summarize(fast, joules=0.5, energy_note="NVML counter")
    assert m.tokens_per_second == pytest.approx(4.0) and m.overhead_fraction == pytest.approx(1.0)
    assert m.energy_note == "NVML counter"
    empty = summarize([])
    assert (empty.new_tokens, empty.block_efficiency, empty.tokens_per_second, empty.overhead_fraction) == (0, 0, 0, 0)
    assert math.isnan(empty.perplexity) and empty.joules_per_token is None


def test_metrics_dict_is_strict_json() -> None:
    d = summarize([]).to_dict()
    assert d["perplexity"] is None  # nan is not JSON
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    assert summarize(hand_made_steps()).to_dict()["perplexity"] == pytest.approx(math.e**2)


def unwarped_full_forward(pair: ModelPair, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
    """log softmax at T = 1 of one full target forward over prompt + output, at each new token."""
    ids = prompt_ids + new_ids
    with torch.inference_mode():
        logits = pair.target(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : len(ids) - 1], dim=-1)
    return logp.gather(1, torch.tensor(new_ids)[:, None])[:, 0]


@pytest.mark.parametrize(
    "settings",
    [
        Settings(method="ar"),
        Settings(method="sd", gamma=3),
        Settings(method="mtad", gamma=3, beams=3, tau=0.2),
        Settings(method="mtad", gamma=3, beams=3, tau=0.2, draft_mode="beam-sample"),
        Settings(method="mtad-tree", gamma=3, beams=3, tau=0.2),
        Settings(method="bild", gamma=3, tau1=0.2, tau2=2.0),
        Settings(method="spectr", gamma=3, num_drafts=2),
        Settings(method="specinfer", gamma=3, num_drafts=2),
        Settings(method="hf-assisted", gamma=3),
    ],
    ids=["ar", "sd", "mtad-beam", "mtad-beam-sample", "mtad-tree", "bild", "spectr", "specinfer", "hf-assisted"],
)
def test_target_logprobs_are_the_unwarped_full_forward(close_pair: ModelPair, settings: Settings) -> None:
    """Sampling at T != 1 with top-k: perplexity still reads the plain target, one entry per new token."""
    s = settings.with_(temperature=1.6, top_k=5, top_p=0.95, max_new_tokens=40, seed=4)
    run = generate(close_pair, "abc def", s)
    got = [lp for step in run.steps for lp in step.target_logprobs]
    assert len(got) == len(run.new_ids) == sum(len(step.appended_ids) for step in run.steps)
    want = unwarped_full_forward(close_pair, run.prompt_ids, run.new_ids)
    torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-4)
    assert summarize(run.steps).perplexity == pytest.approx(math.exp(-float(want.mean())), rel=1e-4)
    if s.method != "ar":
        # accepted drafts' log-probs were checked too, not only the target's own tokens
        assert sum(step.accepted for step in run.steps) >= 5


def test_repetition_counts_ngrams_that_occurred_earlier():
    from mtad.metrics import repeated_ngrams, repetition

    # 1 2 3 4 1 2 3 4 1: 4-grams 1234 2341 3412 4123 1234(rep) 2341(rep) -> 6 grams, 2 repeated
    assert repeated_ngrams([1, 2, 3, 4, 1, 2, 3, 4, 1]) == (6, 2)
    assert repetition([1, 2, 3, 4, 5, 6, 7, 8]) == 0.0
    assert repetition([7, 7, 7, 7, 7, 7]) == 2 / 3  # 3 grams, the 2nd and 3rd repeat the 1st
    assert repetition([1, 2, 3]) is None  # shorter than one 4-gram
    assert repeated_ngrams([1, 2, 1, 2, 1], n=2) == (4, 2)


def test_summary_and_pool_carry_repetition_and_flag_loops():
    from mtad.metrics import LOOP_REPETITION, pool, summarize

    loop = summarize([Step(0, "mtad", appended_ids=[5, 6, 7, 8] * 5, target_logprobs=[-0.1] * 20, target_calls=1)])
    fresh = summarize([Step(0, "ar", appended_ids=list(range(20)), target_logprobs=[-2.0] * 20, target_calls=1)])
    assert (loop.ngrams, loop.repeated_ngrams) == (17, 13)
    assert loop.repetition == 13 / 17 and loop.loops and loop.repetition >= LOOP_REPETITION
    assert fresh.repetition == 0.0 and not fresh.loops
    assert pool([loop, fresh]).repetition == 13 / 34  # repeats over all grams, not a mean of ratios
    assert Metrics.from_dict(loop.to_dict()) == loop


def test_a_record_without_repetition_fields_still_loads():
    from mtad.metrics import summarize

    d = summarize([Step(0, "ar", appended_ids=[1, 2], target_logprobs=[-1.0, -1.0], target_calls=1)]).to_dict()
    for k in ("ngrams", "repeated_ngrams", "repetition"):
        d.pop(k)
    assert Metrics.from_dict(d).repetition is None


def test_excluded_by_position_counts_tokens_the_warped_target_gives_zero_after_allowed_ones():
    inf = math.inf
    steps = [
        Step(0, "mtad", draft_ids=[1, 2, 3], log_p=[-0.1, -0.5, -1.0]),  # every token allowed
        Step(1, "sd", draft_ids=[1, 2, 3], log_p=[-inf, -inf, -inf]),  # the first token already excluded
        Step(2, "mtad", draft_ids=[1, 2], log_p=[-0.2, -inf]),  # the second excluded
        Step(3, "ar"),  # drafted nothing
    ]
    reached, excluded = excluded_by_position(steps)
    assert reached == [3, 2, 1] and excluded == [1, 1, 0]  # after an excluded token nothing is reached
    assert excluded_by_position([]) == ([], [])


def test_acceptance_by_position_counts_each_draft_position_reached():
    from mtad.metrics import acceptance_by_position, position_counts

    steps = [
        Step(0, "sd", draft_ids=[1, 2, 3, 4], accepted=4),  # all 4 kept
        Step(1, "sd", draft_ids=[1, 2, 3, 4], accepted=1),  # 1 kept, the 2nd rejected (3, 4 never judged)
        Step(2, "sd", draft_ids=[1, 2], accepted=0),  # a short draft at the budget, the 1st rejected
        Step(3, "ar"),  # nothing drafted
    ]
    reached, kept = position_counts(steps)
    assert reached == [3, 2, 1, 1] and kept == [2, 1, 1, 1]
    assert acceptance_by_position(reached, kept) == [2 / 3, 0.5, 1.0, 1.0]
    assert position_counts([]) == ([], []) and acceptance_by_position([0], [0]) == [None]


def timed_step(index: int, tokens: int, target: float, draft: float = 0.0, other: float = 0.0) -> Step:
    ids = list(range(tokens))
    return Step(
        index=index,
        method="x",
        appended_ids=ids,
        from_target=[True] * tokens,
        target_logprobs=[-1.0] * tokens,
        target_calls=1,
        target_seconds=target,
        draft_seconds=draft,
        other_seconds=other,
    )


def test_speed_equation_terms_on_hand_made_steps() -> None:
    """AR: 4 tokens in 0.4 s (0.1 s a token). The lane: 6 tokens over 2 target calls, whose forwards took 0.4 s
    (the first, which also reads the prompt) and 0.2 s, drafting 0.4 s and the rest 0.2 s: per call, 3 tokens
    for 3 + 2 + 1 of AR's token steps, 0.5× AR; the lane ran 6 tokens in 1.2 s against AR's 10 tokens a second."""
    from mtad.metrics import speed_equation, speedup

    ar = summarize([timed_step(i, 1, target=0.09, other=0.01) for i in range(4)])
    lane = summarize([timed_step(0, 3, 0.4, 0.2, 0.1), timed_step(1, 3, 0.2, 0.2, 0.1)])
    eq = speed_equation(lane, ar)
    assert (eq.tokens_per_call, eq.verification, eq.drafting, eq.rest) == pytest.approx((3, 3, 2, 1))
    assert eq.product == pytest.approx(0.5) and eq.measured == pytest.approx(speedup(lane, ar)) == pytest.approx(0.5)
    # the verification term counts every call, the first's prompt read included: from the later calls alone
    # (what the card's "per target call" shows) it would be 2, and the product 3 / 5 would not be the measured 0.5
    assert eq.verification != pytest.approx(lane.target_call_seconds / 0.1)
    assert eq.text() == "3 tokens a call ÷ (3 + 2 + 1) = 0.50×, measured 0.50×"
    own = speed_equation(ar, ar)  # AR against itself: one token a call, its forward and its rest make one
    assert own.tokens_per_call == 1 and own.cost == pytest.approx(1) and own.product == pytest.approx(1)
    assert own.text().startswith("1 token a call ÷ (")  # one token, not "1 tokens"
    assert speed_equation(summarize([]), ar) is None and speed_equation(lane, summarize([])) is None


@pytest.mark.parametrize("method", ["sd", "mtad", "mtjd"])
def test_speed_equation_is_the_measured_speedup_on_recorded_runs(close_pair: ModelPair, method: str) -> None:
    """An identity over the same Steps: the product equals the measured × AR (a gap of 5 % would be a bug), for
    one run and pooled over runs."""
    from mtad.metrics import speed_equation, speedup

    def runs(m: str) -> list[Metrics]:
        out = []
        for seed in (0, 1):
            s = Settings(method=m, max_new_tokens=12, seed=seed, gamma=3, beams=2)
            out.append(summarize(generate(close_pair, "abc def", s).steps))
        return out

    ar, lane = runs("ar"), runs(method)
    for run, base in zip(lane, ar, strict=True):
        eq = speed_equation(run, base)
        assert eq.product == pytest.approx(speedup(run, base), rel=0.05)
        assert eq.tokens_per_call == pytest.approx(run.block_efficiency)
    pooled = speed_equation(pool(lane), pool(ar))
    assert pooled.product == pytest.approx(pool(lane).tokens_per_second / pool(ar).tokens_per_second, rel=0.05)


def test_ar_against_the_weight_read_bound() -> None:
    from mtad.metrics import versus_weight_read_bound, weight_read_text

    ar = summarize([timed_step(i, 1, target=0.009, other=0.001) for i in range(5)])  # 10 ms a token
    assert versus_weight_read_bound(ar, 0.002) == pytest.approx(5.0)
    assert versus_weight_read_bound(ar, None) is None and versus_weight_read_bound(summarize([]), 0.002) is None
    assert weight_read_text(5.0, 20_000_000, 10e9) == (
        "AR at 5.0× the weight-read bound (20 MB of target weights ÷ 10.0 GB/s read = 2.00 ms a token)"
    )
    assert "(0.329 MB of target weights" in weight_read_text(67.0, 329_000, 11e9)  # a tiny model is not "0 MB"
