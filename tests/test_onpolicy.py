"""The on-policy trainer of the smollm2 draft (training/onpolicy.py): its loss against hand computations,
its data stage on a tiny pair, the draft it exports (in shards under the transport's file limit, and
as the committed single file), and its train stage end to end inside a hard deadline."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import full_logits, make_model, make_tokenizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mtad.decoding import generate
from mtad.models.pair import load
from mtad.models.shortlist_draft import ShortlistForCausalLM
from mtad.settings import Settings
from training import onpolicy
from training.chat_draft import batched_continuations

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


def test_the_warped_distribution_is_the_one_the_decoders_sample_from() -> None:
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


TURNS = (
    "{% for m in messages %}{% if m['role'] == 'user' %}ca{% endif %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}b{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_chat_turns(tiny_chat, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """:func:`tiny_chat` with a chat template whose user turn starts with tokens (``ca``), so the target can
    write user turns after it (``CHAT``'s markers are no token of the tiny tokenizer)."""
    tok, target, path = tiny_chat
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TURNS
    root = tmp_path_factory.mktemp("turns")
    shutil.copytree(path, root / "draft")
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
        assert s["pw"].float().sum(-1).sub(1).abs().max() < 2e-3  # the warped distribution lies in the top 32


def test_the_target_writes_user_turns_it_ended_none_excluded_and_none_twice(tiny_chat_turns) -> None:
    """Magpie's data: what the target samples after the template's text before a user's message, kept where
    it ended the turn, 15 to 600 characters long, not excluded and not seen before, in the order drawn."""
    tok, target, _ = tiny_chat_turns
    prefix = onpolicy.user_turn_prefix(tok)
    assert prefix == "ca"
    _, turns, _ = batched_continuations(target, tok, [prefix] * 10, 5, onpolicy.PROMPT_TOKENS, onpolicy.warped_draw)
    ended = [tok.decode(t[:-1]).strip() for t in turns if t and t[-1] == tok.eos_token_id]
    assert 0 < len(ended) < 10 or any(not 15 <= len(x) <= 600 for x in ended)  # the filter has work to do
    kept = list(dict.fromkeys(x for x in ended if 15 <= len(x) <= 600))
    assert len(kept) >= 2
    # n = 8 draws 10 rows first: the same draws, filtered by hand (a second draw tops up what is missing)
    got = onpolicy.target_prompts(target, tok, 8, seed=5)
    assert got[: len(kept)] == kept[:8] and len(got) == len(set(got)) <= 8
    assert onpolicy.target_prompts(target, tok, 8, seed=5) == got  # seeded
    without = onpolicy.target_prompts(target, tok, 8, seed=5, exclude={kept[0]})
    assert kept[0] not in without and without[: len(kept) - 1] == kept[1:8]


def test_a_template_whose_user_turn_starts_with_no_token_is_refused_with_a_message(tiny_chat) -> None:
    tok, target, _ = tiny_chat
    with pytest.raises(ValueError, match="no token of this tokenizer"):
        onpolicy.target_prompts(target, tok, 4, seed=0)


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


def test_training_instructions_are_neither_benchmark_nor_heldout_prompts() -> None:
    train, held = onpolicy.instructions(heldout=False), onpolicy.instructions(heldout=True)
    assert len(held) == 264 and len(train) == 14640 - 264
    assert not set(train) & onpolicy.eval_prompts() and not set(held) & onpolicy.eval_prompts()
    assert not set(train) & set(held)


def test_the_targets_replies_are_the_chat_trainers_draws(tiny_chat, monkeypatch) -> None:
    """The trainer's target-written replies are those of the chat trainer's loop from the same seed (it
    only skips that loop's per-position top-K), and a deadline already past stops each after one token."""
    from training import chat_draft
    from training.chat_draft import generate_batch

    monkeypatch.setattr(chat_draft, "TOPK", 8)  # the tiny vocabulary has 10 tokens
    tok, target, _ = tiny_chat
    prompts = ["ab", "cab ba", "c", "bb a c"]
    got = onpolicy.target_replies(target, tok, prompts, seed=5, max_new=10)
    want = generate_batch(target, tok, prompts, seed=5, max_new=10)
    assert [s["ids"].tolist() for s in got] == [s["ids"].tolist() for s in want]
    assert [s["start"] for s in got] == [s["start"] for s in want]
    cut = onpolicy.target_replies(target, tok, prompts, seed=5, max_new=10, until=time.time() - 1)
    assert [len(s["ids"]) - s["start"] - 1 for s in cut] == [1] * 4
    assert [s["ids"].tolist() for s in cut] == [s["ids"][: s["start"] + 2].tolist() for s in got]


def test_a_left_padded_batch_writes_each_reply_as_a_batch_of_one_would(tiny_chat) -> None:
    """Hundreds of replies a round run as one left-padded batch: greedily, every row's reply (prompts
    of different lengths, rows ending at different steps) is what that prompt alone gets."""
    from training.chat_draft import batched_replies

    tok, target, path = tiny_chat
    draft = onpolicy.load_draft(path).eval()

    def greedy(logits: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, None]:
        token = draft.columns[logits.argmax(-1)]
        return token.masked_fill(token == 4, tok.eos_token_id), None  # so that some rows end early

    prompts = ["a", "cab ba cab ba cab", "bb", "c a b c a", "abcabc abc", "b"]
    for model, kwargs, step in ((draft, {"shortlist_only": True}, greedy), (target, {}, None)):
        step = step or (lambda logits, generator: (logits.argmax(-1), None))
        with torch.inference_mode():
            _, together, _ = batched_replies(model, tok, prompts, 0, 12, step, **kwargs)
            alone = [batched_replies(model, tok, [p], 0, 12, step, **kwargs)[1][0] for p in prompts]
        assert together == alone
        assert len({len(r) for r in together}) > 1  # rows ended at different steps


def test_the_tokenizer_comes_from_the_draft_when_asked(tiny_chat, tmp_path, capsys) -> None:
    """transformers 5.17 reads the GGUF target's tokenizer with a wrong end token and no padding token:
    the trainer takes the committed draft's copy of the target's tokenizer instead."""
    import copy

    tok, target, path = tiny_chat
    broken = copy.deepcopy(tok)
    broken.pad_token = None
    target.save_pretrained(tmp_path / "target")
    broken.save_pretrained(tmp_path / "target")
    _, got = onpolicy.load_target(tmp_path / "target", tokenizer=path)
    assert got.pad_token == tok.pad_token and got.eos_token_id == tok.eos_token_id
    assert "pads with None" in capsys.readouterr().out
    _, own = onpolicy.load_target(tmp_path / "target")
    assert own.pad_token is None


def test_labels_gathered_as_on_a_gpu_equal_the_cpu_labels(tiny_chat) -> None:
    """The GPU's labelling (samples sorted by length, the head on reply positions only) gives the labels
    of the CPU's (the head on every position of a chunk of 2)."""
    tok, target, path = tiny_chat
    draft = onpolicy.load_draft(path)
    samples = onpolicy.sample_replies(draft, tok, ["ab", "cab ba", "c", "bb a c", "a"], seed=2, max_new=12)
    cpu = onpolicy.label_samples(target, [dict(s) for s in samples], chunk=2, gather=False)
    gpu = onpolicy.label_samples(target, [dict(s) for s in samples], chunk=8, gather=True)
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a["idx"], b["idx"])
        torch.testing.assert_close(a["lp"], b["lp"], rtol=0, atol=2e-3)
        torch.testing.assert_close(a["pw"], b["pw"], rtol=0, atol=2e-3)
    assert onpolicy.evaluate(draft, cpu) == pytest.approx(onpolicy.evaluate(draft, gpu), abs=1e-3)


