"""Device, dtype and device-map choices (mtad/models/devices.py) on this CPU-only machine: CUDA counts and compute
capabilities are faked where the code asks torch for them; the models are real and tiny."""

from __future__ import annotations

import json
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import mtad.models.devices as devices_mod
import mtad.models.pair as pair_mod
from mtad.cli import main
from mtad.decoding import generate
from mtad.decoding.kv import CachedLM
from mtad.models.devices import auto_dtype, cpu_has_native_bf16, resolve_device, resolve_device_map, resolve_dtype
from mtad.models.errors import PairError
from mtad.models.pair import load, load_pair
from mtad.models.presets import presets
from mtad.settings import Settings

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reports two CUDA devices (nothing here runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def cpu_caps(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    def set_caps(**flags: bool) -> None:
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512": True, **flags})
        monkeypatch.setattr(devices_mod, "onednn_runs", lambda dtype: True)  # no cap on the instruction sets

    return set_caps


# --- device (defect 9) -----------------------------------------------------------------------------------------------


def test_a_gpu_index_beyond_the_count_is_a_clear_error(two_gpus: None) -> None:
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    assert resolve_device("cuda") == CUDA
    with pytest.raises(PairError, match=r"'cuda:2' asked for, but this machine has 2 CUDA GPUs \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "tpu", "mps"])
def test_an_unknown_device_is_a_clear_error(bad: str) -> None:
    with pytest.raises(PairError, match="device must be auto, cpu, cuda or cuda:N"):
        resolve_device(bad)


def test_cli_rejects_a_missing_gpu_before_loading(two_gpus: None, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--pair", "embedded", "--device", "cuda:7", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "'cuda:7' asked for, but this machine has 2 CUDA GPUs" in err and "Traceback" not in err


# --- dtype (defect 5, and the CPU's native bf16) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "expected"),
    [
        ((7, 5), torch.float16),
        ((7, 0), torch.float16),
        ((8, 0), torch.bfloat16),
        ((8, 9), torch.bfloat16),
        ((9, 0), torch.bfloat16),
    ],
)
def test_cuda_dtype_follows_compute_capability(monkeypatch: pytest.MonkeyPatch, capability, expected) -> None:
    monkeypatch.delenv("MTAD_DTYPE", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert auto_dtype(CUDA) == expected
    assert resolve_dtype("auto", torch.device("cuda:0")) == expected


@pytest.mark.parametrize(
    ("flags", "expected"),
    [({"amx_bf16": True}, torch.bfloat16), ({"avx512_bf16": True}, torch.bfloat16), ({}, torch.float32)],
)
def test_cpu_dtype_is_bf16_only_where_it_is_native(monkeypatch: pytest.MonkeyPatch, cpu_caps, flags, expected) -> None:
    monkeypatch.delenv("MTAD_DTYPE", raising=False)
    cpu_caps(**flags)
    assert auto_dtype(CPU) == expected == resolve_dtype(None, CPU)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("flags : fpu sse avx512f amx_bf16 amx_tile\n", True),
        ("flags : fpu avx512_bf16\n", True),
        ("flags : avx2 avx512f\n", False),
    ],
)
def test_cpu_bf16_from_cpuinfo_where_torch_cannot_say(
    monkeypatch: pytest.MonkeyPatch, tmp_path, text, expected
) -> None:
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    monkeypatch.setattr(devices_mod, "onednn_runs", lambda dtype: True)
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    assert cpu_has_native_bf16(info) is expected
    assert cpu_has_native_bf16(tmp_path / "missing") is False


def test_cpuinfo_flags_are_spelled_as_pytorch_spells_them(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from mtad.models.devices import cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("flags : fpu avx2 fma avx512f avx512_bf16\n")
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    assert {"avx2", "fma3", "avx512_f", "avx512_bf16"} <= cpu_flags(info)
    assert "avx512f" not in cpu_flags(info)


def test_dtype_precedence_flag_then_operator_then_preset_then_hardware(
    monkeypatch: pytest.MonkeyPatch, cpu_caps
) -> None:
    cpu_caps(amx_bf16=True)
    monkeypatch.delenv("MTAD_DTYPE", raising=False)
    assert resolve_dtype("auto", CPU) == torch.bfloat16
    assert resolve_dtype("auto", CPU, preset="float32") == torch.float32
    monkeypatch.setenv("MTAD_DTYPE", "float16")
    assert resolve_dtype("auto", CPU, preset="float32") == torch.float16
    assert resolve_dtype("bf16", CPU, preset="float32") == torch.bfloat16
    assert resolve_dtype(torch.float32, CPU) == torch.float32
    monkeypatch.setenv("MTAD_DTYPE", "int4")
    with pytest.raises(PairError, match="dtype must be auto or one of"):
        resolve_dtype("auto", CPU)


def test_the_embedded_preset_pins_float32(monkeypatch: pytest.MonkeyPatch, cpu_caps) -> None:
    assert presets()["embedded"].dtype == "float32"
    cpu_caps(amx_bf16=True)  # even on a CPU where bf16 is native
    monkeypatch.delenv("MTAD_DTYPE", raising=False)
    pair = load_pair("embedded", device="cpu")
    assert pair.dtype == torch.float32 and pair.target.dtype == torch.float32
    assert pair.draft.dtype == torch.float32


def test_a_preset_with_a_bad_dtype_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path, tiny_dirs) -> None:
    f = tmp_path / "pairs.toml"
    f.write_text(f'[pairs.x]\ndraft = "{tiny_dirs[0]}"\ntarget = "{tiny_dirs[1]}"\ndescription = "x"\ndtype = "fp8"\n')
    monkeypatch.setenv("MTAD_PAIRS", str(f))
    with pytest.raises(PairError, match="preset 'x' has dtype 'fp8'"):
        load_pair("x", device="cpu")


def test_probabilities_stay_fp32_on_a_bf16_model(tiny_dirs) -> None:
    pair = load(*tiny_dirs, device="cpu", dtype="bfloat16")
    assert pair.target.dtype == torch.bfloat16 and pair.dtype == torch.bfloat16
    lm = CachedLM(pair.target, pair.vocab_size)
    assert lm.feed(torch.tensor([[1, 2, 3]]), keep=2).dtype == torch.float32
    run = generate(pair, "abc", Settings(method="mtad", max_new_tokens=6, seed=0))
    assert all(isinstance(v, float) for s in run.steps for v in s.target_logprobs)


# --- loading straight onto the device (defect 4) and device_map="auto" (issue 13) -----------------------------------


@pytest.fixture
def from_pretrained_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every ``AutoModelForCausalLM.from_pretrained`` keyword set; the real loader still runs."""
    calls: list[dict] = []
    real = AutoModelForCausalLM.from_pretrained

    def spy(source, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append({"source": source, **kwargs})
        return real(source, *args, **kwargs)

    monkeypatch.setattr(pair_mod.AutoModelForCausalLM, "from_pretrained", spy)
    return calls


def _tokens(pair, settings: Settings) -> list[int]:  # noqa: ANN001
    return [t for s in generate(pair, "abcab", settings).steps for t in s.appended_ids]


def test_models_are_built_on_their_device_not_moved_there(from_pretrained_calls: list[dict], tiny_dirs) -> None:
    pair = load(*tiny_dirs, device="cpu")
    assert [c["device_map"] for c in from_pretrained_calls] == [CPU, CPU]  # draft, target
    assert all(p.device == CPU for m in (pair.draft, pair.target) for p in m.parameters())


def test_device_map_auto_splits_the_target_and_puts_the_draft_on_its_first_device(
    from_pretrained_calls: list[dict], tiny_dirs, tiny_pair
) -> None:
    pair = load(*tiny_dirs, device="auto", device_map="auto")  # the first GPU where there is one, else the CPU
    target_call, draft_call = from_pretrained_calls  # the target first: the draft follows its first device
    assert target_call["source"] == tiny_dirs[1] and target_call["device_map"] == "auto"
    main = torch.device("cuda", 0) if torch.cuda.is_available() else CPU
    assert draft_call["source"] == tiny_dirs[0] and draft_call["device_map"] == pair.device == main
    assert devices_mod.first_device(pair.target) == main and next(pair.draft.parameters()).device == main
    for method in ("ar", "sd", "mtad"):  # the split pair decodes exactly as the one-device pair
        greedy = Settings(method=method, greedy=True, max_new_tokens=12)
        assert _tokens(pair, greedy) == _tokens(tiny_pair, greedy)


def test_a_cpu_asked_for_by_name_keeps_the_pair_whole_on_it(from_pretrained_calls: list[dict], tiny_dirs) -> None:
    # accelerate's "auto" would put the target on a GPU where there is one (seen on an H100)
    pair = load(*tiny_dirs, device="cpu", device_map="auto")
    assert [c["device_map"] for c in from_pretrained_calls] == [CPU, CPU] and pair.device == CPU
    assert all(p.device == CPU for m in (pair.draft, pair.target) for p in m.parameters())


def test_cuda_attention_is_kept_off_cudnn() -> None:
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        devices_mod.use_cuda_kernels()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_pair_loaded_on_cuda_turns_cudnn_attention_off(tiny_dirs) -> None:
    torch.backends.cuda.enable_cudnn_sdp(True)
    pair = load(*tiny_dirs, device="cuda")
    assert pair.device.type == "cuda" and not torch.backends.cuda.cudnn_sdp_enabled()


def test_device_map_from_the_operator_and_the_cli(monkeypatch: pytest.MonkeyPatch, from_pretrained_calls) -> None:
    monkeypatch.setenv("MTAD_DEVICE_MAP", "auto")
    assert resolve_device_map(None) == "auto" and resolve_device_map("none") is None
    load_pair("embedded", device="auto")
    assert from_pretrained_calls[0]["device_map"] == "auto"
    monkeypatch.setenv("MTAD_DEVICE_MAP", "balanced")
    with pytest.raises(PairError, match="device map must be auto or none; got 'balanced'"):
        load_pair("embedded", device="cpu")
    monkeypatch.delenv("MTAD_DEVICE_MAP")
    from_pretrained_calls.clear()
    args = ["generate", "--pair", "embedded", "--device-map", "auto", "--prompt", "def"]
    assert main([*args, "--max-new-tokens", "3", "--method", "ar", "--json"]) == 0
    assert from_pretrained_calls[0]["device_map"] == "auto"


def test_first_device_is_accelerates_main_device() -> None:
    one = types.SimpleNamespace(get_input_embeddings=lambda: torch.nn.Embedding(4, 2))
    assert devices_mod.first_device(one) == CPU
    split = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}
    assert devices_mod.first_device(types.SimpleNamespace(hf_device_map=split)) == torch.device("cuda:0")
    offloaded = {"model.embed_tokens": "cpu", "model.layers.0": 1, "lm_head": "disk"}
    assert devices_mod.first_device(types.SimpleNamespace(hf_device_map=offloaded)) == torch.device("cuda:1")
    on_cpu = {"model.embed_tokens": "cpu", "lm_head": "disk"}
    assert devices_mod.first_device(types.SimpleNamespace(hf_device_map=on_cpu)) == CPU


def test_without_onednn_s_bf16_path_bf16_is_not_native_and_auto_picks_fp32(
    monkeypatch: pytest.MonkeyPatch, cpu_caps
) -> None:
    """An AVX-512 or AMX CPU capped to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``) has the flags but not the path."""
    monkeypatch.delenv("MTAD_DTYPE", raising=False)
    cpu_caps(amx_bf16=True, avx512_bf16=True)
    monkeypatch.setattr(devices_mod, "onednn_runs", lambda dtype: dtype == torch.float32)
    assert auto_dtype(CPU) == torch.float32
    note = devices_mod.bf16_note(CPU, torch.bfloat16)
    assert note is not None and "no native bf16" in note and "--dtype float32" in note
    assert devices_mod.bf16_note(CPU, torch.float32) is None


def test_onednn_runs_fp32_where_torch_has_onednn_and_bf16_as_onednn_itself_says() -> None:
    assert devices_mod.onednn_runs(torch.float32) == torch.backends.mkldnn.is_available()
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert devices_mod.onednn_runs(torch.bfloat16) == native
    assert not devices_mod.onednn_runs(torch.float16)


def test_bf16_asked_for_on_a_cpu_without_native_bf16_runs_and_says_so(
    tiny_dirs, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """``--dtype bfloat16`` where bf16 is not native: the pair loads on a kernel that runs it, decodes, and
    the command line says why fp32 would be faster."""
    monkeypatch.setattr(devices_mod, "cpu_has_native_bf16", lambda cpuinfo=None: False)
    draft, target = tiny_dirs
    code = main(["generate", "--draft", draft, "--target", target, "--device", "cpu", "--dtype", "bfloat16",
                 "--prompt", "abc", "--max-new-tokens", "4", "--method", "mtad"])  # fmt: skip
    assert code == 0
    assert "no native bf16" in capsys.readouterr().err


def test_weight_bytes_count_what_a_forward_reads(tiny_pair):
    """Every weight once: a tied embedding is the output head's matrix, an untied input table is read one row
    at a time and left out."""
    from mtad.models.bandwidth import weight_bytes

    model = tiny_pair.target
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is table
    assert weight_bytes(model) == every - (0 if tied else table.numel() * table.element_size())


def test_read_bandwidth_is_measured_once_and_kept_in_the_cache(tmp_path, monkeypatch):
    import mtad.models.bandwidth as bw

    monkeypatch.setenv("MTAD_CACHE", str(tmp_path))
    bw.read_bandwidth.cache_clear()
    cpu = torch.device("cpu")
    rate = bw.read_bandwidth(cpu)
    _, path = bw.bandwidth_file(cpu)
    assert path.parent == tmp_path / "tuning" and json.loads(path.read_text())["bytes_per_second"] == rate > 1e8
    path.write_text(json.dumps({"bytes_per_second": 123.0}))  # a later process reads it back, measures nothing
    bw.read_bandwidth.cache_clear()
    assert bw.read_bandwidth(cpu) == 123.0
    bw.read_bandwidth.cache_clear()
    assert bw.measure_read_bandwidth(cpu, nbytes=2**20, reads=2) > 0
