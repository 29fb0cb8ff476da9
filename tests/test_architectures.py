"""The engine on the preset families' architectures (OPT, Qwen2), built tiny and random offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import cached_next_logits, full_logits, make_tokenizer, save_pair
from transformers import OPTConfig, OPTForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mtad.decoding import generate
from mtad.decoding.mtad import MTAD
from mtad.decoding.state import DecodeState
from mtad.models.pair import load
from mtad.settings import Settings


def opt(vocab: int, hidden: int, layers: int, seed: int) -> OPTForCausalLM:
    torch.manual_seed(seed)
    cfg = OPTConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        ffn_dim=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=hidden,
        init_std=0.2,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    return OPTForCausalLM(cfg).eval()


def qwen(vocab: int, hidden: int, layers: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=["opt", "qwen2"])
def arch_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tok = make_tokenizer("abcdefgh ", 64)
    build = {"opt": opt, "qwen2": qwen}[request.param]
    # transformers loads a qwen2 directory with Qwen2Tokenizer, which adds <|endoftext|>: one more row
    vocab = len(tok) + (request.param == "qwen2")
    root: Path = tmp_path_factory.mktemp(request.param)
    return load(*save_pair(root, tok, build(vocab, 32, 1, 1), build(vocab, 64, 2, 2)), device="cpu")


def test_greedy_sd_equals_transformers(arch_pair) -> None:
    ids = arch_pair.encode("abc def")
    ar = generate(arch_pair, "abc def", Settings(method="ar", greedy=True, max_new_tokens=30)).new_ids
    sd = generate(arch_pair, "abc def", Settings(method="sd", greedy=True, gamma=3, max_new_tokens=30)).new_ids
    hf = arch_pair.target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=30, pad_token_id=0)
    assert sd == ar == hf[0, len(ids) :].tolist()


def test_cache_matches_recompute_with_beams(arch_pair) -> None:
    s = Settings(method="mtad", gamma=4, beams=4, tau=0.3, max_new_tokens=40, seed=2)
    st = DecodeState.start(arch_pair, arch_pair.encode("abc def"), s)
    for _ in range(4):
        MTAD(st)
        for lm, model in ((st.target, arch_pair.target), (st.draft, arch_pair.draft)):
            torch.testing.assert_close(cached_next_logits(lm, st.ids), full_logits(model, st.ids), rtol=1e-4, atol=1e-4)


def test_padded_output_layers_share_the_tokenizer(tmp_path: Path) -> None:
    """Like Qwen2.5 0.5B (151936 rows) and 7B (152064): same tokenizer, different padding."""
    from conftest import make_model

    tok = make_tokenizer("abcdefgh ", 64)
    pair = load(
        *save_pair(tmp_path, tok, make_model(len(tok), 32, 1, 1), make_model(len(tok) + 8, 64, 2, 2)), device="cpu"
    )
    assert pair.vocab_size == len(tok)
    for method in ("ar", "sd", "mtad"):
        run = generate(pair, "abc", Settings(method=method, max_new_tokens=20, seed=1))
        assert len(run.new_ids) > 0 and max(run.new_ids) < len(tok)
        # the padding rows are no tokens: probabilities are normalised over the tokenizer's vocabulary
        ids = run.prompt_ids + run.new_ids
        with torch.inference_mode():
            logits = pair.target(input_ids=torch.tensor([ids])).logits[0, :, : len(tok)].float()
        want = torch.log_softmax(logits[len(run.prompt_ids) - 1 : -1], -1).gather(1, torch.tensor(run.new_ids)[:, None])
        got = [lp for step in run.steps for lp in step.target_logprobs]
        torch.testing.assert_close(torch.tensor(got), want[:, 0], rtol=0, atol=1e-4)
