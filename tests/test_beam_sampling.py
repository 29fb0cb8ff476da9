"""Stochastic beam drafting (Gumbel-top-k) samples without replacement from the warped draft distribution."""

from __future__ import annotations

from collections import Counter

import torch
from test_sd_distribution import ALPHA, gof_pvalue

from mtad.decoding.mtad import beam_draft
from mtad.decoding.state import DecodeState
from mtad.models.pair import ModelPair
from mtad.sampling import log_probs
from mtad.settings import Settings

SETTINGS = Settings(method="mtad", beams=2, gamma=1, draft_mode="beam-sample", temperature=1.3, top_k=5, top_p=0.99)


def test_two_beams_are_two_draws_without_replacement(micro_pair: ModelPair) -> None:
    """From one context, W = 2 beams of one token are (a, b) with P = q(a) q(b) / (1 - q(a)), in that
    order, where q is the draft's warped distribution; and the beams' scores are their tokens' log q."""
    ids = micro_pair.encode("abcab")
    with torch.inference_mode():
        q = log_probs(micro_pair.draft(input_ids=torch.tensor([ids])).logits[0, -1], SETTINGS).exp()
    support = torch.nonzero(q).flatten().tolist()
    exact = {(a, b): float(q[a] * q[b] / (1 - q[a])) for a in support for b in support if a != b}
    assert len(exact) >= 12 and abs(sum(exact.values()) - 1) < 1e-5
    counts = Counter()
    for seed in range(1500):
        st = DecodeState.start(micro_pair, ids, SETTINGS.with_(seed=seed))
        beams = beam_draft(st, 1)
        pair = tuple(beams.tokens[:, 0].tolist())
        counts[pair] += 1
        if seed < 20:
            torch.testing.assert_close(beams.scores, q[beams.tokens[:, 0]].log(), rtol=1e-5, atol=1e-5)
            assert int(beams.best) == int(beams.scores.argmax())  # best by joint log q, not by draw order
    assert gof_pvalue(counts, exact) > ALPHA
