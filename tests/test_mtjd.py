"""MTJD, the decoder MTAD approximates: K tokens a step by beam search over the target.

K = 1 is AR (greedy, and sampling draw for draw); with a beam as wide as the search space, greedy MTJD's
block is the argmax of the joint found by exhaustive search; the beams' joint log p, the block's log p and
the target's cache equal a cache-free recompute; target_calls counts every target forward of every decoder.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import cached_next_logits, full_logits

from mtad.decoding import DECODERS, decode, generate
from mtad.decoding.iteration import run_steps
from mtad.decoding.mtjd import mtjd_step
from mtad.decoding.state import DecodeState
from mtad.events import Step
from mtad.models.pair import ModelPair, load_pair
from mtad.mtjd_agreement import Agreement, agreement, common_prefix, mtjd_choices, run_agreement
from mtad.sampling import log_probs
from mtad.settings import Settings

PROMPT = "abc def gh"


def contexts(prompt_ids: list[int], steps: list[Step]) -> list[list[int]]:
    """The token ids each step started from."""
    out, ids = [], list(prompt_ids)
    for step in steps:
        out.append(list(ids))
        ids.extend(step.appended_ids)
    return out


def judged_logps(pair: ModelPair, context: list[int], tokens: list[int], settings: Settings) -> torch.Tensor:
    """Per-token log p of ``tokens`` after ``context`` under the run's distribution, from one full forward, no cache."""
    with torch.inference_mode():
        logits = pair.target(input_ids=torch.tensor([context + tokens])).logits[0].float()
    rows = logits[len(context) - 1 : len(context) - 1 + len(tokens)]
    return log_probs(rows, settings).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("pair_name", ["tiny_pair", "close_pair"])
@pytest.mark.parametrize("mode", ["beam", "beam-sample"])
def test_k1_is_ar_greedy_and_draw_for_draw(request: pytest.FixtureRequest, pair_name: str, mode: str) -> None:
    pair = request.getfixturevalue(pair_name)
    for seed in range(6):
        s = Settings(method="ar", max_new_tokens=30, seed=seed)
        ar = generate(pair, PROMPT, s)
        mtjd = generate(pair, PROMPT, s.with_(method="mtjd", gamma=1, beams=4, draft_mode=mode))
        assert mtjd.new_ids == ar.new_ids, seed
        assert [st.target_logprobs for st in mtjd.steps] == [st.target_logprobs for st in ar.steps]
        assert all(st.target_calls == 1 and st.method == "mtjd" for st in mtjd.steps)
    greedy = Settings(method="ar", greedy=True, max_new_tokens=30)
    assert (
        generate(pair, PROMPT, greedy.with_(method="mtjd", gamma=1)).new_ids == generate(pair, PROMPT, greedy).new_ids
    )


def exhaustive_best(pair: ModelPair, context: list[int], k: int, settings: Settings) -> tuple[list[int], float]:
    """The argmax over every sequence of k tokens of its joint log p under the run's distribution, a sequence ending at
    its first EOS (the tokens after it do not count): V^(k-1) prefixes in one forward, no cache."""
    vocab = pair.vocab_size
    prefixes = list(itertools.product(range(vocab), repeat=k - 1))
    with torch.inference_mode():
        batch = torch.tensor([context + list(p) for p in prefixes])
        logits = pair.target(input_ids=batch).logits[:, len(context) - 1 :].float()  # [P, k, V]
    lp = log_probs(logits, settings)
    best, best_score = None, -math.inf
    for i, prefix in enumerate(prefixes):
        for last in range(vocab):
            seq = [*prefix, last]
            score = 0.0
            for j, t in enumerate(seq):
                score += float(lp[i, j, t])
                if t in pair.eos_ids:
                    seq = seq[: j + 1]
                    break
            if score > best_score:
                best, best_score = seq, score
    return best, best_score


@pytest.mark.parametrize(
    "settings",
    [Settings(greedy=True), Settings(temperature=1.3, top_k=5, top_p=0.95)],
    ids=["greedy", "warped-distribution"],
)
def test_a_full_width_beam_search_finds_the_argmax_of_the_joint(micro_pair: ModelPair, settings: Settings) -> None:
    """With W = V^(K-1) beams the search is exhaustive: every step's K tokens are the argmax of the target's
    joint distribution over all V^K blocks from that context (beam search with the default seed is deterministic)."""
    k, vocab = 3, micro_pair.vocab_size
    s = settings.with_(method="mtjd", gamma=k, beams=vocab ** (k - 1), max_new_tokens=4 * k, seed=0)
    ids = micro_pair.encode("abcab")
    without_eos = ModelPair(**{**micro_pair.__dict__, "eos_ids": frozenset()})
    checked = at_eos = 0
    for pair, prompt in itertools.product((micro_pair, without_eos), (ids, ids[:2], ids[::-1])):
        # the step loop, not decode(): W = 100 is past the validated range (at most 64)
        steps = list(run_steps(DECODERS["mtjd"].step, pair, prompt, s))
        for context, step in zip(contexts(prompt, steps), steps, strict=True):
            if not step.beams:
                continue
            want, score = exhaustive_best(pair, context, k, s)
            assert step.appended_ids == want and step.beam_scores[step.best_beam] == pytest.approx(score, abs=1e-4)
            checked += 1
            at_eos += step.eos
    assert checked >= 10 and at_eos >= 1


