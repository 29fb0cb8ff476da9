"""Checks on the committed embedded model pair and prompt sets (offline, CPU)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import sysconfig
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "assets" / "models"
PROMPTS = ROOT / "assets" / "prompts"
PAIR = ("draft", "target")


@pytest.fixture(scope="module")
def pair():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models: one thread is faster than two on a busy machine
    out = {}
    for name in PAIR:
        d = MODELS / name
        out[name] = (
            AutoTokenizer.from_pretrained(d, local_files_only=True),
            AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval(),
        )
    return out


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_files_present():
    for name in PAIR:
        d = MODELS / name
        for f in (
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ):
            assert (d / f).is_file(), d / f
    total = sum(p.stat().st_size for p in MODELS.rglob("*") if p.is_file())
    assert total < 60 * 1024 * 1024


def test_vocab_and_special_tokens(pair):
    (tok_d, m_d), (tok_t, m_t) = pair["draft"], pair["target"]
    assert tok_d.get_vocab() == tok_t.get_vocab()
    assert m_d.config.vocab_size == m_t.config.vocab_size == len(tok_t)
    eos = tok_t.convert_tokens_to_ids("<|endoftext|>")
    assert tok_t.eos_token_id == eos
    for m in (m_d, m_t):
        assert m.config.eos_token_id == m.config.bos_token_id == m.config.pad_token_id == eos
        assert m.generation_config.eos_token_id == eos
        assert m.config.max_position_embeddings >= 1024
        assert m.dtype.is_floating_point and m.dtype.itemsize == 4  # loads as fp32 on CPU


def test_target_much_larger_than_draft(pair):
    assert _n_params(pair["target"][1]) >= 8 * _n_params(pair["draft"][1])


def test_tokenizer_round_trips_source(pair):
    tok = pair["target"][0]
    text = 'class A:\n\tdef f(self, x):\n        """Doc  string."""\n\n        return {x: [1, 2]}  # é ✓\r\n'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.encode(text) == ids  # nothing is added automatically


def test_greedy_generate_is_deterministic(pair):
    import torch

    for name in PAIR:
        tok, model = pair[name]
        enc = tok("def fibonacci(n):\n    ", return_tensors="pt")
        with torch.no_grad():
            a = model.generate(**enc, do_sample=False, max_new_tokens=16, pad_token_id=tok.eos_token_id)
            b = model.generate(**enc, do_sample=False, max_new_tokens=16, pad_token_id=tok.eos_token_id)
        assert torch.equal(a, b)
        new = tok.decode(a[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        assert new.strip(), name


def _load_jsonl(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for r in rows:
        assert set(r) >= {"id", "category", "prompt"}, r
        assert all(isinstance(r[k], str) and r[k] for k in ("id", "category", "prompt")), r
    assert len({r["id"] for r in rows}) == len(rows), "duplicate ids"
    return rows


def test_prompt_files():
    code = _load_jsonl(PROMPTS / "code.jsonl")
    chat = _load_jsonl(PROMPTS / "chat.jsonl")
    assert len(code) >= 50
    assert len(chat) >= 30
    assert all(50 <= len(r["prompt"]) <= 400 for r in code)
    assert {r["category"] for r in code} <= {"function", "method", "class"}
    assert len({r["category"] for r in chat}) >= 5


def _heldout() -> list[str]:
    return [ln for ln in (MODELS / "heldout_files.txt").read_text().splitlines() if ln]


def test_heldout_list_matches_card():
    digest = hashlib.sha256((MODELS / "heldout_files.txt").read_bytes()).hexdigest()
    card = (MODELS / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert digest in card
    assert re.search(r"python -m training\.embedded_pair", card)


def test_trainers_split_is_the_committed_heldout_list():
    """The pair trainer's corpus split, run here, lists exactly the committed held-out files, in order."""
    from training.embedded_pair import is_heldout, list_corpus

    heldout = _heldout()
    assert len(heldout) >= 30 and all(is_heldout(r) for r in heldout)
    _skip_unless_trained_on_this_python()
    train, held, _ = list_corpus()
    assert held == heldout
    assert not set(train) & set(heldout) and not any(is_heldout(r) for r in train)


def _skip_unless_trained_on_this_python() -> None:
    report = json.loads((MODELS / "train_report.json").read_text())
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if not report["corpus"]["python"].startswith(py + "."):
        pytest.skip(f"weights were trained on Python {report['corpus']['python']}'s stdlib, this is {py}")


def test_code_prompts_only_from_heldout_files():
    heldout = set(_heldout())
    for r in _load_jsonl(PROMPTS / "code.jsonl"):
        assert r["id"].rsplit(":", 1)[0] in heldout, r["id"]


def test_code_prompts_not_in_training_files():
    report = json.loads((MODELS / "train_report.json").read_text())
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if not report["corpus"]["python"].startswith(py + "."):
        pytest.skip(f"weights were trained on Python {report['corpus']['python']}'s stdlib, this is {py}")
    root = Path(sysconfig.get_paths()["stdlib"])
    heldout = set(_heldout())
    blobs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if {"site-packages", "dist-packages"} & set(rel.parts) or rel.as_posix() in heldout:
            continue
        blobs.append(path.read_bytes().decode("utf-8", errors="replace"))
    assert len(blobs) > 1000
    train_blob = "\0".join(blobs)
    for r in _load_jsonl(PROMPTS / "code.jsonl"):
        assert r["prompt"] not in train_blob, r["id"]
