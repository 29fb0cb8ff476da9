"""BiLD, Spectr, SpecInfer and MTAD over all beams: greedy equalities, hand-made BiLD cases,
the single-position rules against their exact distribution, and the multi-row cache against a recompute."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from conftest import cached_next_logits, full_logits, seeded_run
from scipy.stats import chisquare
from test_architectures import arch_pair  # noqa: F401  (the OPT/Qwen2 pair fixture)

from mtad.decoding import DECODERS, decode, generate, specinfer, spectr
from mtad.decoding.bild import bild_rollback
from mtad.decoding.multidraft import kept_lengths
from mtad.decoding.spec import settings_for
from mtad.decoding.state import DecodeState
from mtad.models.pair import load
from mtad.sampling import log_probs
from mtad.settings import Settings

PROMPT = "abc de"


def new_ids(pair, s: Settings) -> list[int]:  # noqa: ANN001
    return generate(pair, PROMPT, s).new_ids


def joints(model, ctx: list[int], draft: list[int], s: Settings) -> list[float]:  # noqa: ANN001
    """The joint (cumulated) warped log-probabilities of ``draft`` after ``ctx``, from one full forward."""
    with torch.inference_mode():
        lp = log_probs(model(input_ids=torch.tensor([ctx + draft])).logits[0].float(), s)
    return (
        torch.tensor([float(lp[len(ctx) - 1 + j, t]) for j, t in enumerate(draft)], dtype=torch.float64)
        .cumsum(0)
        .tolist()
    )


@pytest.mark.parametrize("method", ["spectr", "specinfer"])
def test_greedy_multi_draft_equals_greedy_ar(tiny_pair, method: str) -> None:  # noqa: ANN001
    ar = new_ids(tiny_pair, Settings(method="ar", greedy=True, max_new_tokens=40))
    got = generate(tiny_pair, PROMPT, Settings(method=method, greedy=True, gamma=3, num_drafts=3, max_new_tokens=40))
    assert got.new_ids == ar
    assert any(s.accepted > 0 for s in got.steps) and any(s.accepted < len(s.draft_ids) for s in got.steps)


@pytest.mark.parametrize("method", ["spectr", "specinfer"])
def test_greedy_multi_draft_drafts_the_argmax_and_keeps_what_greedy_sd_keeps(close_pair, method: str) -> None:  # noqa: ANN001
    """Greedy: every candidate is the draft's argmax sequence, so each iteration keeps what greedy SD keeps
    (the output alone cannot tell: greedy verification writes the target's argmax whatever was drafted)."""
    s = Settings(method=method, greedy=True, gamma=3, num_drafts=3, max_new_tokens=40)
    got = generate(close_pair, PROMPT, s)
    sd = generate(close_pair, PROMPT, s.with_(method="sd"))
    assert got.new_ids == sd.new_ids == new_ids(close_pair, s.with_(method="ar"))
    assert [st.accepted for st in got.steps] == [st.accepted for st in sd.steps]
    assert all(c == st.draft_ids for st in got.steps if st.candidates for c in st.candidates)
    assert any(st.accepted == len(st.draft_ids) > 0 for st in got.steps), "no draft was kept whole: no bonus token"


@pytest.mark.parametrize("method", ["spectr", "specinfer"])
def test_multi_draft_trace_is_the_followed_candidates(close_pair, method: str) -> None:  # noqa: ANN001
    """Sampling: log p and log q are the cumulated warped target and draft log-probabilities of the followed
    candidate (recomputed by full forwards), which carries the kept prefix; ``candidate_kept`` says how far
    each candidate agrees with it."""
    s = Settings(method=method, gamma=3, num_drafts=3, max_new_tokens=48, seed=3)
    run = generate(close_pair, PROMPT, s)
    ctx, other = list(run.prompt_ids), 0
    for step in run.steps:
        if step.candidates:
            d = step.draft_ids
            assert d == step.candidates[step.chosen] and step.appended_ids[: step.accepted] == d[: step.accepted]
            assert step.log_p == pytest.approx(joints(close_pair.target, ctx, d, s), abs=1e-4)
            assert step.log_q == pytest.approx(joints(close_pair.draft, ctx, d, s), abs=1e-4)
            for c, k in zip(step.candidates, step.candidate_kept, strict=True):
                assert c[:k] == d[:k] and (k == step.accepted or c[k] != d[k])
            other += any(0 < k < step.accepted for k in step.candidate_kept) or step.chosen > 0
        ctx += step.appended_ids
    assert other, "every candidate agreed with the kept prefix wholly or not at all: candidate_kept untested"


@pytest.mark.parametrize("mode", ["beam", "beam-sample"])
@pytest.mark.parametrize("greedy", [True, False])
def test_mtad_tree_with_one_beam_is_mtad(tiny_pair, mode: str, greedy: bool) -> None:  # noqa: ANN001
    if greedy and mode == "beam-sample":
        pytest.skip("greedy and beam sampling contradict each other (refused by Settings)")
    for seed in range(3):
        s = Settings(method="mtad", greedy=greedy, beams=1, draft_mode=mode, tau=0.3, seed=seed, max_new_tokens=30)
        mtad = generate(tiny_pair, PROMPT, s)
        tree = generate(tiny_pair, PROMPT, s.with_(method="mtad-tree"))
        assert tree.new_ids == mtad.new_ids
        assert [t.accepted for t in tree.steps] == [t.accepted for t in mtad.steps]


def test_mtad_tree_keeps_the_longest_prefix_over_all_beams(tiny_pair) -> None:  # noqa: ANN001
    """Every beam's passing length, recomputed from full draft and target forwards: the kept one is
    the longest, and the first iteration drafts what MTAD drafts and never keeps less."""
    from mtad.decoding.rules import mtad_accept_length

    chose_other = ties = 0
    for seed in range(4):
        mode = ("beam", "beam-sample")[seed % 2]  # sampled beams: the best need not be row 0
        s = Settings(method="mtad-tree", beams=4, tau=0.5, seed=seed, max_new_tokens=24, draft_mode=mode)
        ids = tiny_pair.encode(PROMPT)
        mtad = next(decode(tiny_pair, ids, s.with_(method="mtad")))
        ctx = list(ids)
        for k, step in enumerate(decode(tiny_pair, ids, s)):
            if step.candidates is None:  # the budget's last token comes from a plain target step
                continue
            if k == 0:
                assert step.candidates[step.best_beam] == mtad.draft_ids and step.accepted >= mtad.accepted
            etas = [
                mtad_accept_length(joints(tiny_pair.target, ctx, b, s), joints(tiny_pair.draft, ctx, b, s), s.tau)
                for b in step.candidates
            ]
            assert step.accepted == max(etas) == etas[step.chosen]
            # ties go to the draft's best beam, then to the lowest index
            tied = [w for w, e in enumerate(etas) if e == max(etas)]
            assert step.chosen == (step.best_beam if step.best_beam in tied else tied[0])
            assert step.candidate_kept[step.chosen] == step.accepted
            # the trace is the chosen beam's: its tokens and joint log p and log q; every beam and its score
            chosen = step.candidates[step.chosen]
            assert step.draft_ids == chosen and step.beams == step.candidates
            assert step.log_p == pytest.approx(joints(tiny_pair.target, ctx, chosen, s), abs=1e-4)
            assert step.log_q == pytest.approx(joints(tiny_pair.draft, ctx, chosen, s), abs=1e-4)
            assert (
                len(step.beam_scores) == len(step.beams) and max(step.beam_scores) == step.beam_scores[step.best_beam]
            )
            ties += len(tied) > 1 and step.best_beam in tied and tied[0] < step.best_beam
            chose_other += step.chosen != step.best_beam
            ctx += step.appended_ids
    assert chose_other, "no iteration kept a beam other than the draft's best: the all-beams path never ran"
    assert ties, "the best beam never tied with a lower-index beam: the tie-break was not exercised"


def test_bild_tau2_zero_greedy_is_greedy_ar(tiny_pair) -> None:  # noqa: ANN001
    ar = new_ids(tiny_pair, Settings(method="ar", greedy=True, max_new_tokens=40))
    run = generate(tiny_pair, PROMPT, Settings(method="bild", greedy=True, tau1=0.0, tau2=0.0, max_new_tokens=40))
    assert run.new_ids == ar
    assert all(s.accepted == 0 for s in run.steps) and any(s.draft_ids for s in run.steps)


def test_bild_rollback_rule() -> None:
    assert bild_rollback([0.1, 2.5, 0.3], 2.0) == 1
    assert bild_rollback([0.1, 2.0, 0.3], 2.0) == 3  # exactly tau2 is kept
    assert bild_rollback([3.0], 2.0) == 0
    assert bild_rollback([0.5, float("inf")], 2.0) == 1
    assert bild_rollback([], 2.0) == 0


def test_bild_fallback_always_and_never(tiny_pair) -> None:  # noqa: ANN001
    """tau1 = 1: the draft is never sure, so the target writes every token (greedy: AR). tau1 = 0 and a
    huge tau2: neither threshold fires, so every iteration keeps gamma drafts plus a bonus token."""
    ar = new_ids(tiny_pair, Settings(method="ar", greedy=True, max_new_tokens=30))
    always = generate(tiny_pair, PROMPT, Settings(method="bild", greedy=True, tau1=1.0, max_new_tokens=30))
    assert always.new_ids == ar and all(s.draft_ids == [] for s in always.steps)
    assert sum(s.draft_calls == 1 for s in always.steps) >= len(always.steps) - 1  # the last may be a plain AR step
    never = generate(
        tiny_pair, PROMPT, Settings(method="bild", greedy=True, gamma=5, tau1=0.0, tau2=1e9, max_new_tokens=30)
    )
    full = [s for s in never.steps if len(s.draft_ids) == 5]
    # an EOS inside the drafts cuts the step there, and then only the kept drafts count as accepted
    assert full and all(s.accepted == 5 and len(s.appended_ids) == 6 or s.eos for s in full)
    assert any(not s.eos for s in full)


@pytest.mark.parametrize("tau2", [1.5, 2.0])
def test_bild_rolls_back_where_the_target_nll_exceeds_tau2(tiny_dirs, tau2: float) -> None:  # noqa: ANN001
    """Each iteration's kept count and target token, recomputed from a full target forward. The
    target drafts for itself here (random tiny models disagree too much for a draft to pass)."""
    tiny_pair = load(tiny_dirs[1], tiny_dirs[1], device="cpu")
    s = Settings(method="bild", greedy=True, gamma=3, tau1=0.0, tau2=tau2, max_new_tokens=60)
    ids = tiny_pair.encode(PROMPT)
    ctx, rolled, clean = list(ids), 0, 0
    for step in decode(tiny_pair, ids, s):
        with torch.inference_mode():
            lp = torch.log_softmax(tiny_pair.target(input_ids=torch.tensor([ctx + step.draft_ids])).logits[0], -1)
        nll = [-float(lp[len(ctx) - 1 + j, t]) for j, t in enumerate(step.draft_ids)]
        n = next((j for j, v in enumerate(nll) if v > s.tau2), len(nll))
        assert step.accepted == n
        assert (
            step.appended_ids[: n + 1]
            == (step.draft_ids[:n] + [int(lp[len(ctx) - 1 + n].argmax())])[: len(step.appended_ids)]
        )
        rolled += n < len(step.draft_ids)
        clean += n == len(step.draft_ids) > 0
        ctx += step.appended_ids
    assert rolled and clean, (rolled, clean)


def test_bild_sampled_trace_replays_both_thresholds_and_its_seed(close_pair) -> None:  # noqa: ANN001
    """Sampling: each step's log p and log q are the cumulated warped target and draft log-probabilities of
    its drafts (recomputed by full forwards), drafting stopped exactly where the draft's top probability fell
    below tau1 (or at gamma), the kept count is where the target's NLL first exceeded tau2, the target's
    log-probabilities of what a step appends are the plain ones, ``draft_calls`` counts the draft's
    forwards, and every draw comes from the run's seed, not torch's global generator."""
    s = Settings(method="bild", gamma=4, tau1=0.35, tau2=1.5, seed=5, max_new_tokens=60)
    run, forwards = seeded_run(close_pair, PROMPT, s)
    assert sum(step.draft_calls for step in run.steps) == forwards > 0
    ctx, seen = list(run.prompt_ids), Counter()
    for step in run.steps:
        g = min(s.gamma, s.max_new_tokens - (len(ctx) - len(run.prompt_ids)) - 1)
        d = step.draft_ids
        lq = [log_probs(full_logits(close_pair.draft, ctx + d[:i]), s) for i in range(len(d) + 1)]
        lp = [log_probs(full_logits(close_pair.target, ctx + d[:i]), s) for i in range(len(d) + 1)]
        assert step.log_q == pytest.approx(
            torch.tensor([lq[i][t] for i, t in enumerate(d)]).cumsum(0).tolist(), abs=1e-4
        )
        assert step.log_p == pytest.approx(
            torch.tensor([lp[i][t] for i, t in enumerate(d)]).cumsum(0).tolist(), abs=1e-4
        )
        assert all(float(lq[i].max()) >= math.log(s.tau1) for i in range(len(d)))  # sure enough to draft
        if g > 0 and len(d) < g:
            assert float(lq[len(d)].max()) < math.log(s.tau1)  # the fallback
            seen["fallback"] += 1
        assert step.draft_calls == (0 if g <= 0 else len(d) + (len(d) < g))
        nll = [-float(lp[i][t]) for i, t in enumerate(d)]
        assert step.accepted == min(bild_rollback(nll, s.tau2), len(step.appended_ids))
        assert step.appended_ids[: step.accepted] == d[: step.accepted]
        plain = [
            torch.log_softmax(full_logits(close_pair.target, ctx + step.appended_ids[:i]), -1)[t]
            for i, t in enumerate(step.appended_ids)
        ]
        assert step.target_logprobs == pytest.approx([float(v) for v in plain], abs=1e-4)
        seen["rollback"] += step.accepted < len(d)
        seen["kept"] += step.accepted
        ctx += step.appended_ids
    assert seen["fallback"] and seen["rollback"] and seen["kept"], seen


# --- the single-position rules against the distribution they must produce --------------------------------

P = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05], dtype=torch.float64)
Q = torch.tensor([0.4, 0.05, 0.1, 0.05, 0.4], dtype=torch.float64)
DRAWS = 6000


