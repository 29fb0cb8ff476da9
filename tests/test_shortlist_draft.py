"""The shortlist draft (mtad.models.shortlist_draft): a Llama whose head covers only some tokens, q = 0 elsewhere.

It must load through the pair's own ``from_pretrained`` (no remote code), build exactly from a
target's layers, keep KV-cached logits equal to a recompute, and leave every decoder exact: the
tokens it can never propose still come out of speculative sampling at the target's rate (the
residual carries them), and greedy speculative decoders still equal greedy AR.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_model, make_tokenizer, needs_onednn_bf16, save_pair
from test_sd_distribution import ALPHA, RUNS, exact_first_two, gof_pvalue, sampled_first_two
from torch.nn import functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from mtad.decoding import generate
from mtad.decoding.draft_distributions import DraftDistributions
from mtad.models.pair import ModelPair, load
from mtad.models.shortlist_draft import Int8Linear, ShortlistForCausalLM, int8_kernel_input
from mtad.sampling import log_probs
from mtad.settings import Settings

SD = Settings(method="sd", gamma=2, max_new_tokens=3, temperature=1.3, top_k=5, top_p=0.99)


def shortlist_of(target: LlamaForCausalLM, k: int) -> torch.Tensor:
    """Token ids 1..k, most frequent first (any distinct ids will do; EOS 0 is left off)."""
    return torch.arange(1, k + 1)


@pytest.fixture(scope="module")
def micro_shortlist_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The micro pair's 10-token target, and a draft of its one layer with 6 of the 10 tokens."""
    tok = make_tokenizer("abc", 10)
    target = make_model(len(tok), 32, 1, seed=4, init=0.6)
    draft = ShortlistForCausalLM.from_target(target, shortlist_of(target, 6), layers=(0,))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # not the target itself: drafts must be rejected too
        for p in draft.model.layers.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std())
    return save_pair(tmp_path_factory.mktemp("shortlist"), tok, draft, target)


@pytest.fixture(scope="module")
def micro_shortlist_pair(micro_shortlist_dirs: tuple[str, str]) -> ModelPair:
    return load(*micro_shortlist_dirs, device="cpu")


def test_loads_through_the_pair_without_remote_code(micro_shortlist_pair: ModelPair) -> None:
    assert isinstance(micro_shortlist_pair.draft, ShortlistForCausalLM)
    assert micro_shortlist_pair.draft.config.model_type == "mtad_shortlist"
    tokens = micro_shortlist_pair.draft.model.embed_tokens.tokens
    assert tokens.tolist() == list(range(1, 7)), "the shortlist buffer was not saved and loaded"


def test_logits_are_minus_infinity_off_the_shortlist(micro_shortlist_pair: ModelPair) -> None:
    draft = micro_shortlist_pair.draft
    ids = torch.tensor([[1, 2, 3, 8, 9, 2]])  # 8 and 9 are off the list: they read the rare row
    with torch.inference_mode():
        logits = draft(input_ids=ids).logits[0]
    on = torch.zeros(logits.shape[-1], dtype=torch.bool)
    on[1:7] = True
    assert torch.isfinite(logits[:, on]).all()
    assert torch.isneginf(logits[:, ~on]).all()
    q = log_probs(logits[-1], SD).exp()
    assert q[~on].eq(0).all() and q.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_from_target_with_every_layer_and_token_is_the_target() -> None:
    """With all layers and all tokens (and a tied target), the draft computes the target exactly."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.3,
    )  # fmt: skip
    target = LlamaForCausalLM(cfg).eval()
    order = torch.randperm(24)
    draft = ShortlistForCausalLM.from_target(target, order, layers=(0, 1)).eval()
    ids = torch.randint(0, 24, (2, 9))
    with torch.inference_mode():
        torch.testing.assert_close(draft(input_ids=ids).logits, target(input_ids=ids).logits)
        one = ShortlistForCausalLM.from_target(target, order, layers=(1,)).eval()
        assert not torch.allclose(one(input_ids=ids).logits, target(input_ids=ids).logits)


def test_cached_logits_equal_a_full_recompute(micro_shortlist_pair: ModelPair) -> None:
    draft = micro_shortlist_pair.draft
    ids = torch.tensor([[1, 2, 9, 3, 4, 8, 5, 6, 2, 1]])
    with torch.inference_mode():
        full = draft(input_ids=ids).logits
        cache = DynamicCache(config=draft.config)
        parts = [
            draft(input_ids=ids[:, a:b], past_key_values=cache, use_cache=True).logits
            for a, b in ((0, 4), (4, 5), (5, 10))
        ]
    cached = torch.cat(parts, dim=1)
    finite = torch.isfinite(full)
    assert torch.equal(finite, torch.isfinite(cached))
    torch.testing.assert_close(cached[finite], full[finite], atol=1e-5, rtol=1e-5)


def test_sd_with_a_shortlist_draft_matches_the_target_distribution(micro_shortlist_pair: ModelPair) -> None:
    """Tokens the draft never proposes (q = 0) must still come out at the target's rate."""
    pair = micro_shortlist_pair
    ids = pair.encode("abcab")
    exact = exact_first_two(pair, ids, SD)
    off = {7, 8, 9}
    assert sum(v for k, v in exact.items() if k[0] in off) > 0.05, "the target must put mass off the shortlist"
    counts = sampled_first_two(pair, ids, SD)
    assert sum(v for k, v in counts.items() if k[0] in off) >= RUNS // 40
    assert gof_pvalue(counts, exact) > ALPHA


