"""Decoders on tiny real models: caches, greedy equalities, MTAD's rule end to end, budgets."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import cached_next_logits, full_logits, seeded_run

from mtad.decoding import DECODERS, decode, generate
from mtad.decoding import mtad as mtad_decoder
from mtad.decoding.kv import CachedLM
from mtad.decoding.mtad import MTAD, beam_draft
from mtad.decoding.rules import mtad_accept_length
from mtad.decoding.speculative import SD
from mtad.decoding.state import DecodeState, to_host
from mtad.models.pair import ModelPair
from mtad.settings import Settings

PROMPT = "abc def gh"


CACHE_CASES = {
    "tiny-mtad-beam": ("tiny_pair", Settings(method="mtad", gamma=4, beams=4, tau=0.3, seed=3)),
    "tiny-mtad-beam-sample": (
        "tiny_pair",
        Settings(method="mtad", gamma=4, beams=4, tau=0.3, draft_mode="beam-sample", seed=3),
    ),
    "close-mtad-beam-sample": (
        "close_pair",
        Settings(method="mtad", gamma=4, beams=4, tau=0.3, draft_mode="beam-sample", seed=3),
    ),
    "close-mtad-greedy": ("close_pair", Settings(method="mtad", gamma=4, beams=4, tau=0.3, greedy=True)),
    "close-sd-sample": ("close_pair", Settings(method="sd", gamma=4, seed=3)),
    "close-sd-greedy": ("close_pair", Settings(method="sd", gamma=2, greedy=True)),
}


def count_acceptances(steps: list, gamma: int) -> tuple[int, int]:
    """(steps that accepted part of their draft, steps that accepted a whole gamma-token draft)."""
    partial = sum(0 < st.accepted < len(st.draft_ids) for st in steps)
    full = sum(st.accepted == len(st.draft_ids) == gamma for st in steps)
    return partial, full


@pytest.mark.parametrize("case", CACHE_CASES)
def test_kv_cache_matches_full_recompute(request: pytest.FixtureRequest, case: str) -> None:
    pair_name, s = CACHE_CASES[case]
    pair = request.getfixturevalue(pair_name)
    st = DecodeState.start(pair, pair.encode(PROMPT), s.with_(max_new_tokens=120))
    step_fn = {"mtad": MTAD, "sd": SD}[s.method]
    steps = []
    # at least 8 steps, and on until a partial and a full acceptance were both checked
    while st.remaining > 0 and (len(steps) < 8 or not all(count_acceptances(steps, s.gamma))):
        steps.append(step_fn(st))
        # nothing is re-encoded: the target's cache holds all but the newest token, the draft's all but two
        assert 0 <= len(st.ids) - st.target.length <= 1 and 0 <= len(st.ids) - st.draft.length <= 2
        for lm, model in ((st.target, pair.target), (st.draft, pair.draft)):
            torch.testing.assert_close(cached_next_logits(lm, st.ids), full_logits(model, st.ids), rtol=1e-4, atol=1e-4)
        if steps[-1].eos:
            break
    rolled_back = sum(step.accepted < len(step.draft_ids) for step in steps)
    assert rolled_back > 0, "the run never rolled a cache back: the test did not exercise crop()"
    if pair_name == "close_pair":
        # the caches were checked after real acceptances: a partial one (crop inside the draft) and a full one
        partial, full = count_acceptances(steps, s.gamma)
        assert partial > 0 and full > 0, (partial, full)


def test_beam_reorder_keeps_each_row_consistent(tiny_pair: ModelPair) -> None:
    s = Settings(method="mtad", gamma=4, beams=6, greedy=True, max_new_tokens=40)
    st = DecodeState.start(tiny_pair, tiny_pair.encode(PROMPT), s)
    beams = beam_draft(st, 4)
    best = beams.tokens[beams.best].tolist()
    # the draft cache now holds context + the best beam's first g-1 tokens
    assert st.draft.length == len(st.ids) + 3
    ids = st.ids + best[:3]
    cached = st.draft.feed(torch.tensor([[best[3]]]), keep=1)[0, -1]
    torch.testing.assert_close(cached, full_logits(tiny_pair.draft, ids + [best[3]]), rtol=1e-4, atol=1e-4)
    # scores are the joint log q of each beam under the draft
    with torch.inference_mode():
        lq = torch.log_softmax(tiny_pair.draft(input_ids=torch.tensor([st.ids + best])).logits[0].float(), -1)
    n = len(st.ids)
    want = sum(lq[n - 1 + i, t] for i, t in enumerate(best))
    assert float(beams.scores[beams.best]) == pytest.approx(float(want), abs=1e-4)


def test_deterministic_beam_draft_equals_hf_beam_search(tiny_pair: ModelPair) -> None:
    for width, gamma, prompt in ((4, 4, PROMPT), (8, 3, "hhh a"), (2, 5, "fed")):
        s = Settings(method="mtad", gamma=gamma, beams=width, greedy=True, max_new_tokens=40)
        ids = tiny_pair.encode(prompt)
        st = DecodeState.start(tiny_pair, ids, s)
        beams = beam_draft(st, gamma)
        ours = beams.tokens[beams.best].tolist()
        hf = tiny_pair.draft.generate(
            torch.tensor([ids]),
            num_beams=width,
            do_sample=False,
            max_new_tokens=gamma,
            min_new_tokens=gamma,
            eos_token_id=None,
            pad_token_id=0,
            length_penalty=1.0,
        )
        assert ours == hf[0, len(ids) :].tolist(), (width, gamma, prompt)


@pytest.mark.parametrize("pair_name", ["tiny_pair", "close_pair"])
def test_greedy_sd_equals_greedy_ar_and_transformers(request: pytest.FixtureRequest, pair_name: str) -> None:
    pair = request.getfixturevalue(pair_name)
    sd_steps = []
    for prompt in (PROMPT, "a", "ggg hhh abcabc"):
        ar = generate(pair, prompt, Settings(method="ar", greedy=True, max_new_tokens=40)).new_ids
        for gamma in (1, 3, 7):
            sd = generate(pair, prompt, Settings(method="sd", greedy=True, gamma=gamma, max_new_tokens=40))
            assert sd.new_ids == ar, (prompt, gamma)
            sd_steps += sd.steps if gamma == 3 else []
        ids = torch.tensor([pair.encode(prompt)])
        hf = pair.target.generate(ids, do_sample=False, max_new_tokens=40, pad_token_id=0)
        assisted = pair.target.generate(
            ids, do_sample=False, max_new_tokens=40, pad_token_id=0, assistant_model=pair.draft
        )
        assert hf[0, ids.shape[1] :].tolist() == ar
        assert assisted[0, ids.shape[1] :].tolist() == ar
    if pair_name == "close_pair":
        partial, full = count_acceptances(sd_steps, 3)
        assert partial > 0 and full > 0, (partial, full)


def test_mtad_tau_one_is_greedy_ar_and_tau_zero_takes_every_draft(tiny_pair: ModelPair) -> None:
    ar = generate(tiny_pair, PROMPT, Settings(method="ar", greedy=True, max_new_tokens=30)).new_ids
    one = generate(tiny_pair, PROMPT, Settings(method="mtad", greedy=True, tau=1.0, max_new_tokens=30))
    assert one.new_ids == ar and all(s.accepted == 0 for s in one.steps)
    zero = generate(tiny_pair, PROMPT, Settings(method="mtad", greedy=True, tau=0.0, gamma=4, max_new_tokens=30))
    # every draft is accepted; where an EOS among them ends the run, only the kept drafts count
    assert all(s.accepted == len(s.draft_ids) or (s.eos and s.accepted == len(s.appended_ids)) for s in zero.steps)


@pytest.mark.parametrize("greedy", [True, False])
def test_mtad_trace_and_target_token(tiny_pair: ModelPair, greedy: bool) -> None:
    s = Settings(method="mtad", greedy=greedy, tau=0.2, gamma=4, beams=4, max_new_tokens=50, seed=5)
    run = generate(tiny_pair, PROMPT, s)
    context = list(run.prompt_ids)
    for step in run.steps:
        # the recorded joints give the recorded decision under the same rule
        assert step.accepted == mtad_accept_length(step.log_p, step.log_q, s.tau)
        assert step.appended_ids[: step.accepted] == step.draft_ids[: step.accepted]
        assert step.from_target == [False] * step.accepted + [True]
        after = context + step.draft_ids[: step.accepted]
        logits = full_logits(tiny_pair.target, after)
        extra = step.appended_ids[-1]
        if greedy:
            assert extra == int(logits.argmax())  # the target's own argmax at position eta+1
        lp = torch.log_softmax(logits, -1)[extra]
        assert step.target_logprobs[-1] == pytest.approx(float(lp), abs=1e-4)
        context.extend(step.appended_ids)


@pytest.mark.parametrize("mode", ["beam", "beam-sample"])
def test_mtad_step_records_its_beams_and_draft_calls(tiny_pair: ModelPair, mode: str) -> None:
    """The beams a step shows are the beam search's: W distinct drafts of g tokens, the best one by
    joint log q is the draft verified; ``draft_calls`` adds up to the draft forwards a hook counted."""
    s = Settings(method="mtad", tau=0.2, gamma=4, beams=4, draft_mode=mode, max_new_tokens=40, seed=2)
    run, forwards = seeded_run(tiny_pair, PROMPT, s)
    assert sum(step.draft_calls for step in run.steps) == forwards > 0
    for step in [step for step in run.steps if step.draft_calls]:
        g = len(step.draft_ids)
        assert step.draft_calls == g and len(step.beams) == len(step.beam_scores) == s.beams
        assert all(len(beam) == g for beam in step.beams) and len(set(map(tuple, step.beams))) == s.beams
        assert step.best_beam == max(range(s.beams), key=step.beam_scores.__getitem__)
        assert step.beams[step.best_beam] == step.draft_ids
        assert step.beam_scores[step.best_beam] == pytest.approx(step.log_q[-1], abs=1e-5)


@pytest.mark.parametrize("method", ["sd", "mtad", "mtad-tree", "bild", "spectr", "specinfer"])
def test_the_last_tokens_of_a_budget_are_drafted_or_taken_from_the_target(tiny_pair: ModelPair, method: str) -> None:
    """One token left: an AR step (no draft); two left: a one-token draft, accepted at τ 0 with the
    target's token after it."""
    ar = generate(tiny_pair, PROMPT, Settings(method="ar", greedy=True, max_new_tokens=2))
    s = Settings(method=method, greedy=True, gamma=4, beams=4, tau=0.0, tau1=0.0)
    one = generate(tiny_pair, PROMPT, s.with_(max_new_tokens=1))
    assert one.new_ids == ar.new_ids[:1] and [step.draft_calls for step in one.steps] == [0]
    two = generate(tiny_pair, PROMPT, s.with_(max_new_tokens=2))
    assert [step.draft_calls for step in two.steps][0] == 1 and len(two.steps[0].draft_ids) == 1
    if method == "mtad":
        assert len(two.steps) == 1 and two.steps[0].accepted == 1 and len(two.new_ids) == 2
        assert two.new_ids[0] == two.steps[0].draft_ids[0]