CASES = {
    "tiny-greedy": ("tiny_pair", Settings(greedy=True, gamma=4, beams=4)),
    "tiny-sampling": ("tiny_pair", Settings(gamma=3, beams=5, seed=3)),
    "close-beam-sample": ("close_pair", Settings(gamma=4, beams=3, draft_mode="beam-sample", seed=4)),
    "micro-warped": ("micro_pair", Settings(gamma=3, beams=6, temperature=1.3, top_k=4, seed=1)),
}


@pytest.mark.parametrize("case", CASES)
def test_beams_and_cache_equal_a_cache_free_recompute(request: pytest.FixtureRequest, case: str) -> None:
    """Every beam's joint log p, the written block's per-prefix joint and T = 1 log p, and the target's KV
    cache after each step, against full forwards without a cache."""
    pair_name, s = CASES[case]
    pair = request.getfixturevalue(pair_name)
    pair = ModelPair(**{**pair.__dict__, "eos_ids": frozenset()})  # a whole run (the EOS path: below)
    s = s.with_(method="mtjd", max_new_tokens=40)
    st = DecodeState.start(pair, pair.encode(PROMPT), s)
    beams_seen = 0
    while st.remaining > 0:
        context = list(st.ids)
        step = mtjd_step(st)
        torch.testing.assert_close(
            cached_next_logits(st.target, st.ids), full_logits(pair.target, st.ids), rtol=1e-4, atol=1e-4
        )
        assert st.draft is None and len(st.ids) - st.target.length == 1  # all but the newest token, as AR
        if step.beams:
            k = min(s.gamma, s.max_new_tokens - (len(context) - len(pair.encode(PROMPT))))
            assert step.target_calls == k and len(step.beams) == len(step.beam_scores) == s.beams
            assert step.best_beam == max(range(s.beams), key=lambda b: step.beam_scores[b])
            assert step.appended_ids == step.beams[step.best_beam]
            for beam, score in zip(step.beams, step.beam_scores, strict=True):
                assert len(beam) == k or beam[-1] in pair.eos_ids
                want = float(judged_logps(pair, context, beam, s).sum())
                assert score == pytest.approx(want, abs=1e-4) or (math.isinf(want) and score == want)
                beams_seen += 1
            joint = judged_logps(pair, context, step.appended_ids, s).cumsum(0).tolist()
            assert step.log_p == pytest.approx(joint, abs=1e-4)
            t1 = judged_logps(pair, context, step.appended_ids, Settings(greedy=True))  # unwarped, T = 1
            assert step.target_logprobs == pytest.approx(t1.tolist(), abs=1e-4)
        assert step.from_target == [True] * len(step.appended_ids) and step.accepted == 0 and not step.draft_ids
        if step.eos:
            break
    assert beams_seen >= 3 * s.beams


def test_a_beam_ends_at_its_eos_and_so_does_the_run(close_pair: ModelPair) -> None:
    s = Settings(method="mtjd", greedy=True, gamma=4, beams=4, max_new_tokens=40)
    free = generate(close_pair, PROMPT, s).new_ids
    stop = free[next(i for i, t in enumerate(free) if t not in free[:i] and i >= 5)]
    pair = ModelPair(**{**close_pair.__dict__, "eos_ids": frozenset({stop})})
    run = generate(pair, PROMPT, s)
    assert run.steps[-1].eos and run.new_ids[-1] == stop and stop not in run.new_ids[:-1]
    for step in run.steps:
        for beam in step.beams or []:
            assert stop not in beam[:-1]
    ended = [b for step in run.steps for b in step.beams or [] if b[-1] == stop and len(b) < s.gamma]
    assert ended, "no beam ended early at the EOS: the test did not exercise it"


