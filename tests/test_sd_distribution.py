"""Speculative sampling keeps the target's distribution: a goodness-of-fit test that can fail.

On a 10-token vocabulary, the empirical joint law of the first two new tokens over many seeds
is compared with the exact law computed from the target (chi-square, false-alarm rate 0.1%).
The same test run against a deliberately wrong SD (resample from p, not the residual) must fail.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from mtad.decoding import decode, speculative
from mtad.pair import ModelPair
from mtad.sampling import log_probs
from mtad.settings import Settings

ALPHA = 1e-3
RUNS = 1000
SETTINGS = Settings(method="sd", gamma=2, max_new_tokens=3, temperature=1.3, top_k=5, top_p=0.99)


def exact_first_two(pair: ModelPair, ids: list[int], s: Settings) -> dict[tuple[int, int], float]:
    """P(x1, x2) = warp(p)(x1 | ctx) * warp(p)(x2 | ctx, x1), from full target forwards.

    An EOS first token ends the run: that outcome is the 1-tuple (eos,)."""
    with torch.inference_mode():
        p1 = log_probs(pair.target(input_ids=torch.tensor([ids])).logits[0, -1], s).exp()
        law = {}
        for x1 in torch.nonzero(p1).flatten().tolist():
            if x1 in pair.eos_ids:
                law[(x1,)] = float(p1[x1])
                continue
            p2 = log_probs(pair.target(input_ids=torch.tensor([ids + [x1]])).logits[0, -1], s).exp()
            for x2 in torch.nonzero(p2).flatten().tolist():
                law[(x1, x2)] = float(p1[x1] * p2[x2])
    return law


def sampled_first_two(pair: ModelPair, ids: list[int], s: Settings) -> Counter:
    counts = Counter()
    for seed in range(RUNS):
        new = [t for step in decode(pair, ids, s.with_(seed=seed)) for t in step.appended_ids]
        counts[tuple(new[:2])] += 1
    return counts


def gof_pvalue(counts: Counter, law: dict[tuple[int, int], float]) -> float:
    """Chi-square p-value; cells expected below 5 are pooled into one; a draw outside the law fails."""
    assert set(counts) <= set(law), f"drew pairs the target gives probability 0: {set(counts) - set(law)}"
    total = sum(counts.values())
    big = [k for k, v in law.items() if v * total >= 5]
    obs = [counts[k] for k in big]
    exp = [law[k] * total for k in big]
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
    pair, ids, law = setup
    assert len(law) >= 10, "too few outcomes for a meaningful test"
    # the draft must disagree with the target often, or the test would not exercise resampling
    first = [next(decode(pair, ids, SETTINGS.with_(seed=k))) for k in range(100)]
    assert sum(s.accepted < len(s.draft_ids) for s in first) >= 30
    counts = sampled_first_two(pair, ids, SETTINGS)
    assert gof_pvalue(counts, law) > ALPHA


def test_wrong_residual_is_caught(setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    pair, ids, law = setup
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    counts = sampled_first_two(pair, ids, SETTINGS)
    assert gof_pvalue(counts, law) < ALPHA