def test_feed_runs_the_output_layer_over_the_kept_positions_only(tiny_pair: ModelPair) -> None:
    """A prefill asks for one position's logits: the head must not run over the whole prompt (a 49k-token
    head over a long prompt costs more than the rest of the forward)."""
    seen = []
    hook = tiny_pair.target.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    try:
        lm = CachedLM(tiny_pair.target, tiny_pair.vocab_size)
        ids = tiny_pair.encode(PROMPT)
        logits = lm.feed(torch.tensor([ids]), keep=2)
    finally:
        hook.remove()
    assert seen == [2] and len(ids) > 2
    for back, row in ((2, 0), (1, 1)):
        expected = full_logits(tiny_pair.target, ids[: len(ids) - back + 1])
        torch.testing.assert_close(logits[0, row], expected, rtol=1e-4, atol=1e-4)


def test_rollback_to_the_cached_length_keeps_the_cache(tiny_pair: ModelPair) -> None:
    lm = CachedLM(tiny_pair.target, tiny_pair.vocab_size)
    lm.feed(torch.tensor([tiny_pair.encode(PROMPT)]))
    n = lm.length
    lm.rollback(n)
    assert lm.length == n
    lm.rollback(n - 3)
    assert lm.length == n - 3


@pytest.mark.parametrize("method", list(DECODERS))
def test_steps_are_seeded_numbered_named_and_say_where_each_token_came_from(close_pair: ModelPair, method: str) -> None:
    s = Settings(method=method, gamma=3, beams=2, tau1=0.2, max_new_tokens=24, seed=2)
    run, _ = seeded_run(close_pair, PROMPT, s)  # every draw comes from the run's seed
    assert [st.index for st in run.steps] == list(range(len(run.steps))) and len(run.steps) > 2
    assert not DECODERS[method].drafts or sum(st.accepted for st in run.steps) >= 3
    assert {st.method for st in run.steps} == {method}
    for st in run.steps:  # the lanes colour a token by where it came from: the draft, then the target
        assert st.from_target == [i >= st.accepted for i in range(len(st.appended_ids))]


