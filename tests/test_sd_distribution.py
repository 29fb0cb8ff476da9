"""Speculative sampling keeps the target's distribution: a goodness-of-fit test that can fail.

On a 10-token vocabulary, the empirical joint distribution of the first two new tokens over many seeds
is compared with the exact distribution computed from the target (chi-square, false-alarm rate 0.1%).
With gamma = 2 the two tokens cover acceptance and the residual resample; with gamma = 1 the
second token is the bonus whenever the first is accepted, so the first gamma + 1 tokens cover
acceptance, resample and bonus. Deliberately wrong SDs (resample from p, not the residual;
bonus from the last draft position's p, not the next) must fail the same test.
"""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from mtad.decoding import decode, speculative
from mtad.models.pair import ModelPair
from mtad.sampling import log_probs
from mtad.settings import Settings

ALPHA = 1e-3
RUNS = 1000
SETTINGS = Settings(method="sd", gamma=2, max_new_tokens=3, temperature=1.3, top_k=5, top_p=0.99)
BONUS = SETTINGS.with_(gamma=1, max_new_tokens=2)


def exact_first_two(pair: ModelPair, ids: list[int], s: Settings) -> dict[tuple[int, int], float]:
    """P(x1, x2) = warp(p)(x1 | ctx) * warp(p)(x2 | ctx, x1), from full target forwards.

    An EOS first token ends the run: that outcome is the 1-tuple (eos,)."""
    with torch.inference_mode():
        p1 = log_probs(pair.target(input_ids=torch.tensor([ids])).logits[0, -1], s).exp()
        exact = {}
        for x1 in torch.nonzero(p1).flatten().tolist():
            if x1 in pair.eos_ids:
                exact[(x1,)] = float(p1[x1])
                continue
            p2 = log_probs(pair.target(input_ids=torch.tensor([ids + [x1]])).logits[0, -1], s).exp()
            for x2 in torch.nonzero(p2).flatten().tolist():
                exact[(x1, x2)] = float(p1[x1] * p2[x2])
    return exact


def sampled_first_two(pair: ModelPair, ids: list[int], s: Settings) -> Counter:
    return sampled(pair, ids, s)[0]


def sampled(pair: ModelPair, ids: list[int], s: Settings) -> tuple[Counter, Counter]:
    """Counts of the first two new tokens over RUNS seeds, and of how the first step ended:
    "bonus" (every draft accepted, then the target's own next token), "resample" (a rejection)."""
    counts, kinds = Counter(), Counter()
    for seed in range(RUNS):
        steps = list(decode(pair, ids, s.with_(seed=seed)))
        new = [t for step in steps for t in step.appended_ids]
        counts[tuple(new[:2])] += 1
        first = steps[0]
        if first.accepted < len(first.draft_ids):
            kinds["resample"] += 1
        elif len(first.appended_ids) == first.accepted + 1:
            kinds["bonus"] += 1
    return counts, kinds


def gof_pvalue(counts: Counter, exact: dict[tuple[int, int], float]) -> float:
    """Chi-square p-value; cells expected below 5 are pooled into one; a draw outside the distribution fails."""
    assert set(counts) <= set(exact), f"drew pairs the target gives probability 0: {set(counts) - set(exact)}"
    total = sum(counts.values())
    big = [k for k, v in exact.items() if v * total >= 5]
    obs = [counts[k] for k in big]
    exp = [exact[k] * total for k in big]
    rest_obs, rest_exp = total - sum(obs), total - sum(exp)
    if rest_exp > 0:
        obs.append(rest_obs)
        exp.append(rest_exp)
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


@pytest.fixture(scope="module")
def setup(micro_pair: ModelPair) -> tuple[ModelPair, list[int], dict]:
    ids = micro_pair.encode("abcab")
    return micro_pair, ids, exact_first_two(micro_pair, ids, SETTINGS)


def test_sd_matches_target_distribution(setup: tuple) -> None:
    pair, ids, exact = setup
    assert len(exact) >= 10, "too few outcomes for a meaningful test"
    # the draft must disagree with the target often, or the test would not exercise resampling
    first = [next(decode(pair, ids, SETTINGS.with_(seed=k))) for k in range(100)]
    assert sum(s.accepted < len(s.draft_ids) for s in first) >= 30
    counts = sampled_first_two(pair, ids, SETTINGS)
    assert gof_pvalue(counts, exact) > ALPHA


def test_hf_assisted_matches_target_distribution(setup: tuple) -> None:
    """transformers' assisted generation, as the bench runs it, samples the same warped distribution: this holds
    only if its generation configs carry our sampling (do_sample, temperature, top-k, top-p) and
    nothing else (no epsilon or eta cutoff, no typical-p)."""
    pair, ids, exact = setup
    counts = sampled_first_two(pair, ids, SETTINGS.with_(method="hf-assisted"))
    assert gof_pvalue(counts, exact) > ALPHA


def test_wrong_residual_is_caught(setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    pair, ids, exact = setup
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    counts = sampled_first_two(pair, ids, SETTINGS)
    assert gof_pvalue(counts, exact) < ALPHA


@pytest.fixture(scope="module")
def bonus_setup(micro_close_pair: ModelPair) -> tuple[ModelPair, list[int], dict]:
    ids = micro_close_pair.encode("bb")
    return micro_close_pair, ids, exact_first_two(micro_close_pair, ids, BONUS)


def test_sd_bonus_and_resample_match_target_distribution(bonus_setup: tuple) -> None:
    pair, ids, exact = bonus_setup
    assert len(exact) >= 10, "too few outcomes for a meaningful test"
    counts, kinds = sampled(pair, ids, BONUS)
    # both rare paths must carry real weight in the sample, or the test would not judge them
    assert kinds["bonus"] >= RUNS // 2, kinds
    assert kinds["resample"] >= RUNS // 10, kinds
    assert gof_pvalue(counts, exact) > ALPHA


def test_bonus_from_the_wrong_position_is_caught(bonus_setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the bonus drawn from p[g-1] (the last draft's position) instead of p[g]."""
    pair, ids, exact = bonus_setup
    rule = speculative.sd_rule.eager  # SD's rule as written (compiled only on a GPU)
    source = inspect.getsource(rule)
    target_row = "p_rows.probs_at(row)"
    assert source.count(target_row) == 1, "sd_rule no longer takes p at row n: update this control"
    scope = dict(vars(speculative))
    wrong_row = "p_rows.probs_at(row - (n == g).long())"  # row g - 1 where the bonus is drawn
    exec(compile(source.replace(target_row, wrong_row), speculative.__file__, "exec"), scope)
    # swap the code in place, so every reference to the rule (SD's iteration, so the registry too) runs the bug
    monkeypatch.setattr(rule, "__code__", scope["sd_rule"].eager.__code__)
    counts, kinds = sampled(pair, ids, BONUS)
    assert kinds["bonus"] >= RUNS // 2, kinds
    # caught either way: pairs the warped target gives probability 0, or a misfit
    assert set(counts) - set(exact) or gof_pvalue(counts, exact) < ALPHA
