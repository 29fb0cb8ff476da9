"""What Spectr, SpecInfer and BiLD record for the verification panel, checked against the rules they ran.

The decoders keep, per position of their walk, the candidate tokens tried, p(x), q(x), the uniform draws,
Spectr's rho and the residual's likeliest tokens; BiLD keeps the little model's top probability at each
check against tau1. Every recorded figure must be the one the decision was made on: an accepted try's
draw lies under its acceptance probability and every earlier try's does not; a drawn token is the token
appended; BiLD drafted while its top probability reached tau1 and stopped when it did not.
"""

from __future__ import annotations

import math

import pytest

from mtad.decoding import decode
from mtad.models.pair import load_pair
from mtad.settings import Settings

PROMPT = "def add(a, b):\n    "


@pytest.fixture(scope="module")
def embedded():  # noqa: ANN201
    return load_pair("embedded", device="cpu")


def steps(pair, method: str, greedy: bool, **extra) -> list:  # noqa: ANN001
    settings = Settings(method=method, greedy=greedy, max_new_tokens=60, gamma=4, num_drafts=3, seed=3, **extra)
    return list(decode(pair, pair.encode(PROMPT), settings))


@pytest.mark.parametrize("method", ["spectr", "specinfer"])
def test_each_recorded_try_is_the_one_the_rule_decided_on(embedded, method: str) -> None:
    accepted_tries = rejected_tries = draws = 0
    for step in steps(embedded, method, greedy=False, temperature=1.0, top_k=20, top_p=0.9):
        if not step.draft_ids:
            continue
        assert len(step.walk) == step.accepted + (step.accepted < len(step.draft_ids))
        live = list(range(len(step.candidates)))
        for i, t in enumerate(step.walk):
            assert t["tokens"] == [step.candidates[w][i] for w in live]  # the live candidates, in order
            rho = t["rho"] if method == "spectr" else 1.0
            assert 1.0 <= rho <= len(t["tokens"])
            tried = len(t["p"])
            for k in range(tried):
                passes = t["u"][k] * rho * t["q"][k] < t["p"][k]
                assert passes == (t["accepted"] == k), (i, k, t)
                accepted_tries += passes
                rejected_tries += not passes
            if t["accepted"] is None:
                assert tried == len(t["tokens"]) and t["draw"] == step.appended_ids[i]
                assert i == step.accepted
                draws += 1
                # SpecInfer: one residual after each rejection; Spectr: one when none passed
                assert len(t["residuals"]) == (tried if method == "specinfer" else 1)
                for top in t["residuals"]:
                    probs = [pr for _, pr in top]
                    assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-9
            else:
                x = t["tokens"][t["accepted"]]
                assert x == step.appended_ids[i] and tried == t["accepted"] + 1
                live = [w for w in live if step.candidates[w][i] == x]
                if method == "specinfer":
                    assert len(t["residuals"]) == t["accepted"]
        if method == "specinfer":  # the k-th try is judged against the residual left by the (k-1)-th
            for t in step.walk:
                for k, top in enumerate(t["residuals"][: len(t["p"]) - 1]):
                    listed = dict((tok, pr) for tok, pr in top)
                    nxt = t["tokens"][k + 1]
                    if nxt in listed:
                        assert t["p"][k + 1] == pytest.approx(listed[nxt])
    assert accepted_tries and rejected_tries and draws  # every path of the rule ran


@pytest.mark.parametrize("method", ["spectr", "specinfer"])
def test_a_greedy_walk_records_the_candidates_and_no_draws(embedded, method: str) -> None:
    for step in steps(embedded, method, greedy=True):
        for t in step.walk or []:
            assert t["u"] is None and t["rho"] is None and t["residuals"] == []
            assert (t["accepted"] is None) == (t["draw"] is not None)


def test_bild_records_its_top_probability_at_every_check_against_tau1(embedded) -> None:
    tau1 = 0.3
    fallbacks = full = 0
    for step in steps(embedded, "bild", greedy=False, tau1=tau1, tau2=2.0, temperature=1.0, top_k=20, top_p=0.9):
        if step.draft_top_q is None:
            continue
        tops, n = step.draft_top_q, len(step.draft_ids)
        assert all(0 < p <= 1 for p in tops)
        assert all(p >= tau1 for p in tops[:n])  # drafting went on while the top probability reached tau1
        if len(tops) > n:
            assert len(tops) == n + 1 and tops[-1] < tau1  # the check that stopped it
            fallbacks += 1
        else:
            full += 1  # gamma drafts (or the budget's last ones), every check passed
        nll = [-v for v in step.token_log_p]
        assert all(v <= 2.0 for v in nll[: step.accepted])
        assert step.accepted == n or not nll[step.accepted] <= 2.0 or math.isnan(nll[step.accepted])
    assert fallbacks and full