def test_to_host_keeps_each_tensor_in_its_place() -> None:
    """One host read for several tensors, absent ones (None) anywhere in the list, 0-d ones as scalars."""
    out = to_host(torch.tensor([3, 4]), None, torch.tensor(0.5), None, torch.tensor([[1.0, 2.0]]), torch.tensor(7))
    assert out == [[3, 4], None, 0.5, None, [1.0, 2.0], 7]
    assert all(type(v) is int for v in out[0]) and type(out[5]) is int


@pytest.mark.parametrize("pair_name", ["tiny_pair", "close_pair"])
@pytest.mark.parametrize("method", ["ar", "sd", "mtad"])
@pytest.mark.parametrize("greedy", [True, False])
def test_budget_seed_and_prompt_not_counted(
    request: pytest.FixtureRequest, pair_name: str, method: str, greedy: bool
) -> None:
    pair = request.getfixturevalue(pair_name)
    full_drafts = 0
    for budget in (1, 2, 5, 17):
        s = Settings(method=method, greedy=greedy, gamma=4, beams=3, max_new_tokens=budget, seed=11)
        run = generate(pair, PROMPT, s)
        n = sum(len(st.appended_ids) for st in run.steps)
        assert n == len(run.new_ids) <= budget
        assert n == budget or run.steps[-1].eos
        assert len(run.prompt_ids) == len(pair.encode(PROMPT))
        again = generate(pair, PROMPT, s)
        assert again.new_ids == run.new_ids
        full_drafts += sum(0 < st.accepted == len(st.draft_ids) for st in run.steps)
    if pair_name == "close_pair" and method != "ar":
        assert full_drafts > 0, "no draft was accepted whole: the budget near the end was not exercised"


