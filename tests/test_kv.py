"""The one owner of the KV cache: after any sequence of the operations decoding uses, the next-token
logits read from the cache equal a cache-free recompute of the text it should hold."""

from __future__ import annotations

import random

import torch
from conftest import full_logits

from mtad.decoding.kv import CachedLM


def test_random_feeds_and_rollbacks_leave_the_cache_equal_to_a_recompute(tiny_pair) -> None:
    """Accept some tokens, roll back others, as speculative decoding does, 30 times at random."""
    rng = random.Random(0)
    lm = CachedLM(tiny_pair.target, tiny_pair.vocab_size)
    text = tiny_pair.encode("abc de")
    lm.feed(torch.tensor([text]))
    rolled = 0
    for _ in range(30):
        new = [rng.randrange(tiny_pair.vocab_size) for _ in range(rng.randint(1, 5))]
        logits = lm.feed(torch.tensor([new]), keep=len(new))[0]
        torch.testing.assert_close(logits[-1], full_logits(tiny_pair.target, text + new), rtol=1e-4, atol=1e-4)
        kept = rng.randint(0, len(new))
        lm.rollback(len(text) + kept)
        rolled += len(new) - kept
        text = text + new[:kept]
        assert lm.length == len(text)
    assert rolled > 0
    lm.feed(torch.tensor([[text[-1]]]))  # one token too many, then back past it and the last real one
    lm.rollback(len(text) - 1)
    last = lm.feed(torch.tensor([[text[-1]]]))[0, -1]
    torch.testing.assert_close(last, full_logits(tiny_pair.target, text), rtol=1e-4, atol=1e-4)


def test_fan_out_reorder_and_keep_a_row(tiny_pair) -> None:
    """Three rows from one, each extended differently, reordered as a beam search does, then one kept:
    every row's logits equal its own text's recompute at every stage."""
    lm = CachedLM(tiny_pair.target, tiny_pair.vocab_size)
    ctx = tiny_pair.encode("abc de")
    lm.feed(torch.tensor([ctx]))
    lm.cache.fan_out(3)
    assert lm.cache.rows == 3
    ext = [[5, 6], [7, 8], [9, 10]]
    out = lm.feed(torch.tensor(ext), keep=1)[:, -1]
    for row, e in enumerate(ext):
        torch.testing.assert_close(out[row], full_logits(tiny_pair.target, ctx + e), rtol=1e-4, atol=1e-4)
    parent = torch.tensor([2, 2, 0])
    lm.cache.reorder(parent)
    texts = [ctx + ext[p] for p in parent.tolist()]
    nxt = [[11], [12], [13]]
    out = lm.feed(torch.tensor(nxt), keep=1)[:, -1]
    for row, (t, n) in enumerate(zip(texts, nxt, strict=True)):
        torch.testing.assert_close(out[row], full_logits(tiny_pair.target, t + n), rtol=1e-4, atol=1e-4)
    lm.cache.keep_row(1)
    assert lm.cache.rows == 1 and lm.length == len(ctx) + 3
    out = lm.feed(torch.tensor([[14]]))[0, -1]
    torch.testing.assert_close(out, full_logits(tiny_pair.target, texts[1] + nxt[1] + [14]), rtol=1e-4, atol=1e-4)


def test_keep_positions_keeps_a_path(tiny_pair) -> None:
    """Feeding a, b, c, d then keeping the context with b and d is the cache of context + b + d only when
    positions agree: here b and d are fed at the positions they keep (a token tree's nodes are)."""
    lm = CachedLM(tiny_pair.target, tiny_pair.vocab_size)
    ctx = tiny_pair.encode("abc")
    lm.feed(torch.tensor([ctx + [5, 6]]))
    lm.cache.keep_positions(list(range(len(ctx))) + [len(ctx), len(ctx) + 1])
    assert lm.length == len(ctx) + 2
    assert len(lm.cache.tensors()) == 2 * tiny_pair.target.config.num_hidden_layers
    lm.cache.keep_positions(list(range(len(ctx) + 1)))
    out = lm.feed(torch.tensor([[7]]))[0, -1]
    torch.testing.assert_close(out, full_logits(tiny_pair.target, ctx + [5, 7]), rtol=1e-4, atol=1e-4)
