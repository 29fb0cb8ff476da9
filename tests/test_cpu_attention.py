"""Grouped-query attention left to the CPU kernel: the same values as transformers' sdpa."""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from mtad.models.cpu_attention import NAME, use_cpu_gqa_attention
from mtad.models.pair import load


def _gqa_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


def _prefill_then_verify(model: LlamaForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        first = model(input_ids=ids[:, :20], past_key_values=cache, use_cache=True).logits
        verify = model(input_ids=ids[:, 20:], past_key_values=cache, use_cache=True).logits  # masked: 5 after 20
    return first, verify


def test_masked_grouped_attention_gives_transformers_values() -> None:
    model = _gqa_llama()
    ids = torch.randint(0, 97, (1, 25), generator=torch.Generator().manual_seed(1))
    want = _prefill_then_verify(model, ids)
    assert use_cpu_gqa_attention(model) and model.config._attn_implementation == NAME
    got = _prefill_then_verify(model, ids)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert not use_cpu_gqa_attention(model)  # already switched; eager models are left alone too


def test_cpu_pairs_use_it(tiny_dirs: tuple[str, str]) -> None:
    pair = load(*tiny_dirs, device="cpu", dtype="float32")
    assert pair.target.config._attn_implementation == NAME