@pytest.mark.parametrize("method", ["ar", "sd", "mtad"])
def test_stops_at_eos(tiny_pair: ModelPair, method: str) -> None:
    s = Settings(method=method, greedy=True, gamma=4, max_new_tokens=20)
    free = generate(tiny_pair, PROMPT, s).new_ids
    stop_at = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 3)
    pair = ModelPair(**{**tiny_pair.__dict__, "eos_ids": frozenset({free[stop_at]})})
    run = generate(pair, PROMPT, s)
    assert run.new_ids == free[: stop_at + 1]
    assert run.steps[-1].eos


@pytest.mark.parametrize("method", ["sd", "mtad"])
def test_eos_inside_an_accepted_draft_cuts_the_rest(close_pair: ModelPair, method: str) -> None:
    """EOS as an accepted draft token, with more accepted tokens after it in the same step: all cut."""
    s = Settings(method=method, greedy=True, gamma=4, max_new_tokens=40)
    free = generate(close_pair, PROMPT, s)
    new, pos, stop_at = free.new_ids, 0, None
    for step in free.steps:
        for j, t in enumerate(step.appended_ids):
            # a draft token followed by others in its step, and the first time the token appears
            if j + 1 < len(step.appended_ids) and not step.from_target[j] and t not in new[: pos + j]:
                stop_at = pos + j
                break
        if stop_at is not None:
            break
        pos += len(step.appended_ids)
    assert stop_at is not None, "no accepted draft token to stop at: the pair accepts too little"
    pair = ModelPair(**{**close_pair.__dict__, "eos_ids": frozenset({new[stop_at]})})
    run = generate(pair, PROMPT, s)
    assert run.new_ids == new[: stop_at + 1]
    last = run.steps[-1]
    assert last.eos and last.from_target[-1] is False and last.accepted >= len(last.appended_ids)
    assert len(last.target_logprobs) == len(last.from_target) == len(last.appended_ids)


