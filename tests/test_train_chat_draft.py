"""The smollm2 draft's trainer, data stage: instructions that never include a benchmark prompt and
keep a resumed producer's place, and sampled replies whose teacher top-K is the target's own
next-token distribution at every reply position (the batched loop drops rows as they end)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from conftest import smollm2_target

from mtad.train_chat_draft import chat_prompts, eval_prompts, generate_batch, load_target, topk_targets

# The first 4,320 instructions, which the shipped draft's producer used up; a producer resumes by index.
FIRST_USED = 4320
FIRST_SHA256 = "f4173a7615534abe996614af5c0bbaa2d2f3998e5a44b46dbf07324f7a7d0248"
MAX_NEW = 10
PROMPTS = ["Is water wet? Answer yes or no.", "Explain gravity to a ten-year-old.", "Write a haiku about tea."]


def test_instructions_never_include_a_benchmark_prompt() -> None:
    benchmark = eval_prompts()
    assert len(benchmark) == 37
    prompts = chat_prompts(benchmark)
    assert not set(prompts) & benchmark
    assert len(prompts) > 3 * FIRST_USED


def test_instructions_keep_a_resumed_producers_place() -> None:
    """New instructions are appended: those already used stay first, in their order, and none repeats."""
    prompts = chat_prompts(set())
    assert hashlib.sha256("\n".join(prompts[:FIRST_USED]).encode()).hexdigest() == FIRST_SHA256
    later = prompts[FIRST_USED:]
    assert len(set(later)) == len(later)
    assert not set(later) & set(prompts[:FIRST_USED])


@pytest.fixture(scope="module")
def target_fp32() -> tuple[object, object]:
    """The trainer's teacher in fp32, where a batched forward equals a lone one."""
    smollm2_target()
    return load_target(torch.float32)


@torch.inference_mode()
def test_replies_carry_the_targets_top_k_at_every_position(target_fp32: tuple) -> None:
    model, tok = target_fp32
    samples = generate_batch(model, tok, PROMPTS, seed=3, max_new=MAX_NEW)
    assert len(samples) == len(PROMPTS)
    for sample, prompt in zip(samples, PROMPTS, strict=True):
        ids, start, n = sample["ids"].long(), sample["start"], len(sample["idx"])
        assert len(ids) == start + 1 + n
        context = tok.decode(ids[: start + 1])
        assert prompt in context and context.endswith("<|im_start|>assistant\n")
        reply = ids[start + 1 :]
        assert tok.eos_token_id not in reply[:-1].tolist()
        assert reply[-1] == tok.eos_token_id or n == MAX_NEW
        idx, lp = topk_targets(model(input_ids=ids[None]).logits[0, start : start + n])
        assert torch.equal(idx[:, :5], sample["idx"][:, :5].long())
        assert torch.allclose(lp.float(), sample["lp"].float(), atol=2e-2)  # one fp16 step at |lp| < 16
        # top-k 20 comes first in the warping: every drawn token is among the target's 20 likeliest there
        assert all(int(t) in sample["idx"][i, :20].tolist() for i, t in enumerate(reply))
    lengths = [len(s["idx"]) for s in samples]
    assert min(lengths) < MAX_NEW == max(lengths), "one reply ends early and the others go on"
    again = generate_batch(model, tok, PROMPTS, seed=3, max_new=MAX_NEW)
    assert all(torch.equal(a["ids"], b["ids"]) for a, b in zip(samples, again, strict=True))
    other = generate_batch(model, tok, PROMPTS, seed=4, max_new=MAX_NEW)
    assert any(not torch.equal(a["ids"], b["ids"]) for a, b in zip(samples, other, strict=True))
