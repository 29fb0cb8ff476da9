"""Pair loading: presets, device/dtype choice, incompatible pairs, and the Hub offline path."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from mtad.cli import main
from mtad.models.devices import resolve_device, resolve_dtype
from mtad.models.errors import PairError
from mtad.models.pair import load, load_pair
from mtad.models.presets import presets

PAPER_PAIRS = {("facebook/opt-125m", "facebook/opt-13b"), ("JackFram/llama-68m", "meta-llama/Llama-2-13b-hf")}


def test_presets_file_names_every_field() -> None:
    table = presets()
    assert "embedded" in table
    for p in table.values():
        assert p.draft and p.target and p.description
    hub = {(p.draft, p.target) for p in table.values() if p.needs_hub}
    assert PAPER_PAIRS <= hub
    assert any("Qwen" in p.target for p in table.values())
    embedded = table["embedded"]
    assert Path(embedded.draft).is_absolute() and embedded.draft.endswith("models/draft")


def test_operator_presets_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_dirs: tuple[str, str]) -> None:
    f = tmp_path / "pairs.toml"
    f.write_text(f'[pairs.mine]\ndraft = "{tiny_dirs[0]}"\ntarget = "{tiny_dirs[1]}"\ndescription = "tiny"\n')
    monkeypatch.setenv("MTAD_PAIRS", str(f))
    assert list(presets()) == ["mine"] and not presets()["mine"].needs_hub
    pair = load_pair("mine", device="cpu")
    assert pair.name == "mine" and pair.vocab_size == 64
    with pytest.raises(PairError, match="unknown pair 'embedded'; the presets are: mine"):
        load_pair("embedded")
    f.write_text('[pairs.broken]\ndraft = "x/y"\n')
    with pytest.raises(PairError, match="lacks target, description"):
        presets()


def test_hub_preset_offline_says_so_quickly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The network is unreachable here (and HF_HUB_OFFLINE may be set): a clear message, fast."""
    for offline in ("1", "0"):
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        import huggingface_hub.constants as c

        monkeypatch.setattr(c, "HF_HUB_OFFLINE", offline == "1")
        t0 = time.perf_counter()
        with pytest.raises(PairError) as err:
            load_pair("opt-13b")
        assert time.perf_counter() - t0 < 30
        msg = str(err.value)
        assert "needs the Hugging Face Hub" in msg and "'embedded'" in msg and "facebook/opt" in msg


def test_cli_unknown_pair_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--pair", "nope", "--prompt", "x"]) == 2
    assert "unknown pair 'nope'" in capsys.readouterr().err


def test_device_and_dtype_choice() -> None:
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    # auto dtype by hardware: tests/test_devices.py
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(PairError, match="dtype must be"):
        resolve_dtype("int3", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(PairError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_loads_with_chosen_dtype_and_never_remote_code(tiny_dirs: tuple[str, str]) -> None:
    pair = load(*tiny_dirs, device="cpu", dtype="bfloat16")
    assert pair.target.dtype == torch.bfloat16 and pair.draft.dtype == torch.bfloat16
    draft_params, target_params = pair.parameters()
    assert target_params > draft_params
    source = (Path(__file__).parent.parent / "mtad" / "models" / "pair.py").read_text()
    assert "trust_remote_code=True" not in source


def test_cpu_threads_leave_a_core_free(monkeypatch: pytest.MonkeyPatch, tiny_dirs: tuple[str, str]) -> None:
    from mtad.models.devices import configure_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("MTAD_CPU_THREADS", raising=False)  # the default is under test, not a caller's choice
    try:
        monkeypatch.setattr("os.cpu_count", lambda: 4)
        load(*tiny_dirs, device="cpu")
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("MTAD_CPU_THREADS", "2")
        assert configure_cpu_threads() == 2
        monkeypatch.setenv("MTAD_CPU_THREADS", "many")
        with pytest.raises(PairError, match="MTAD_CPU_THREADS"):
            configure_cpu_threads()
    finally:
        torch.set_num_threads(before)
