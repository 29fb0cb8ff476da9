"""The smollm2 draft's trainer, data stage: instructions that never include a benchmark prompt and
keep a resumed producer's place, and sampled replies whose teacher top-K is the target's own
next-token distribution at every reply position (the batched loop drops rows as they end)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from conftest import smollm2_target

from training import chat_draft
from training.chat_draft import chat_prompts, eval_prompts, generate_batch, load_target, topk_targets

# The first 4,320 instructions, which the shipped draft's producer used up; a producer resumes by index.
FIRST_USED = 4320
FIRST_SHA256 = "f4173a7615534abe996614af5c0bbaa2d2f3998e5a44b46dbf07324f7a7d0248"
MAX_NEW = 10
PROMPTS = ["Is water wet? Answer yes or no.", "Explain gravity to a ten-year-old.", "Write a haiku about tea."]
# Generated from the trainer before its instructions moved from inline lists to training/data/ (commit
# 2d878fc, mtad/train_chat_draft.py): the committed draft's card and training.onpolicy's held-out split
# depend on this list, element for element and in order.
ALL_COUNT = 14640
ALL_SHA256 = "f93d31ba3ca40d2763ca5e06d7f2bad1a1912d836df3a64cfa975b4704470c0c"
LISTS_SHA256 = {  # sha256 of each list's json.dumps, same commit
    "TASKS": (20, "eb27a8395f31f32b3cf9556416ffd764142c9e22446779fac33003587e1f6f2a"),
    "TOPICS": (164, "9ab505edc0e1504b849681dbd93225825e9a8ce7bb38ed9de535c3ff7d9a47dd"),
    "CODE_TASKS": (5, "cd487a5b58019de13783eb3f972a8b2d8b3aff1b8cf995beb3e6523ceda5905f"),
    "CODE": (40, "0a3de7a5a235e460633f55b34a48fd2c22e76d8f09d43134c219c5bf81051d6a"),
    "MATH_TASKS": (12, "02d6cadd3b3ff7a17ae2e19027568174b08682a10b8da9b419c0d0c54c6f2844"),
    "REASONING_TASKS": (6, "45f6f4f298fcf733b7cc22fd818cecdab9b9d109d3d51c8c2b6f0c742a6687e7"),
    "MORE_TASKS": (30, "25d38b0c699f0785497aa90ee312e29cd655071dca81f33c89226dd9a89988f8"),
    "MORE_TOPICS": (108, "06ac9ec487d04237d5daa83d2ef06ea55515b8a6fdfc7f46bc022b6100a64173"),
}


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


def test_instructions_read_from_data_files_are_the_inline_lists_they_replaced() -> None:
    """Every template and topic file yields the old list, and the trainer's instructions are the old ones."""
    for name, (count, digest) in LISTS_SHA256.items():
        items = getattr(chat_draft, name)
        assert len(items) == count, name
        assert hashlib.sha256(json.dumps(items).encode()).hexdigest() == digest, name
    prompts = chat_prompts(eval_prompts())
    assert len(prompts) == ALL_COUNT
    assert hashlib.sha256("\n".join(prompts).encode()).hexdigest() == ALL_SHA256


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