def test_target_calls_count_every_target_forward_of_every_decoder(close_pair: ModelPair) -> None:
    forwards = []
    hook = close_pair.target.register_forward_hook(lambda *_: forwards.append(1))
    try:
        for method in DECODERS:
            forwards.clear()
            run = generate(close_pair, PROMPT, Settings(method=method, gamma=3, beams=3, max_new_tokens=20, seed=1))
            assert sum(st.target_calls for st in run.steps) == len(forwards) > 0, method
    finally:
        hook.remove()
    mtjd = generate(close_pair, PROMPT, Settings(method="mtjd", gamma=3, beams=3, max_new_tokens=20, seed=1))
    assert (
        [st.target_calls for st in mtjd.steps][:-1]
        == [len(st.appended_ids) for st in mtjd.steps][:-1]
        == [3] * (len(mtjd.steps) - 1)
    )  # K forwards for K tokens (the last step may end at an EOS)


def test_mtjd_settings_are_validated_under_their_own_names(tiny_pair: ModelPair) -> None:
    with pytest.raises(ValueError, match=r"K \(MTJD block length, gamma\) must be an integer from 1 to 32"):
        generate(tiny_pair, PROMPT, Settings(method="mtjd", gamma=0))
    with pytest.raises(ValueError, match="beam width W over the target"):
        generate(tiny_pair, PROMPT, Settings(method="mtjd", beams=65))
    with pytest.raises(ValueError, match="contradict"):
        generate(tiny_pair, PROMPT, Settings(method="mtjd", greedy=True, draft_mode="beam-sample"))
    assert DECODERS["mtjd"].uses == ("gamma", "beams", "draft_mode") and not DECODERS["mtjd"].exact


# ---------------------------------------------------------------- MTAD against MTJD


def test_agreement_counts_on_hand_made_steps() -> None:
    steps = [
        Step(index=0, method="mtad", draft_ids=[1, 2, 3], accepted=2, appended_ids=[1, 2, 9]),
        Step(index=1, method="mtad", draft_ids=[4, 5, 6], accepted=3, appended_ids=[4, 5, 6, 7]),
        Step(index=2, method="mtad", draft_ids=[8, 8, 8], accepted=0, appended_ids=[5]),
        Step(index=3, method="mtad", appended_ids=[3]),  # one token left: no draft, not compared
    ]
    a = agreement(steps, [[1, 2, 4], [4, 5, 6], [5, 0, 0], None], frozenset({0}))
    assert a == Agreement(
        iterations=3, with_accepted=2, prefix_equal=2, block_equal=1, step_equal=2, common_prefix=6, appended=8
    )
    assert a.prefix_equal_rate == 1.0 and a.block_equal_rate == pytest.approx(1 / 3)
    b = agreement(steps[:1], [[1, 0]], frozenset({0}))  # MTJD's block ends at an EOS the draft did not write
    assert (b.prefix_equal, b.block_equal, b.common_prefix) == (0, 0, 1)
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([], [1]) == 0


def test_mtad_with_the_target_as_its_draft_agrees_with_mtjd_everywhere(tiny_pair: ModelPair) -> None:
    """A draft that is the target beam-searches exactly what MTJD searches, and every prefix passes (p = q):
    each accepted prefix and each drafted block is MTJD's choice."""
    pair = ModelPair(**{**tiny_pair.__dict__, "draft": tiny_pair.target, "eos_ids": frozenset()})
    s = Settings(greedy=True, gamma=4, beams=3, tau=0.5, max_new_tokens=30)
    steps, a = run_agreement(pair, pair.encode(PROMPT), s)
    assert a.iterations == len([st for st in steps if st.draft_ids]) >= 5
    assert a.prefix_equal == a.with_accepted == a.block_equal == a.iterations


def test_mtjd_choices_on_the_embedded_pair_are_its_runs_blocks() -> None:
    """On the embedded pair: MTJD's choice at the context of each of its own iterations is the block it wrote
    (the analysis searches as the decoder does), and MTAD's agreement with MTJD is counted over its iterations."""
    pair = load_pair("embedded", device="cpu")
    s = Settings(method="mtjd", gamma=4, beams=4, max_new_tokens=24, seed=0)
    ids = pair.encode("def fibonacci(n):")
    steps = list(decode(pair, ids, s))
    fake = [Step(index=i, method="mtad", draft_ids=[0] * len(st.appended_ids)) for i, st in enumerate(steps)]
    for fake_step, step in zip(fake, steps, strict=True):
        fake_step.appended_ids = step.appended_ids
    assert mtjd_choices(pair, ids, fake, s) == [st.appended_ids for st in steps]
    mtad_steps, a = run_agreement(pair, ids, s.with_(method="mtad", tau=0.1))
    assert a.iterations == sum(1 for st in mtad_steps if st.draft_ids) > 0
    assert 0 <= a.prefix_equal <= a.with_accepted <= a.iterations and a.appended == sum(
        len(st.appended_ids) for st in mtad_steps if st.draft_ids
    )
    assert a.common_prefix > 0  # the embedded draft often writes the target's own best beam
