"""The fused top-k/top-p warp must match transformers' own warpers exactly."""

import pytest
import torch

from mtad.sampling import log_probs, make_generator, pick, warp, warper
from mtad.settings import Settings


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 20, 0.9), (0.7, 5, 0.5), (1.3, 50, 0.99), (1.0, 3, 1.0), (2.0, 1, 0.3), (1.0, 0, 0.9), (0.5, 0, 1.0)],
)
def test_warp_equals_transformers(temperature: float, top_k: int, top_p: float) -> None:
    s = Settings(temperature=temperature, top_k=top_k, top_p=top_p)
    g = torch.Generator().manual_seed(0)
    for scale in (0.5, 3.0, 10.0):  # flat to very peaked distributions
        logits = torch.randn(64, 300, generator=g) * scale
        ours = warp(logits.clone(), s)
        theirs = warper(s)(None, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), (scale, top_k, top_p)
        torch.testing.assert_close(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


def test_top_p_boundary_with_exact_ties() -> None:
    """Four equal survivors (probability 1/4 each, exact in floating point) and top-p 0.5: the mass
    ranked above the third is exactly 0.5, so it is dropped, as transformers drops it; two stay."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, -10.0]])
    s = Settings(top_k=4, top_p=0.5)
    assert int(torch.isfinite(warp(logits.clone(), s)).sum()) == 2
    assert int(torch.isfinite(warper(s)(None, logits.clone())).sum()) == 2


def test_greedy_is_plain_softmax_and_argmax() -> None:
    logits = torch.randn(4, 50)
    s = Settings(greedy=True)
    torch.testing.assert_close(log_probs(logits, s), torch.log_softmax(logits, -1))
    assert torch.equal(pick(log_probs(logits, s), s, None), logits.argmax(-1))
    # one row of logits, as the decoders pass it: one token
    assert int(pick(log_probs(logits[1], s), s, None)) == int(logits[1].argmax())


def test_sampling_respects_the_warp_and_the_seed() -> None:
    s = Settings(top_k=3, top_p=1.0)
    logits = torch.randn(1, 40).repeat(500, 1)
    lp = log_probs(logits, s)
    draws = pick(lp, s, make_generator("cpu", 7))
    assert set(draws.tolist()) <= set(logits[0].topk(3).indices.tolist())
    assert torch.equal(draws, pick(lp, s, make_generator("cpu", 7)))