def test_sd_trace_replays_its_rule_and_its_seed(close_pair: ModelPair) -> None:
    """An SD step's trace is what its rule did: u_i < p_i/q_i for each accepted draft and not at the first
    rejection, then one target token; ``draft_calls`` counts the draft's forwards; and every draw
    comes from the run's seed, not from torch's global generator."""
    s = Settings(method="sd", gamma=4, seed=11, max_new_tokens=60)
    run, forwards = seeded_run(close_pair, PROMPT, s)
    assert sum(step.draft_calls for step in run.steps) == forwards > 0
    seen = {"accepted": 0, "rejected": 0}
    for step in run.steps:
        g, n = len(step.draft_ids), step.accepted
        if step.draft_calls == 0:
            continue  # one token left: an AR step
        assert len(step.log_p) == len(step.log_q) == len(step.uniforms) == g == step.draft_calls > 0
        if not step.eos:
            assert step.from_target == [False] * n + [True] and len(step.appended_ids) == n + 1
        lp = [b - a for a, b in zip([0.0, *step.log_p], step.log_p, strict=False)]
        lq = [b - a for a, b in zip([0.0, *step.log_q], step.log_q, strict=False)]
        for i in range(min(n + 1, g)):
            margin = step.uniforms[i] - math.exp(lp[i] - lq[i])  # the rule: accept while u < p/q
            if abs(margin) > 1e-6:
                assert (margin < 0) == (i < n), (step.index, i, margin)
                seen["accepted" if i < n else "rejected"] += 1
    assert seen["accepted"] > 0 and seen["rejected"] > 0, seen


def test_seeds_differ(tiny_pair: ModelPair) -> None:
    outs = {
        tuple(
            generate(
                tiny_pair, PROMPT, Settings(method="mtad", draft_mode="beam-sample", seed=k, max_new_tokens=12)
            ).new_ids
        )
        for k in range(4)
    }
    assert len(outs) > 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gamma": 0}, "gamma"),
        ({"gamma": 33}, "gamma"),
        ({"beams": 0}, "beams"),
        ({"beams": 65}, "beams"),
        ({"tau": -0.1}, "tau"),
        ({"tau": 1.5}, "tau"),
        ({"top_p": 0.0}, "top-p"),
        ({"top_p": 1.2}, "top-p"),
        ({"top_k": -1}, "top-k"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 0}, "max new tokens"),
        ({"greedy": True, "draft_mode": "beam-sample"}, "contradict"),
        ({"temperature": 0.0, "draft_mode": "beam-sample"}, "contradict"),
    ],
)
def test_bad_settings_are_refused(tiny_pair: ModelPair, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate(tiny_pair, PROMPT, Settings(**change))


def test_bad_prompts_are_refused(tiny_pair: ModelPair) -> None:
    for prompt in ("", "   \n\t"):
        with pytest.raises(ValueError, match="empty"):
            generate(tiny_pair, prompt, Settings())
    with pytest.raises(ValueError, match="context length of 256"):
        generate(tiny_pair, "abc " * 200, Settings(max_new_tokens=10))
    with pytest.raises(ValueError, match="context length"):
        list(decode(tiny_pair, [1, 2, 3], Settings(max_new_tokens=254)))


@pytest.mark.parametrize("top_p", [0.3, 1.0])
def test_beam_steps_read_from_the_first_tokens_equal_the_whole_distribution(
    close_pair: ModelPair, monkeypatch: pytest.MonkeyPatch, top_p: float
) -> None:
    """MTAD's beam steps take each row's first W tokens under the warped distribution from ``top_log_probs``; taking
    them from the whole rows' distribution (``log_probs``, then top-W) gives the same beams, joint log q and text.
    Top-p 0.3 often keeps fewer than W tokens: the beams past them carry -inf (their tokens are anyone's)."""
    s = Settings(method="mtad", gamma=4, beams=4, tau=0.3, top_p=top_p, seed=5, max_new_tokens=48)
    ids = close_pair.encode(PROMPT)
    fast = list(decode(close_pair, ids, s))
    monkeypatch.setattr(mtad_decoder, "top_log_probs", lambda *args: None)
    whole = list(decode(close_pair, ids, s))
    assert [st.appended_ids for st in fast] == [st.appended_ids for st in whole]

    def live(step: object) -> list:  # none at the end, where there is no room to draft
        return [
            (b, score) for b, score in zip(step.beams or [], step.beam_scores or [], strict=True) if score > -math.inf
        ]

    for a, b in zip(fast, whole, strict=True):
        assert [beam for beam, _ in live(a)] == [beam for beam, _ in live(b)]
        assert [score for _, score in live(a)] == pytest.approx([score for _, score in live(b)], abs=1e-5)
        assert len(a.beams or []) == len(b.beams or []) and a.log_q == pytest.approx(b.log_q, abs=1e-5)
    if top_p < 1.0:
        assert any(len(live(step)) < len(step.beams or []) for step in fast)