@pytest.mark.parametrize("method", ["sd", "mtad", "spectr", "specinfer", "bild", "mtad-tree", "hf-assisted"])
def test_greedy_with_a_shortlist_draft_equals_greedy_ar(micro_shortlist_pair: ModelPair, method: str) -> None:
    pair = micro_shortlist_pair
    base = Settings(max_new_tokens=24, temperature=0.0, gamma=3, beams=4, tau=1.0, tau2=0.0, num_drafts=2)
    ar = generate(pair, "abcab", base.with_(method="ar"), raw=True)
    out = generate(pair, "abcab", base.with_(method=method), raw=True)
    assert out.new_ids == ar.new_ids


def test_a_shortlist_draft_is_refused_when_it_names_a_token_twice(tmp_path: Path) -> None:
    target = make_model(10, 16, 1, seed=1)
    with pytest.raises(ValueError, match="distinct"):
        ShortlistForCausalLM.from_target(target, torch.tensor([1, 2, 2]), layers=(0,))


@pytest.mark.parametrize("method", ["sd", "mtad"])
@pytest.mark.parametrize("greedy", [True, False])
def test_column_drafting_keeps_one_host_read_per_iteration(
    monkeypatch: pytest.MonkeyPatch, micro_shortlist_pair: ModelPair, method: str, greedy: bool
) -> None:
    """Drafting over the shortlist's columns maps indices to ids on the device: no extra host read."""
    from collections import Counter

    from test_syncs import host_reads

    from mtad.decoding import DECODERS
    from mtad.decoding.state import DecodeState

    pair = micro_shortlist_pair
    settings = Settings(method=method, greedy=greedy, max_new_tokens=40, gamma=3, beams=3, tau=0.1, seed=1)
    st = DecodeState.start(pair, pair.encode("abcab"), settings)
    assert st.draft.columns is not None
    for _ in range(4):
        with host_reads(monkeypatch) as counts:
            step = DECODERS[method].step(st)
        assert counts == Counter(tolist=1), (step.index, counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_applies_its_dequantised_matrix(dtype: torch.dtype) -> None:
    """PyTorch's int8 kernel computes x @ (qweight * scale).T, and the rounding error of a weight is at
    most half its row's step."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=False)
    layer = Int8Linear.quantize(linear)
    err = (layer.dequantize() - linear.weight).abs()
    assert (err <= layer.scale[:, None] / 2 + 1e-7).all()
    for shape in [(2, 80, 96), (1, 1, 96)]:  # dense product; one row: the int8 kernel where the CPU has it
        x = torch.randn(shape).to(dtype)
        kernel = shape[0] * shape[1] == 1 and int8_kernel_input(dtype) is not None  # bf16 input, bf16 out
        tol = 3e-2 if dtype == torch.bfloat16 or kernel else 1e-5
        torch.testing.assert_close(layer(x), F.linear(x, layer.dequantize(dtype)), rtol=tol, atol=tol)
    dense = layer.dense(dtype)
    assert layer.dense(dtype) is dense  # kept, not remade every forward
    with torch.no_grad():
        layer.scale.mul_(2)
    torch.testing.assert_close(layer.dense(dtype), 2 * dense, rtol=1e-2, atol=0)  # remade when weights change
    with pytest.raises(ValueError, match="no bias"):
        Int8Linear.quantize(torch.nn.Linear(4, 4))


def test_one_row_enters_the_int8_kernel_as_measured_for_its_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 as it is; fp32 rounded to bf16 where PyTorch runs AVX2 or AVX-512 code (its int8 kernel is
    vectorised for bf16 input); elsewhere, and fp16, the dequantised product."""
    from mtad.models import shortlist_draft

    for capability, fp32 in (("AVX2", torch.bfloat16), ("AVX512", torch.bfloat16), ("DEFAULT", None)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        shortlist_draft.int8_kernel_input.cache_clear()
        got = [int8_kernel_input(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
        assert got == [fp32, torch.bfloat16, None], capability
    monkeypatch.undo()
    shortlist_draft.int8_kernel_input.cache_clear()  # this CPU's own answer again
    layer = Int8Linear.from_weight(torch.randn(40, 96))
    x = torch.randn(1, 96)
    ran = []
    real = torch.ops.aten._weight_int8pack_mm

    def spy(a: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        ran.append(a.dtype)
        return real(a, *rest)

    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", spy)
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.float32
    assert ran == ([int8_kernel_input(torch.float32)] if int8_kernel_input(torch.float32) else [])


@pytest.fixture(scope="module")
def micro_int8_pair(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    """The micro shortlist draft with int8 layers, saved and loaded back (weights mapped from the file)."""
    tok = make_tokenizer("abc", 10)
    target = make_model(len(tok), 32, 1, seed=4, init=0.6)
    draft = ShortlistForCausalLM.from_target(target, shortlist_of(target, 6), layers=(0,)).quantize_layers()
    return load(*save_pair(tmp_path_factory.mktemp("int8"), tok, draft, target), device="cpu")


def test_int8_layers_survive_saving_and_loading(micro_int8_pair: ModelPair, tmp_path: Path) -> None:
    draft = micro_int8_pair.draft
    assert draft.config.int8_layers
    # the int8 matrices are buffers, but still the model's weights: the page and the bench count them
    unquantised = ShortlistForCausalLM.from_target(micro_int8_pair.target, draft.model.embed_tokens.tokens, layers=(0,))
    assert micro_int8_pair.parameters()[0] == sum(p.numel() for p in unquantised.parameters())
    layers = [m for m in draft.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 7 and not any(isinstance(m, torch.nn.Linear) for m in draft.model.layers.modules())
    ids = torch.randint(0, 10, (3, 80))
    with torch.inference_mode():
        before = draft(input_ids=ids).logits
    draft.save_pretrained(tmp_path)
    again = ShortlistForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert again.model.layers[0].mlp.down_proj.qweight.dtype == torch.int8
    with torch.inference_mode():
        torch.testing.assert_close(again(input_ids=ids).logits, before)


def test_an_int8_draft_runs_an_int8_head_and_trains_the_rows(micro_int8_pair: ModelPair) -> None:
    """Running, an int8 draft's head is its shortlist rows quantised like its layers; training, the rows."""
    draft = micro_int8_pair.draft
    ids = torch.randint(0, 10, (2, 7))
    rows = draft.model.embed_tokens.weight[: draft.config.shortlist_size]
    scale = rows.detach().abs().amax(dim=1) / 127
    head = (rows.detach() / scale[:, None]).round() * scale[:, None]
    with torch.inference_mode():
        hidden = draft.model(input_ids=ids).last_hidden_state
        torch.testing.assert_close(draft(input_ids=ids, shortlist_only=True).logits, F.linear(hidden, head))
        assert not torch.allclose(F.linear(hidden, head), F.linear(hidden, rows))
    hidden = hidden.clone().requires_grad_()
    torch.testing.assert_close(draft.shortlist_logits(hidden), F.linear(hidden, rows))


def test_an_int8_draft_keeps_caches_and_greedy_exact(
    monkeypatch: pytest.MonkeyPatch, micro_int8_pair: ModelPair
) -> None:
    """Greedy SD and MTAD write greedy AR's text; a cached one-row forward equals a full recompute: exactly
    with the dequantised products, within bf16 rounding where its row enters the int8 kernel as bf16."""
    from mtad.models import shortlist_draft

    ids = micro_int8_pair.encode("abcab")
    for method in ("sd", "mtad"):
        s = Settings(method=method, greedy=True, tau=1.0 if method == "mtad" else 0.1, max_new_tokens=24)
        ar = generate(micro_int8_pair, "abcab", Settings(method="ar", greedy=True, max_new_tokens=24))
        assert generate(micro_int8_pair, "abcab", s).new_ids == ar.new_ids
    st_draft = micro_int8_pair.draft

    def cached_and_full() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            cache = DynamicCache(config=st_draft.config)
            st_draft(input_ids=torch.tensor([ids[:-1]]), past_key_values=cache, use_cache=True)
            cached = st_draft(input_ids=torch.tensor([ids[-1:]]), past_key_values=cache, use_cache=True)
            return cached.logits[0, -1], st_draft(input_ids=torch.tensor([ids])).logits[0, -1]

    rounded = int8_kernel_input(torch.float32) is not None
    torch.testing.assert_close(*cached_and_full(), rtol=3e-2 if rounded else 1e-4, atol=3e-2 if rounded else 1e-4)
    monkeypatch.setattr(shortlist_draft, "int8_kernel_input", lambda dtype: None)  # the dequantised products
    torch.testing.assert_close(*cached_and_full(), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs PyTorch built with oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_onednn_bf16)])
def test_int8_layers_multiply_with_the_kernel_chosen_for_the_model(dtype: torch.dtype) -> None:
    """Under oneDNN an int8 layer's several-row product multiplies the prepacked dequantised matrix: the
    same product as the plain one, and the kernel choice probes that matrix's shape."""
    from mtad.models.kernels import probe_weights, use_linear_kernel

    gen = torch.Generator().manual_seed(1)
    layer = Int8Linear.from_weight(torch.randn(80, 96, generator=gen))
    model = torch.nn.Sequential(layer, torch.nn.Linear(80, 8)).to(dtype)
    x = torch.randn(3, 96, generator=gen).to(dtype)
    with torch.inference_mode():
        want = layer(x)
        use_linear_kernel(model, "onednn")
        assert layer.kernel == "onednn"
        got = layer(x)
    assert "onednn" in {name for name, _ in layer._kept.items()}
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert {tuple(w.shape) for w in probe_weights(model)} == {(80, 96), (8, 80)}
    use_linear_kernel(model, "mkl")
    assert layer.kernel == "stationary"


def test_an_int8_layer_deep_copies_after_keeping_a_packed_product() -> None:
    import copy

    layer = Int8Linear.from_weight(torch.randn(80, 96))
    layer.kernel = "onednn" if torch.backends.mkldnn.is_available() else "stationary"
    x = torch.randn(3, 96)
    with torch.inference_mode():
        want = layer(x)  # keeps its dense (and, under oneDNN, packed) product
        twin = copy.deepcopy(layer)
        assert twin.qweight is not layer.qweight and torch.equal(twin.qweight, layer.qweight)
        assert twin.kernel == layer.kernel and not twin._kept
        torch.testing.assert_close(twin(x), want)


@pytest.mark.parametrize("method", ["sd", "spectr", "specinfer"])
def test_draft_distributions_kept_as_lists_write_what_whole_rows_write(
    micro_shortlist_pair: ModelPair, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU the draft's distributions are kept as their top-k lists over the shortlist's columns (token ids
    mapped from columns): the same texts and the same log q in every step as whole rows over the vocabulary
    (a GPU's path)."""
    pair = micro_shortlist_pair
    s = SD.with_(method=method, max_new_tokens=30, num_drafts=2, seed=3)
    kept = []
    of_steps = DraftDistributions.of_steps.__func__
    monkeypatch.setattr(DraftDistributions, "of_steps", classmethod(lambda *a: kept.append(of_steps(*a)) or kept[-1]))
    runs = []
    for lists in (True, False):
        with monkeypatch.context() as m:
            if not lists:
                m.setattr("mtad.sampling._none_on_cpu", lambda t: False)
            run = generate(pair, "abcab", s, raw=True)
        runs.append((run.new_ids, [step.log_q for step in run.steps]))
    listed = [distributions.listed for distributions in kept]
    assert any(listed) and not all(listed)  # lists in the first run, whole rows in the second
    assert runs[0] == runs[1]
