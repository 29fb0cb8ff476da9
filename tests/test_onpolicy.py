"""The on-policy trainer of the smollm2 draft (training/onpolicy.py): its loss against hand computations,
its data stage on a tiny pair, and the draft it exports."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import full_logits, make_model, make_tokenizer

from mtad.decoding import generate
from mtad.models.pair import load
from mtad.models.shortlist_draft import ShortlistForCausalLM
from mtad.settings import Settings
from training import onpolicy

CHAT = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


def hand_warp(logits: list[float], k: int = 20, top_p: float = 0.9) -> list[float]:
    """Top-k, then top-p (the smallest set of the largest whose mass reaches top_p), renormalised."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])[:k]
    z = sum(math.exp(logits[i]) for i in order)
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += math.exp(logits[i]) / z
    zk = sum(math.exp(logits[i]) for i in kept)
    return [math.exp(x) / zk if i in kept else 0.0 for i, x in enumerate(logits)]


def test_the_warped_law_is_the_one_the_decoders_sample_from() -> None:
    logits = torch.linspace(3.0, -3.0, 30) + 0.01 * torch.arange(30).sin()
    got = onpolicy.warped_probs(logits[None])[0]
    want = torch.tensor(hand_warp(logits.tolist()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got == 0).sum() >= 10  # top-k 20 cut the tail at least


def test_acceptance_is_one_minus_total_variation() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.2, 0.2, 0.4])
    assert onpolicy.acceptance(p, q).item() == pytest.approx(0.6)  # 0.2 + 0.2 + 0.2 + 0
    assert onpolicy.acceptance(p, q).item() == pytest.approx(1 - 0.5 * (p - q).abs().sum().item())
    assert onpolicy.acceptance(p, p).item() == pytest.approx(1.0)


def test_the_loss_is_zero_when_the_draft_is_the_target_and_not_otherwise() -> None:
    """A draft whose shortlist covers every token and whose logits equal the target's: acceptance 1,
    KL 0, loss 0, every top-1 agreed. A different draft: acceptance and KL as computed by hand."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(6, 40, generator=gen) * 3
    labels = onpolicy.label(target)
    row_of = torch.arange(40)
    terms = onpolicy.draft_terms(target, row_of, labels["idx"], labels["lp"], labels["pw"])
    torch.testing.assert_close(terms["accept"], torch.ones(6), rtol=0, atol=2e-3)  # pw is stored in fp16
    assert onpolicy.loss_of(terms, 0.3).item() == pytest.approx(0.0, abs=3e-3)
    assert terms["agree"].tolist() == [1.0] * 6 and terms["kl"].abs().max() < 3e-3
    draft = torch.randn(6, 40, generator=gen) * 3
    terms = onpolicy.draft_terms(draft, row_of, labels["idx"], labels["lp"], labels["pw"])
    for i in range(6):
        p = torch.tensor(hand_warp(target[i].tolist()))
        q = torch.tensor(hand_warp(draft[i].tolist()))
        assert terms["accept"][i].item() == pytest.approx(torch.minimum(p, q).sum().item(), abs=2e-3)
        t = torch.softmax(target[i], -1).topk(32)
        tw = t.values / t.values.sum()
        kl = (tw * (tw.log() - torch.log_softmax(draft[i], -1)[t.indices])).sum().item()
        assert terms["kl"][i].item() == pytest.approx(kl, rel=1e-2)
    assert (terms["accept"] < 0.99).all()


def test_a_target_token_off_the_shortlist_counts_as_a_miss() -> None:
    target = torch.full((1, 8), -10.0)
    target[0, 7] = 10.0  # the target is sure of token 7, which the draft cannot propose
    labels = onpolicy.label(target)
    row_of = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    row_of[7] = 4  # a shortlist of 4 rows: ids 0..3; 7 maps to the shared rare row
    terms = onpolicy.draft_terms(
        torch.zeros(1, 4), row_of, labels["idx"][:, :8], labels["lp"][:, :8], labels["pw"][:, :8]
    )
    assert terms["accept"].item() == pytest.approx(0.0, abs=1e-3) and terms["agree"].item() == 0.0


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A 10-token chat tokenizer, a peaked one-layer target and a shortlist draft of its layer with int8
    weights, saved as the trainer finds a committed draft."""
    tok = make_tokenizer("abc", 10)
    tok.chat_template = CHAT
    target = make_model(len(tok), 32, 1, seed=4, init=0.6)
    draft = ShortlistForCausalLM.from_target(target, torch.arange(1, 7), layers=(0,)).quantize_layers()
    root = tmp_path_factory.mktemp("chat")
    draft.save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")
    return tok, target, root / "draft"


def test_the_data_stage_samples_replies_and_labels_every_reply_position(tiny_chat) -> None:
    tok, target, path = tiny_chat
    draft = onpolicy.load_draft(path)
    assert draft.training and not draft.config.int8_layers
    assert all(type(m) is torch.nn.Linear for m in draft.model.layers.modules() if isinstance(m, torch.nn.Linear))
    samples = onpolicy.sample_replies(draft, tok, ["ab", "cab ba", "c"], seed=0, max_new=12)
    onpolicy.label_samples(target, samples, chunk=2)
    shortlist = set(draft.columns.tolist())
    for s in samples:
        prompt = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
        assert prompt.endswith("<a>")
        reply = s["ids"][s["start"] + 1 :].tolist()
        assert 1 <= len(reply) <= 12 and set(reply) <= shortlist | {tok.eos_token_id}
        assert len(s["idx"]) == len(reply)  # one label per reply token, at the position before it
        for j in range(len(reply)):
            want = onpolicy.warped_probs(full_logits(target, s["ids"][: s["start"] + 1 + j].tolist())[None])[0]
            torch.testing.assert_close(s["pw"][j].float(), want[s["idx"][j].long()], rtol=0, atol=1e-3)
        assert s["pw"].float().sum(-1).sub(1).abs().max() < 2e-3  # the warped law lies in the top 32


def test_the_exported_draft_loads_with_auto_classes_and_keeps_rules_exact(tiny_chat, tmp_path) -> None:
    tok, target, path = tiny_chat
    draft = onpolicy.load_draft(path)
    with torch.no_grad():
        draft.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # a trained change
    onpolicy.save_draft(draft, tok, tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    pair = load(str(tmp_path / "draft"), str(tmp_path / "target"), device="cpu", dtype="float32")
    assert type(pair.draft).__name__ == "ShortlistForCausalLM" and pair.draft.config.int8_layers
    logits = full_logits(pair.draft, [1, 2, 3])
    off = [t for t in range(len(tok)) if t not in set(pair.draft.columns.tolist())]
    assert off and torch.isinf(logits[off]).all() and torch.isfinite(logits[pair.draft.columns]).all()
    ar = generate(pair, "abca", Settings(method="ar", greedy=True, max_new_tokens=16), raw=True).new_ids
    for method in ("sd", "specinfer"):
        assert generate(pair, "abca", Settings(method=method, greedy=True, max_new_tokens=16), raw=True).new_ids == ar
