"""The GGUF loading path without the 93 MB wheel: the embedded target written as a GGUF file the way
llama.cpp's converter writes a Llama, then loaded through mtad's own ``load`` and compared with the
safetensors original (tokenizer ids, logits, greedy decoding)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import full_logits
from transformers import AutoModelForCausalLM, AutoTokenizer

from mtad.decoding import generate
from mtad.models.gguf_cache import cached_dir, materialize
from mtad.models.pair import ModelPair, load
from mtad.settings import Settings

gguf = pytest.importorskip("gguf", reason="needs the gguf package (pip install gguf)")

MODELS = Path(__file__).resolve().parents[1] / "assets" / "models"
TEXTS = [
    "def main(argv):\n    return 0\n",
    "import os\nclass Foo(object):\n\tpass  # über ça 数字 😀",
    "  leading spaces,   tabs\t\tand <|endoftext|> inside",
]
PROMPT = "def parse_args(argv):\n    "


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): rotary halves interleaved per head."""
    n = n_head_kv if n_head_kv != n_head else n_head
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(src: Path, out: Path, permute: bool = True) -> Path:
    """Write the Llama in ``src`` (safetensors + tokenizer.json) as an F32 GGUF, llama.cpp-style:
    ``llama.*`` hyper-parameters, ``tokenizer.ggml.*`` byte-level BPE metadata, ``blk.N.*`` tensors."""
    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("embedded-target")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue  # tied: llama.cpp writes no output.weight, and transformers ties it back
        stem, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(stem)}.{suffix}"
        data = t.detach().float().numpy()
        if permute and name.endswith("attn_q.weight"):
            data = llama_cpp_permute(data, n_head, n_head)
        elif permute and name.endswith("attn_k.weight"):
            data = llama_cpp_permute(data, n_head, n_kv)
        w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(MODELS / "target", tmp_path_factory.mktemp("gguf") / "embedded-target.F32.gguf")


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh dequantised-weights cache for this module (never the user's own)."""
    root = tmp_path_factory.mktemp("mtad-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MTAD_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def gguf_pair(gguf_file: Path, gguf_cache: Path) -> ModelPair:
    """The embedded draft with the GGUF target, through mtad's own loader (fp32); the first load,
    so it reads the GGUF file and writes the cache."""
    assert not list(gguf_cache.rglob("*.safetensors"))
    return load(str(MODELS / "draft"), str(gguf_file), device="cpu", dtype="float32")


def test_a_second_load_reads_the_dequantised_cache(
    gguf_pair: ModelPair, gguf_file: Path, gguf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load wrote plain fp32 safetensors + tokenizer; the second reads them (no GGUF parse)
    and gives the same tokenizer and logits as the direct GGUF load, bit for bit with the same linear
    kernel (PyTorch's own, which the direct load runs; the load's timed choice could pick another)."""
    monkeypatch.setenv("MTAD_CPU_LINEAR", "mkl")
    (cached,) = [p.parent for p in gguf_cache.rglob("model.safetensors")]
    assert cached == cached_dir(gguf_file) and (cached / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((cached / "config.json").read_text())
    again = load(str(MODELS / "draft"), str(gguf_file), device="cpu", dtype="float32")
    assert again.target.name_or_path == str(cached)
    assert again.tokenizer.get_vocab() == gguf_pair.tokenizer.get_vocab()
    ids = gguf_pair.encode(PROMPT)
    direct = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    torch.testing.assert_close(full_logits(again.target, ids), full_logits(direct.eval(), ids), rtol=0, atol=0)


def test_an_unwritable_cache_falls_back_to_the_gguf_file(gguf_file: Path, tmp_path: Path, monkeypatch) -> None:
    """A cache that cannot be written is not an error: the GGUF file is loaded directly."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("MTAD_CACHE", str(blocker))
    assert materialize(gguf_file) is None
    pair = load(str(MODELS / "draft"), str(gguf_file), device="cpu", dtype="float32")
    assert pair.target.name_or_path == str(gguf_file.parent)


def test_the_same_gguf_reinstalled_reuses_one_copy_and_old_copies_go(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache is keyed by the file's bytes: the same GGUF installed again elsewhere, later (a new virtual
    environment), finds the copy the first install wrote, and a changed file gets its own. Writing a copy
    removes that file's copies under the old size-and-time key, and nothing else in the cache."""
    monkeypatch.setenv("MTAD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "gguf"
    size = gguf_file.stat().st_size
    old = [folder / f"{gguf_file.stem}-{size}-{1795845253 + i}" for i in range(2)]
    kept = [folder / f"other-model-{size}-1795845253", folder / f"{gguf_file.stem}-sha256-0123456789abcdef"]
    for path in old + kept:
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"stale")
    first = materialize(gguf_file)
    assert first is not None and (first / "model.safetensors").stat().st_size > 1000
    assert not any(p.exists() for p in old) and all(p.exists() for p in kept)
    again = tmp_path / "venv2" / gguf_file.name
    again.parent.mkdir()
    shutil.copyfile(gguf_file, again)
    os.utime(again, (gguf_file.stat().st_atime, gguf_file.stat().st_mtime + 3600))
    assert cached_dir(again) == first and materialize(again) == first
    changed = tmp_path / "venv3" / gguf_file.name
    changed.parent.mkdir()
    data = bytearray(gguf_file.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    changed.write_bytes(bytes(data))
    assert cached_dir(changed) != first
    assert sorted(p.name for p in folder.iterdir()) == sorted([first.name] + [p.name for p in kept])


@pytest.fixture(scope="module")
def original() -> tuple:
    d = MODELS / "target"
    return AutoTokenizer.from_pretrained(d), AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def test_gguf_file_is_llama_cpp_shaped(gguf_file: Path) -> None:
    """The file says what llama.cpp would: arch, tokenizer model and the standard tensor names."""
    reader = gguf.GGUFReader(str(gguf_file))
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "llama"
    model = reader.fields["tokenizer.ggml.model"]
    assert bytes(model.parts[model.data[0]]).decode() == "gpt2"
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.5.ffn_down.weight"} <= names
    assert "output.weight" not in names


def test_gguf_tokenizer_gives_the_original_ids(gguf_pair: ModelPair, original: tuple) -> None:
    tok, _ = original
    assert gguf_pair.tokenizer.get_vocab() == tok.get_vocab()
    for text in TEXTS:
        want = tok(text)["input_ids"]
        assert gguf_pair.encode(text) == want, text
        assert gguf_pair.decode(want) == tok.decode(want, skip_special_tokens=True)
    assert 0 in gguf_pair.encode(TEXTS[2]), "the special token stays one token"
    assert not gguf_pair.chat and gguf_pair.eos_ids == {0}


def test_gguf_target_logits_equal_the_safetensors_target(gguf_pair: ModelPair, original: tuple) -> None:
    tok, model = original
    assert gguf_pair.target.dtype == torch.float32
    assert gguf_pair.target.config.tie_word_embeddings
    ids = tok(PROMPT)["input_ids"]
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([ids])).logits[0]
        got = gguf_pair.target(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full_logits(gguf_pair.target, ids), full_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_unpermuted_q_k_give_other_logits(gguf_file: Path, original: tuple, tmp_path: Path) -> None:
    """Negative control: without llama.cpp's q/k permutation the loaded model is a different one,
    so the equality above really checks the permutation transformers reverses on load."""
    tok, model = original
    bad = write_llama_gguf(MODELS / "target", tmp_path / "unpermuted.gguf", permute=False)
    wrong = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=bad.name, dtype=torch.float32).eval()
    ids = tok(PROMPT)["input_ids"]
    assert (full_logits(wrong, ids) - full_logits(model, ids)).abs().max() > 1e-2


def test_greedy_sd_and_mtad_tau_one_equal_greedy_ar_on_the_gguf_pair(gguf_pair: ModelPair, original: tuple) -> None:
    """The GGUF pair decodes exactly: greedy SD and MTAD at tau=1 are AR token for token, and AR is
    the safetensors target's own greedy continuation."""
    tok, model = original
    n = 24
    ar = generate(gguf_pair, PROMPT, Settings(method="ar", greedy=True, max_new_tokens=n)).new_ids
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    with torch.inference_mode():
        hf = model.generate(ids, do_sample=False, max_new_tokens=n, pad_token_id=0)[0, ids.shape[1] :].tolist()
    assert ar == hf and len(ar) == n
    sd = generate(gguf_pair, PROMPT, Settings(method="sd", greedy=True, gamma=4, max_new_tokens=n))
    assert sd.new_ids == ar
    assert any(s.accepted > 0 for s in sd.steps), "no draft token was ever accepted: the SD path did not run"
    one = generate(gguf_pair, PROMPT, Settings(method="mtad", greedy=True, tau=1.0, gamma=4, beams=4, max_new_tokens=n))
    assert one.new_ids == ar


WRITER = """
import os, resource, signal, sys, time
from pathlib import Path
import mtad.models.gguf_cache as cache
limit, mode = int(sys.argv[2]), sys.argv[3]
if mode == "full":  # a disk that fills up: writes past `limit` bytes fail (EFBIG) instead of killing the writer
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
else:  # a writer killed halfway: it says where it writes, then waits for its end
    real = cache.save_model
    def save_model(model, path):
        real(model, path)
        print(Path(path).parent, flush=True)
        time.sleep(600)
    cache.save_model = save_model
print("result", cache.materialize(Path(sys.argv[1])), flush=True)
"""


def writer(gguf_file: Path, mode: str, limit: int = 0) -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-c", WRITER, str(gguf_file), str(limit), mode]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_full_disk_leaves_no_half_written_copy(gguf_file: Path, tmp_path: Path, monkeypatch) -> None:
    """The cache's disk fills up while the weights are written (a size limit on the writer's files): the
    load falls back to the GGUF file and nothing half-written stays in the cache."""
    monkeypatch.setenv("MTAD_CACHE", str(tmp_path / "cache"))
    proc = writer(gguf_file, "full", limit=256 * 1024)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "result None" in out
    assert not list((tmp_path / "cache" / "gguf").iterdir())


def test_a_killed_writer_s_partial_copy_is_removed_by_the_next(gguf_file: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MTAD_CACHE", str(tmp_path / "cache"))
    proc = writer(gguf_file, "killed")
    partial = Path(proc.stdout.readline().strip())
    assert partial.name.startswith(".partial-") and (partial / "model.safetensors").is_file()
    proc.kill()
    proc.wait(30)
    assert partial.is_dir()  # what a killed writer leaves
    out = materialize(gguf_file)
    assert out is not None and (out / "model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [out.name]


def test_a_copy_is_on_the_disk_before_it_is_renamed_into_place(gguf_file: Path, tmp_path: Path, monkeypatch) -> None:
    import mtad.models.gguf_cache as cache

    monkeypatch.setenv("MTAD_CACHE", str(tmp_path / "cache"))
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        real_fsync(fd)

    def rename(self: Path, target: Path) -> Path:
        events.append(("rename", self.name))
        return real_rename(self, target)

    monkeypatch.setattr(cache.os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    out = materialize(gguf_file)
    renamed = next(i for i, (what, _) in enumerate(events) if what == "rename")
    synced = {name for what, name in events[:renamed] if what == "fsync"}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= synced
    assert ("fsync", "gguf") in events[renamed:] and out is not None