def rule_warp(rule, k: int) -> Counter:  # noqa: ANN001
    g = torch.Generator().manual_seed(11)
    counts = Counter()
    for _ in range(DRAWS):
        cands = torch.multinomial(Q, k, replacement=True, generator=g).tolist()
        idx, residual = rule(P, Q, cands, g)
        counts[cands[idx] if idx is not None else int(torch.multinomial(residual, 1, generator=g))] += 1
    return counts


def pvalue(counts: Counter) -> float:
    return float(chisquare([counts[i] for i in range(len(P))], (P * DRAWS).tolist()).pvalue)


@pytest.mark.parametrize("rule", [spectr.kseq, specinfer.mss], ids=["kseq", "mss"])
def test_rule_output_is_p(rule) -> None:  # noqa: ANN001
    assert pvalue(rule_warp(rule, 3)) > 1e-3


def test_kseq_rho_keeps_the_residual_non_negative() -> None:
    for k in (1, 2, 4):
        rho = spectr.kseq_rho(P, Q, k)
        accept = torch.minimum(Q, P / rho)
        beta = float(accept.sum())
        assert (P - accept * (1 - (1 - beta) ** k) / beta).min() >= -1e-9
        assert rho == 1.0 if k == 1 else rho > 1.0


def test_kseq_rho_is_the_smallest_that_keeps_the_residual_non_negative() -> None:
    """Any larger rho keeps the distribution too but accepts less: K-SEQ must take the smallest feasible one."""
    for k in (2, 3, 4, 6):
        rho = spectr.kseq_rho(P, Q, k)

        def slack(r: float, k: int = k) -> float:  # rho * beta - (1 - (1 - beta)^k): feasible when >= 0
            beta = float(torch.minimum(Q, P / r).sum())
            return r * beta - (1 - (1 - beta) ** k)

        assert 1.0 < rho < k and slack(rho) >= -1e-12
        assert slack(rho - 1e-6) < 0, (k, rho)


