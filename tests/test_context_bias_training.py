"""Choosing the context bias weights (training/context_bias.py): its masks are the engine's bias, its
unbiased score is the trainer's held-out acceptance, and the weights it writes are the ones decoding reads."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from test_onpolicy import tiny_chat  # noqa: F401  (the fixture)

from mtad.decoding.context_bias import ENV, weights_of
from training import context_bias as cb
from training import onpolicy


def hand_masks(samples: list[dict], row_of: torch.Tensor, width: int, orders: int) -> torch.Tensor:
    """For each reply position and order n: the columns of tokens that followed an earlier occurrence of the
    prefix's last n tokens, by a plain loop over the text."""
    rows = []
    for s in samples:
        ids = s["ids"].tolist()
        for c in range(s["start"], len(ids) - 1):
            per = torch.zeros(orders, width, dtype=torch.bool)
            for n in range(1, orders + 1):
                suffix = ids[c - n + 1 : c + 1] if c + 1 >= n else None
                for j in range(n - 1, c):
                    if suffix is not None and ids[j - n + 1 : j + 1] == suffix and row_of[ids[j + 1]] < width:
                        per[n - 1, row_of[ids[j + 1]]] = True
            rows.append(per)
    return torch.stack(rows, dim=1)


@pytest.fixture(scope="module")
def labelled(tiny_chat):  # noqa: ANN001, ANN201, F811
    tok, target, path = tiny_chat
    samples = onpolicy.target_replies(target, tok, ["abcabcabc", "cab cab ba", "aabaab"], seed=2, max_new=30)
    onpolicy.label_samples(target, samples, chunk=2)
    return onpolicy.load_draft(path).eval(), samples, path


def test_the_masks_are_the_engines_bias_order_by_order(labelled) -> None:  # noqa: ANN001
    draft, samples, _ = labelled
    row_of = draft.model.embed_tokens.row_of
    width = draft.shortlist_logits(torch.zeros(1, draft.config.hidden_size)).shape[-1]
    got = cb.order_masks(samples, row_of, width, 3)
    assert torch.equal(got, hand_masks(samples, row_of, width, 3))
    assert got[0].any() and got[1].any(), "the replies repeat tokens: some orders must match"


def test_the_trainers_bias_is_the_engines_at_every_reply_position(labelled) -> None:  # noqa: ANN001
    from mtad.decoding.context_bias import context_bias

    draft, samples, _ = labelled
    row_of = draft.model.embed_tokens.row_of
    width = draft.shortlist_logits(torch.zeros(1, draft.config.hidden_size)).shape[-1]
    weights = torch.tensor([0.5, 2.0, 4.0])
    want = [
        context_bias(s["ids"].long().view(1, -1), c + 1, weights, row_of, width)[0]
        for s in samples
        for c in range(s["start"], len(s["ids"]) - 1)
    ]
    got = onpolicy.reply_bias(samples, weights, row_of, width)
    assert torch.equal(got, torch.stack(want))
    assert (got == 2.5).any(), "the replies repeat: some position must match two orders"
    # a run of one token: no match reaches back before the text's first token
    run = [{"ids": torch.tensor([3, 3, 3, 3, 3]), "start": 1}]
    want = [context_bias(run[0]["ids"].view(1, -1), c + 1, weights, torch.arange(5), 5)[0] for c in range(1, 4)]
    got = onpolicy.reply_bias(run, weights, torch.arange(5), 5)
    assert torch.equal(got, torch.stack(want)) and got[:, 3].tolist() == [0.5, 2.5, 6.5]


def test_the_trainer_scores_and_trains_a_draft_with_the_bias_its_config_carries(labelled, monkeypatch) -> None:  # noqa: ANN001
    draft, samples, _ = labelled
    monkeypatch.delenv(ENV, raising=False)
    plain = onpolicy.evaluate(draft, samples)
    monkeypatch.setattr(draft.config, "mtad_context_bias", [0.5, 2.0], raising=False)
    biased = onpolicy.evaluate(draft, samples)
    assert biased["accept"] == pytest.approx(cb.scorer(draft, samples, 2)((0.5, 2.0))["accept"], abs=1e-6)
    assert biased["accept"] != pytest.approx(plain["accept"], abs=1e-4)
    draft.train()
    loss = onpolicy.loss_of(onpolicy.batch_terms(draft, samples), kl_weight=0.3)
    loss.backward()  # the bias is a constant: the gradient reaches the draft's weights through its logits
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())
    draft.zero_grad()
    draft.eval()


def test_with_no_bias_the_score_is_the_trainers_held_out_acceptance(labelled) -> None:  # noqa: ANN001
    draft, samples, _ = labelled
    score = cb.scorer(draft, samples, 2)
    plain = onpolicy.evaluate(draft, samples)
    assert score((0.0, 0.0))["accept"] == pytest.approx(plain["accept"], abs=1e-6)
    assert score((0.0, 0.0))["agree"] == pytest.approx(plain["agree"], abs=1e-6)
    assert score((2.0, 2.0))["accept"] != pytest.approx(plain["accept"], abs=1e-4)


def test_the_written_weights_are_the_ones_decoding_reads(labelled, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from transformers import AutoConfig

    _, _, path = labelled
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    cb.write_weights(tmp_path, [0.5, 2.0, 0.0])
    monkeypatch.delenv(ENV, raising=False)
    model = argparse.Namespace(config=AutoConfig.from_pretrained(tmp_path))
    assert weights_of(model) == (0.5, 2.0)


def test_the_command_chooses_on_the_held_out_set_and_writes_the_best(labelled, tmp_path) -> None:  # noqa: ANN001
    import shutil

    draft, samples, path = labelled
    work, out = tmp_path / "work", tmp_path / "draft"
    work.mkdir()
    torch.save(samples, work / "heldout.pt")
    shutil.copytree(path, out)
    assert cb.main(["--work", str(work), "--draft", str(out), "--write", "--threads", "1"]) == 0
    chosen = json.loads((work / "context-bias.json").read_text())
    score = cb.scorer(draft, samples, len(cb.GRID))
    best = max(score(w)["accept"] for w in [(0.0,) * 4, (0.5, 2.0, 4.0, 2.0), (1.0, 3.0, 4.0, 2.0)])
    assert chosen["heldout"]["chosen"]["accept"] >= best - 1e-9
    assert chosen["heldout"]["chosen"]["accept"] == pytest.approx(score(tuple(chosen["weights"]))["accept"])
    want = list(chosen["weights"])
    while want and not want[-1]:
        want.pop()  # trailing orders of weight 0 are left out
    assert json.loads((out / "config.json").read_text()).get("mtad_context_bias", []) == want