def test_the_draft_as_exported_scores_what_the_exported_files_score(tiny_chat, tmp_path) -> None:
    """The held-out figures that choose the best draft are those of the files --out then holds."""
    tok, target, path = tiny_chat
    draft = onpolicy.load_draft(path)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.01 * torch.randn_like(p))  # trained: off the bf16 and int8 grids
    samples = onpolicy.sample_replies(draft, tok, ["ab", "cab ba", "c", "bb a c"], seed=3, max_new=12)
    held = onpolicy.label_samples(target, samples)
    onpolicy.save_best(draft, tok, tmp_path / "best", {"step": 1, "log": []}, {}, max_shard_size="4KB")
    got = onpolicy.evaluate(onpolicy.exportable(draft), held)
    assert got == onpolicy.evaluate(onpolicy.load_draft(tmp_path / "best"), held)
    assert got != onpolicy.evaluate(draft, held)
    assert draft.training and type(draft.model.layers[0].mlp.up_proj) is torch.nn.Linear  # left as it was


def test_a_sharded_best_draft_loads_and_exports_as_one_file(tiny_chat, tmp_path) -> None:
    tok, target, path = tiny_chat
    draft = onpolicy.load_draft(path)
    with torch.no_grad():
        draft.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # a trained change
    figures = {"improved": True, "best": {"accept": 0.5}, "committed": {"accept": 0.4}}
    out = tmp_path / "best"
    onpolicy.save_best(draft, tok, out, {"step": 7, "log": []}, figures, max_shard_size="4KB")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (out / "model.safetensors.index.json").exists()
    assert not (out / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is ShortlistForCausalLM and loaded.config.int8_layers
    committed = tmp_path / "committed"
    shutil.copytree(path, committed)
    onpolicy.main(["--stage", "export", "--out", str(out), "--draft", str(committed)])
    merged = load_file(committed / "model.safetensors")
    parts = {k: v for f in shards for k, v in load_file(f).items()}
    assert merged.keys() == parts.keys() and all(torch.equal(merged[k], parts[k]) for k in parts)
    again = AutoModelForCausalLM.from_pretrained(committed)
    ids = [1, 2, 3, 4, 5]
    torch.testing.assert_close(full_logits(again, ids), full_logits(loaded, ids), rtol=0, atol=0)
    log = json.loads((committed / "onpolicy_log.json").read_text())
    assert log["step"] == 7 and log["figures"]["improved"]
    # a best that is still the starting draft is not exported
    onpolicy.save_best(draft, tok, out, {"step": 0, "log": []}, figures | {"improved": False})
    with pytest.raises(SystemExit, match="no round beat it"):
        onpolicy.main(["--stage", "export", "--out", str(out), "--draft", str(committed)])


def test_the_committed_draft_goes_out_in_files_under_15mb_and_comes_back_bit_for_bit(tmp_path) -> None:
    """The real 17 MB draft: --out's shards are each under the transport's limit and load as the
    committed draft; export makes them one file holding exactly the committed tensors again."""
    draft = onpolicy.load_draft(onpolicy.DRAFT)
    tok = AutoTokenizer.from_pretrained(onpolicy.DRAFT)
    out = tmp_path / "best"
    onpolicy.save_best(draft, tok, out, {"step": 1, "log": []}, {"improved": True})
    sizes = {f.name: f.stat().st_size for f in out.iterdir()}
    assert len([n for n in sizes if n.startswith("model-")]) >= 2
    assert max(sizes.values()) <= onpolicy.FILE_LIMIT, sizes
    committed = load_file(onpolicy.DRAFT / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in committed.items())
    into = tmp_path / "committed"
    shutil.copytree(onpolicy.DRAFT, into)
    onpolicy.main(["--stage", "export", "--out", str(out), "--draft", str(into)])
    merged = load_file(into / "model.safetensors")
    assert merged.keys() == committed.keys() and all(torch.equal(merged[k], v) for k, v in committed.items())
    assert (into / "model.safetensors").stat().st_size <= onpolicy.COMMITTED_LIMIT


@pytest.mark.parametrize(("prompts", "held_out"), [("templates", "target"), ("target", "templates")])
def test_the_train_stage_ends_before_its_deadline_with_the_best_draft_and_its_figures(
    prompts: str, held_out: str, tiny_chat_turns, tmp_path: Path
) -> None:
    """``python -m training.onpolicy --stage train`` on the tiny pair with a 24-second budget (15 s once left
    a loaded machine no training step): the process (loading included) ends inside it, and --out holds a
    loadable draft in files under the limit, with the figures: the starting draft's held-out scores are the
    committed draft's, the best's no worse. The held-out instructions are the target's own user turns or
    templated ones, as asked."""
    tok, target, path = tiny_chat_turns
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    work, out, minutes = tmp_path / "work", tmp_path / "out", 0.4
    command = [sys.executable, "-m", "training.onpolicy", "--stage", "train", "--work", str(work)]
    command += ["--out", str(out), "--target", str(target_dir), "--draft", str(path), "--minutes", str(minutes)]
    command += ["--gen-batch", "4", "--batch", "4", "--steps-per-round", "2", "--max-new", "8", "--heldout", "6"]
    command += ["--confirm", "2", "--prompts", prompts, "--heldout-prompts", held_out]
    command += ["--eval-every", "2", "--lr", "1e-3"]
    root = Path(__file__).resolve().parents[1]
    t = time.time()
    path_env = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": path_env})
    took = time.time() - t
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert took < minutes * 60, f"took {took:.1f} s"
    sizes = {f.name: f.stat().st_size for f in out.iterdir()}
    assert max(sizes.values()) <= onpolicy.FILE_LIMIT and "figures.json" in sizes
    assert len(sizes) <= 6 and not any(name.startswith("tokenizer") for name in sizes)  # a transport may take 8
    figures = json.loads((out / "figures.json").read_text())
    for key in ("start", "best", "steps", "rounds", "tokens_seen", "minutes", "improved", "committed"):
        assert key in figures, key
    assert figures["steps"] > 0 and figures["tokens_seen"] > 0 and figures["minutes"] < minutes
    assert figures["start"]["positions"] > 0 and {"accept", "agree"} <= figures["best"].keys()
    heldout = torch.load(work / "heldout.pt", weights_only=False)
    assert len(heldout) == 6
    asked = [s["prompt"] for s in heldout]
    templated = set(onpolicy.instructions(heldout=True))
    assert set(asked) <= templated if held_out == "templates" else not set(asked) & templated
    if held_out == "target":
        loaded, own = onpolicy.load_target(target_dir, onpolicy.CPU, tokenizer=path)  # as the run loads them
        assert asked == onpolicy.target_prompts(loaded, own, 6, onpolicy.HELDOUT_SEED, onpolicy.eval_prompts())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the run evaluated (--threads 1): products split over two threads round apart
    try:
        start = onpolicy.evaluate(onpolicy.load_draft(path), heldout[:4])  # the last 2 only confirm
        confirmed = onpolicy.evaluate(onpolicy.load_draft(out), heldout[4:])
        there = onpolicy.evaluate(onpolicy.load_draft(path), heldout[4:], by_reply=True)
        mine = onpolicy.evaluate(onpolicy.load_draft(out), heldout[4:], by_reply=True)
    finally:
        torch.set_num_threads(threads)
    assert figures["start"]["accept"] == pytest.approx(start["accept"], abs=1e-6)
    assert figures["best"]["accept"] >= figures["start"]["accept"]
    assert figures["confirm"]["best"]["accept"] == pytest.approx(confirmed["accept"], abs=1e-6)
    assert figures["confirm"]["committed"]["positions_by_reply"] == there["positions_by_reply"]
    for key in ("accept", "agree", "kl", "accept_by_reply"):
        assert figures["confirm"]["committed"][key] == pytest.approx(there[key])
    if "gain" in figures["confirm"]["best"]:  # a best after the start: its gain there, paired by reply
        gain, se = onpolicy.paired_gain(mine, there)
        assert (figures["confirm"]["best"]["gain"], figures["confirm"]["best"]["gain_se"]) == pytest.approx((gain, se))
    assert figures["improved"] == onpolicy.improved(figures)
    best = AutoModelForCausalLM.from_pretrained(out)
    assert type(best) is ShortlistForCausalLM and best.config.int8_layers
    assert (work / "state.pt").exists()  # resumable


def test_a_best_is_an_improvement_only_where_the_confirming_replies_agree() -> None:
    figures = {"best": {"accept": 0.46}, "committed": {"accept": 0.45}}
    assert onpolicy.improved(figures)
    assert not onpolicy.improved(figures | {"best": {"accept": 0.45}})
    confirm = {"committed": {"accept": 0.44}, "best": {"accept": 0.445}}
    assert onpolicy.improved(figures | {"confirm": confirm})
    assert not onpolicy.improved(figures | {"confirm": confirm | {"best": {"accept": 0.439}}})
    assert not onpolicy.improved(figures | {"confirm": {"committed": {"accept": 0.44}, "best": {"accept": 0.44}}})


def test_a_gain_on_the_confirming_replies_counts_only_beyond_two_standard_errors() -> None:
    """Run T's "best" beat the committed draft by 0.00004 on both held-out sets: noise, now no improvement."""
    figures = {"best": {"accept": 0.46}, "committed": {"accept": 0.45}}
    noise = {"committed": {"accept": 0.44}, "best": {"accept": 0.44004, "gain": 0.00004, "gain_se": 0.002}}
    assert not onpolicy.improved(figures | {"confirm": noise})
    clear = {"committed": {"accept": 0.44}, "best": {"accept": 0.45, "gain": 0.01, "gain_se": 0.004}}
    assert onpolicy.improved(figures | {"confirm": clear})
    assert not onpolicy.improved(figures | {"best": {"accept": 0.45}, "confirm": clear})


def test_the_paired_gain_and_its_standard_error_match_a_hand_computation() -> None:
    base = {"accept_by_reply": [2.0, 5.0, 1.0], "positions_by_reply": [4, 10, 2]}
    new = {"accept_by_reply": [3.0, 5.0, 1.5], "positions_by_reply": [4, 10, 2]}
    gain, se = onpolicy.paired_gain(new, base)
    assert gain == pytest.approx(1.5 / 16)
    resid = [1.0 - gain * 4, 0.0 - gain * 10, 0.5 - gain * 2]
    assert se == pytest.approx(math.sqrt(sum(r * r for r in resid) * 3 / 2) / 16)
    with pytest.raises(ValueError, match="same replies"):
        onpolicy.paired_gain(new | {"positions_by_reply": [4, 10, 3]}, base)


def test_acceptance_by_reply_adds_up_to_the_pooled_acceptance(tiny_chat) -> None:
    tok, target, path = tiny_chat
    samples = onpolicy.target_replies(target, tok, ["ab", "cab ba", "c", "bb a"], seed=3, max_new=10)
    onpolicy.label_samples(target, samples, chunk=3)
    got = onpolicy.evaluate(onpolicy.load_draft(path), samples, chunk=3, by_reply=True)
    assert got["positions_by_reply"] == [len(s["idx"]) for s in samples]
    assert sum(got["accept_by_reply"]) / got["positions"] == pytest.approx(got["accept"])
    alone = [onpolicy.evaluate(onpolicy.load_draft(path), [s])["accept"] * len(s["idx"]) for s in samples]
    assert got["accept_by_reply"] == pytest.approx(alone, abs=1e-5)


def test_the_evaluate_stage_reports_on_other_prompts_by_category(tiny_chat, tmp_path, capsys) -> None:
    """``--stage evaluate --report-prompts FILE``: the target's replies to FILE's prompts, two seeds each,
    labelled and kept; acceptance on them pooled and by category, for the committed draft and the best."""
    tok, target, path = tiny_chat
    target_dir, work = tmp_path / "target", tmp_path / "work"
    target.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    work.mkdir()
    held = onpolicy.target_replies(target, tok, ["ab", "ca"], seed=1, max_new=6)
    torch.save(onpolicy.label_samples(target, held), work / "heldout.pt")
    shutil.copytree(path, work / "best")  # a best that is the committed draft: the same figures
    rows = [("ab c", "math"), ("cab", "writing"), ("bb", "math")]
    prompts = tmp_path / "report.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in rows))
    argv = ["--stage", "evaluate", "--work", str(work), "--draft", str(path), "--target", str(target_dir)]
    assert onpolicy.main([*argv, "--report-prompts", str(prompts), "--max-new", "6"]) == 0
    report = torch.load(work / "report-report.pt", weights_only=False)
    assert [(s["prompt"], s["category"]) for s in report] == rows * len(onpolicy.REPORT_SEEDS)
    assert all(len(s["idx"]) == len(s["ids"]) - 1 - s["start"] for s in report)  # every reply position labelled
    draft = onpolicy.load_draft(path)
    cats = onpolicy.by_category(report, onpolicy.evaluate(draft, report, by_reply=True))
    maths = [s for s in report if s["category"] == "math"]
    assert set(cats) == {"math", "writing"}
    assert cats["math"] == pytest.approx(onpolicy.evaluate(draft, maths)["accept"])
    out = capsys.readouterr().out
    for name in ("committed", "best"):
        assert f"{name} on {prompts}: " in out and f"{name} on {prompts} by category: " in out