def test_mss_residual_of_equal_distributions_is_the_distribution_not_nan() -> None:
    """p = q leaves no residual mass (0 / 0): the residual falls back to p, never to NaN."""
    torch.testing.assert_close(specinfer.mss_residual(P, P), P, rtol=0, atol=0)
    r = specinfer.mss_residual(P, Q)
    torch.testing.assert_close(r, (P - Q).clamp_min(0) / (P - Q).clamp_min(0).sum())


def test_wrong_rules_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative controls: K-SEQ without its rho correction, MSS without its residual update."""
    monkeypatch.setattr(spectr, "kseq_rho", lambda p, q, k: 1.0)
    assert pvalue(rule_warp(spectr.kseq, 3)) < 1e-3
    monkeypatch.setattr(specinfer, "mss_residual", lambda p, q: p)
    assert pvalue(rule_warp(specinfer.mss, 3)) < 1e-3


# --- caches after multi-row verification ----------------------------------------------------------


@pytest.mark.parametrize("method", ["spectr", "specinfer", "mtad-tree"])
def test_cache_matches_recompute_after_multi_row_verification(close_pair, method: str) -> None:  # noqa: ANN001
    step_fn, other = DECODERS[method].step, 0
    for seed in (2, 3):
        s = Settings(method=method, gamma=4, beams=4, num_drafts=3, tau=0.3, max_new_tokens=40, seed=seed)
        st = DecodeState.start(close_pair, close_pair.encode(PROMPT), s.with_(draft_mode="beam-sample"))
        while st.remaining > 1:
            step = step_fn(st)
            assert step.candidates and len(step.candidates) == (4 if method == "mtad-tree" else 3)
            for lm, model in ((st.target, close_pair.target), (st.draft, close_pair.draft)):
                want = full_logits(model, st.ids)
                torch.testing.assert_close(cached_next_logits(lm, st.ids), want, rtol=1e-4, atol=1e-4)
            # nothing kept is re-encoded: the target holds all but the newest token, the draft at least the
            # context before the step (MTAD over all beams: plus what the kept beam shares with the best one)
            assert len(st.ids) - st.target.length <= 1 and st.draft.length >= len(st.ids) - len(step.appended_ids)
            if method == "mtad-tree" and step.chosen != step.best_beam:
                other += kept_lengths([step.candidates[step.best_beam]], step.candidates[step.chosen])[0] > 0
            if step.eos:  # the text has ended: a decoder takes no further step
                break
    if method == "mtad-tree":  # the draft's cache holds the best beam: check it after keeping part of it
        assert other, "no kept beam shared a prefix with the best one: the draft cache never kept a part of it"


@pytest.mark.parametrize("method", ["spectr", "specinfer", "mtad-tree", "bild"])
def test_other_architectures(arch_pair, method: str) -> None:  # noqa: ANN001, F811
    """OPT and Qwen2 (the presets' other families): the multi-row verification's cache equals a
    recompute, and the exact methods' greedy output is greedy AR's."""
    s = settings_for(method, gamma=4, beams=3, num_drafts=3, tau=0.3, tau1=0.0, max_new_tokens=30, seed=1)
    st = DecodeState.start(arch_pair, arch_pair.encode(PROMPT), s)
    for _ in range(3):
        DECODERS[method].step(st)
        for lm, model in ((st.target, arch_pair.target), (st.draft, arch_pair.draft)):
            torch.testing.assert_close(cached_next_logits(lm, st.ids), full_logits(model, st.ids), rtol=1e-4, atol=1e-4)
    if method in ("spectr", "specinfer"):
        ar = generate(arch_pair, PROMPT, Settings(method="ar", greedy=True, max_new_tokens=30)).new_ids
        assert generate(arch_pair, PROMPT, s.with_(greedy=True)).new_ids == ar
