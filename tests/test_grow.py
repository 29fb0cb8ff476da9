"""Growing the shortlist draft by decoder layers (training/onpolicy.py ``grow``, ``train_only``): the grown
draft starts as exactly the committed one, training the new layers alone leaves every committed
parameter bit for bit, and the export loads through the Auto classes with its new layers in int8."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_equal_or_near_tie, full_logits, make_model, make_tokenizer
from transformers import AutoModelForCausalLM

from mtad.decoding import generate, mtad_accept_length
from mtad.models.pair import load
from mtad.models.shortlist_draft import Int8Linear, ShortlistForCausalLM
from mtad.settings import Settings
from training import onpolicy

CHAT = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


@pytest.fixture(scope="module")
def pair3(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A chat tokenizer, a peaked three-layer target and a shortlist draft of its first two layers with
    int8 weights, saved as the trainer finds the committed draft."""
    tok = make_tokenizer("abc", 10)
    tok.chat_template = CHAT
    target = make_model(len(tok), 32, 3, seed=5, init=0.6)
    draft = ShortlistForCausalLM.from_target(target, torch.arange(1, 7), layers=(0, 1)).quantize_layers()
    root = tmp_path_factory.mktemp("grow")
    draft.save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")
    return tok, target, root / "draft"


def labelled(target, tok, draft) -> list[dict]:  # noqa: ANN001
    samples = onpolicy.sample_replies(draft, tok, ["ab", "cab ba", "c", "bb a"], seed=1, max_new=10)
    return onpolicy.label_samples(target, samples)


def test_the_grown_draft_computes_exactly_what_the_committed_one_did(pair3) -> None:
    tok, target, path = pair3
    draft = onpolicy.load_draft(path)
    ids = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 7]])
    before = draft(input_ids=ids).logits
    new = onpolicy.grow(draft, target, 1)
    assert draft.config.num_hidden_layers == 3 and len(draft.model.layers) == 3 and new[0] is draft.model.layers[2]
    assert new[0].self_attn.layer_idx == 2
    torch.testing.assert_close(new[0].self_attn.q_proj.weight, target.model.layers[2].self_attn.q_proj.weight)
    torch.testing.assert_close(new[0].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)
    assert not new[0].self_attn.o_proj.weight.any() and not new[0].mlp.down_proj.weight.any()
    assert torch.equal(draft(input_ids=ids).logits, before)  # bit for bit
    # with a KV cache too (the decoders' path): one token after a prefix
    out = draft(input_ids=ids[:, :-1], use_cache=True)
    step = draft(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits
    assert len(out.past_key_values.layers) == 3
    torch.testing.assert_close(step[0, -1], before[0, -1])
    held = labelled(target, tok, draft)
    committed = onpolicy.evaluate(onpolicy.load_draft(path), held)
    assert onpolicy.evaluate(draft, held) == committed


def test_training_the_new_layers_only_leaves_the_committed_parameters_bit_for_bit(pair3) -> None:
    tok, target, path = pair3
    draft = onpolicy.load_draft(path)
    new = onpolicy.grow(draft, target, 1)
    params = onpolicy.train_only(draft, new)
    assert {id(p) for p in params} == {id(p) for p in new[0].parameters()}
    old = {k: v.detach().clone() for k, v in draft.named_parameters() if not k.startswith("model.layers.2.")}
    fresh = {k: v.detach().clone() for k, v in new[0].named_parameters()}
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.98))
    samples = labelled(target, tok, draft)
    for _ in range(2):  # the first step moves the zeroed projections, the second the rest of the layer
        loss = onpolicy.loss_of(onpolicy.batch_terms(draft, samples), kl_weight=1.0, tv_weight=0.3)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    now = dict(draft.named_parameters())
    assert all(torch.equal(now[k], v) for k, v in old.items())
    for k, v in new[0].named_parameters():
        assert not torch.equal(v, fresh[k]), k
    assert all(p.grad is None for k, p in now.items() if k in old)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_grown_export_loads_with_auto_classes_int8_and_keeps_rules_exact(pair3, tmp_path, dtype) -> None:
    """Greedy SD and MTAD equal greedy AR on the exported draft: token for token in fp32; in bf16, where a
    verification's products round other than AR's, up to a near tie of the target's logits."""
    tok, target, path = pair3
    draft = onpolicy.load_draft(path)
    onpolicy.grow(draft, target, 1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a trained new layer
        draft.model.layers[2].self_attn.o_proj.weight.normal_(0, 0.05, generator=gen)
        draft.model.layers[2].mlp.down_proj.weight.normal_(0, 0.05, generator=gen)
    onpolicy.save_draft(draft, tok, tmp_path / "draft")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "draft", dtype=torch.float32)
    assert type(loaded) is ShortlistForCausalLM and loaded.config.num_hidden_layers == 3 and loaded.config.int8_layers
    assert len(loaded.model.layers) == 3
    assert all(
        type(m) is Int8Linear for m in loaded.model.layers[2].modules() if isinstance(m, (Int8Linear, torch.nn.Linear))
    )
    trained = draft.model.layers[2].mlp.down_proj.weight.detach()
    kept = loaded.model.layers[2].mlp.down_proj
    step = trained.to(torch.bfloat16).float().abs().amax(1, keepdim=True) / 127  # bf16, then int8 per row
    assert ((kept.dequantize() - trained).abs() <= step * 0.51 + trained.abs() * 2**-8).all()
    ids = [1, 2, 3, 4]
    logits = full_logits(loaded, ids)
    off = [t for t in range(len(tok)) if t not in set(loaded.columns.tolist())]
    assert off and torch.isinf(logits[off]).all() and torch.isfinite(logits[loaded.columns]).all()
    ref = full_logits(draft.eval(), ids)[loaded.columns]  # the trained fp32 draft, within int8/bf16 rounding
    assert (logits[loaded.columns] - ref).abs().max() < 0.1 * ref.abs().max()
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    pair = load(str(tmp_path / "draft"), str(tmp_path / "target"), device="cpu", dtype=dtype)
    assert pair.draft.config.num_hidden_layers == 3 and pair.draft.config.int8_layers
    ar_run = generate(pair, "abca", Settings(method="ar", greedy=True, max_new_tokens=16), raw=True)
    sd = generate(pair, "abca", Settings(method="sd", greedy=True, max_new_tokens=16), raw=True)
    assert sum(s.accepted for s in sd.steps) > 0  # drafts were kept, not only the target's tokens
    if dtype == "float32":
        assert sd.new_ids == ar_run.new_ids
    else:
        assert_equal_or_near_tie(pair.target, ar_run.prompt_ids, ar_run.new_ids, sd.new_ids, tol=0.06)
    mtad = generate(pair, "abca", Settings(method="mtad", greedy=True, max_new_tokens=16), raw=True)
    for step in mtad.steps:  # MTAD is not AR: each step keeps what its rule, recomputed on the host, keeps
        assert step.accepted == mtad_accept_length(step.log_p, step.log_q, mtad.settings["tau"])
    assert any(step.accepted for step in mtad.steps)
