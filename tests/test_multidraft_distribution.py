"""Spectr (K-SEQ) and SpecInfer (MSS) keep the target's distribution: the same goodness-of-fit test
as speculative sampling (tests/test_sd_distribution.py), on whole decodes with m = 3 drafts, and a
negative control per method (the rule without its correction) that must fail it."""

from __future__ import annotations

import pytest
from test_sd_distribution import ALPHA, exact_first_two, gof_pvalue, sampled_first_two

from mtad.decoding import decode, specinfer, spectr
from mtad.models.pair import ModelPair
from mtad.settings import Settings

BASE = Settings(gamma=2, num_drafts=3, max_new_tokens=3, temperature=1.3, top_k=5, top_p=0.99)


@pytest.fixture(scope="module")
def setup(micro_pair: ModelPair) -> tuple[ModelPair, list[int], dict]:
    ids = micro_pair.encode("abcab")
    return micro_pair, ids, exact_first_two(micro_pair, ids, BASE)


@pytest.mark.parametrize("gamma", [2, 1])
@pytest.mark.parametrize("method", ["spectr", "specinfer"])
def test_matches_target_distribution(setup: tuple, method: str, gamma: int) -> None:
    """gamma 2: the first two tokens are drafts or residual draws; gamma 1: the second is also the bonus
    token drawn from the target after a fully accepted draft."""
    pair, ids, exact = setup
    s = BASE.with_(method=method, gamma=gamma)
    first = [next(decode(pair, ids, s.with_(seed=k))) for k in range(100)]
    # the rare paths must run: a later candidate followed, and a full rejection (residual draw)
    assert sum(st.chosen > 0 for st in first) >= 5
    assert sum(st.accepted == 0 for st in first) >= 5
    assert gamma > 1 or sum(st.accepted == 1 for st in first) >= 5  # ... and the bonus token
    assert gof_pvalue(sampled_first_two(pair, ids, s), exact) > ALPHA


@pytest.mark.parametrize(
    ("method", "module", "name", "wrong"),
    [
        ("spectr", spectr, "kseq_rho", lambda p, q, k: 1.0),
        ("specinfer", specinfer, "mss_residual", lambda p, q: p),
    ],
    ids=["spectr-without-rho", "specinfer-without-residual"],
)
def test_wrong_rule_is_caught(setup: tuple, monkeypatch: pytest.MonkeyPatch, method, module, name, wrong) -> None:  # noqa: ANN001
    pair, ids, exact = setup
    monkeypatch.setattr(module, name, wrong)
    assert gof_pvalue(sampled_first_two(pair, ids, BASE.with_(method=method)), exact) < ALPHA
