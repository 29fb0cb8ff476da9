"""The linear-layer kernels a CPU model may run: the same products as F.linear, chosen by measurement
or by the operator, and decoding that gives the same tokens whichever runs."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import full_logits, needs_onednn_bf16
from torch import nn
from torch.nn import functional as F

from mtad.decoding import generate
from mtad.models import kernels
from mtad.models.cpu_linear import StationaryLinear
from mtad.models.errors import PairError
from mtad.models.kernels import OneDNNLinear, candidates, choose, probe, product, use_linear_kernel
from mtad.models.pair import ModelPair, load
from mtad.settings import Settings

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs PyTorch built with oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_product_equals_f_linear_in_fp32(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    lin = nn.Linear(64, 96, bias=bias)
    x = torch.randn(2, rows, 64, generator=gen)
    want = F.linear(x, lin.weight, lin.bias)
    got = OneDNNLinear(lin)(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, torch.zeros_like(got))


@needs_onednn_bf16
def test_onednn_product_in_bf16_is_one_rounding_from_the_exact_product() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    x = torch.randn(5, 64, generator=gen).bfloat16()
    got = product("onednn", w)(x)
    exact = x.float() @ w.float().t()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, rtol=2 * 2**-8, atol=2e-2)


def test_candidates_follow_the_dtype() -> None:
    assert "stationary" not in candidates(torch.float32)  # a bf16 kernel: 4x slower than mkl without native bf16
    assert "stationary" in candidates(torch.bfloat16) and candidates(torch.float16) == ("mkl",)
    assert candidates(torch.float32)[0] == "mkl"


def test_probe_times_every_kernel_at_every_row_count() -> None:
    w = torch.randn(48, 32)
    timed = probe([w], ("mkl", "onednn") if torch.backends.mkldnn.is_available() else ("mkl",), rows=(1, 3))
    assert all(set(by_rows) == {1, 3} and all(t > 0 for t in by_rows.values()) for by_rows in timed.values())


def test_the_operator_names_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    monkeypatch.setenv("MTAD_CPU_LINEAR", "mkl")
    assert choose(model) == "mkl"
    monkeypatch.setenv("MTAD_CPU_LINEAR", "stationary")
    with pytest.raises(ValueError, match="cannot run torch.float32 here"):
        choose(model)
    monkeypatch.setenv("MTAD_CPU_LINEAR", "fast")
    with pytest.raises(ValueError, match="MTAD_CPU_LINEAR must be auto or one of mkl, stationary, onednn"):
        choose(model)


def test_a_bad_kernel_name_is_a_pair_error(tiny_dirs: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTAD_CPU_LINEAR", "fast")
    with pytest.raises(PairError, match="MTAD_CPU_LINEAR"):
        load(*tiny_dirs, device="cpu", dtype="float32")


def test_auto_picks_a_kernel_that_can_run_the_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MTAD_CPU_LINEAR", raising=False)
    for dtype in (torch.float32, torch.bfloat16):
        model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64)).to(dtype)
        assert choose(model) in candidates(dtype)


def test_swapping_keeps_parameters_ties_and_values() -> None:
    emb = nn.Embedding(10, 6)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 6, bias=False), nn.Linear(6, 10, bias=False))
    model[3].weight = emb.weight  # a tied head
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    x = torch.randn(3, 6)
    with torch.inference_mode():
        want = model(x)
    kinds = ("onednn", "stationary", "mkl") if torch.backends.mkldnn.is_available() else ("stationary", "mkl")
    types = {"onednn": OneDNNLinear, "stationary": StationaryLinear, "mkl": nn.Linear}
    for kernel in kinds:
        use_linear_kernel(model, kernel)
        assert {type(model[i]) for i in (0, 2, 3)} == {types[kernel]}
        assert model[3].weight is emb.weight
        assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
        with torch.inference_mode():
            torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)


@needs_onednn
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_onednn_bf16)])
def test_a_pair_on_onednn_keeps_its_logits(tiny_dirs, monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    """The prepacked kernel changes the speed, not the model: logits match the plain kernel's."""
    monkeypatch.setenv("MTAD_CPU_LINEAR", "mkl")
    plain = load(*tiny_dirs, device="cpu", dtype=dtype)
    monkeypatch.setenv("MTAD_CPU_LINEAR", "onednn")
    packed = load(*tiny_dirs, device="cpu", dtype=dtype)
    assert {type(m) for m in packed.target.modules() if isinstance(m, nn.Linear)} == {OneDNNLinear}
    ids = packed.encode("hello wor")
    tol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(full_logits(packed.target, ids), full_logits(plain.target, ids), rtol=tol, atol=tol)


@needs_onednn
def test_greedy_speculative_equals_greedy_ar_on_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the embedded pair (trained, so drafts are accepted) with prepacked fp32 weights, the exact
    decoders in greedy mode (SD, SpecInfer) give greedy AR's tokens, and drafts were accepted."""
    from mtad.models.pair import load_pair

    monkeypatch.setenv("MTAD_CPU_LINEAR", "onednn")
    pair = load_pair("embedded", device="cpu", dtype="float32")
    assert pair.kernels == {"draft": "onednn", "target": "onednn"}
    prompt = "def fibonacci(n):\n    "
    ar = generate(pair, prompt, Settings(method="ar", greedy=True, max_new_tokens=40)).new_ids
    for method in ("sd", "specinfer"):
        run = generate(pair, prompt, Settings(method=method, greedy=True, max_new_tokens=40))
        assert run.new_ids == ar
        assert sum(s.accepted for s in run.steps) > 0


@needs_onednn
def test_a_prepacked_layer_survives_a_deep_copy_and_a_dtype_change() -> None:
    import copy

    lin = OneDNNLinear(nn.Linear(32, 16))
    x = torch.randn(4, 32)
    with torch.inference_mode():
        want = F.linear(x, lin.weight, lin.bias)
        twin = copy.deepcopy(lin)
        assert twin.weight is not lin.weight
        torch.testing.assert_close(twin(x), want, rtol=1e-5, atol=1e-5)
        half = copy.deepcopy(lin).to(torch.bfloat16)
        got = half(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_the_report_times_every_kernel_and_names_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    from mtad.kernel_report import main

    assert main(["--pair", "embedded", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split()[0] for line in out[2:-1]]
    assert rows == list(candidates(torch.float32))
    assert out[-1].split(": ")[1] in rows
    for line in out[2:-1]:
        one, five, ratio = float(line.split()[3]), float(line.split()[5]), float(line.split()[-1])
        # the times are printed to 0.1 ms and the ratio (to 0.01) from the unrounded ones
        assert (
            one > 0
            and five > 0
            and (five - 0.05) / (one + 0.05) - 0.005 <= ratio <= (five + 0.05) / (one - 0.05) + 0.005
        )


def test_the_thread_count_is_measured_or_taken_from_the_environment(
    tiny_pair: ModelPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``MTAD_CPU_THREADS`` the count is the operator's, unmeasured; without, it is one of the
    counts measured (all cores but one, or all) and torch runs on it."""
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("MTAD_CPU_THREADS", "1")
        torch.set_num_threads(1)
        monkeypatch.setattr(kernels, "probe", lambda *a, **k: pytest.fail("measured despite MTAD_CPU_THREADS"))
        assert kernels.choose_threads(tiny_pair.target) == 1
        monkeypatch.undo()
        monkeypatch.delenv("MTAD_CPU_THREADS", raising=False)
        cores = os.cpu_count() or 1
        calls = []
        real = kernels.probe

        def counted(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            calls.append(torch.get_num_threads())
            return real(*args, **kw)

        monkeypatch.setattr(kernels, "probe", counted)
        chosen = kernels.choose_threads(tiny_pair.target)
        assert chosen == torch.get_num_threads() and chosen in {max(1, cores - 1), cores}
        if cores > 1:
            assert sorted(set(calls)) == [cores - 1, cores] and len(calls) == 4, calls
    finally:
        torch.set_num_threads(before)


def test_a_cpu_without_onednn_s_bf16_path_is_never_offered_it(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN cannot run bf16 (an AVX2-only CPU), no kernel choice reaches its bf16 reorder: auto
    picks among the others, naming it is refused with the reason, and a oneDNN layer moved to bf16 runs
    PyTorch's own product."""
    monkeypatch.setattr(kernels, "onednn_runs", lambda dtype: dtype == torch.float32)
    assert "onednn" not in candidates(torch.bfloat16) and "onednn" in candidates(torch.float32)
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64)).bfloat16()
    with pytest.raises(ValueError, match=r"onednn linear kernel cannot run torch.bfloat16 here: oneDNN's bf16 path"):
        use_linear_kernel(model, "onednn")
    with pytest.raises(ValueError, match="cannot run torch.bfloat16 here"):
        product("onednn", model[0].weight)
    monkeypatch.delenv("MTAD_CPU_LINEAR", raising=False)
    assert choose(model) in ("mkl", "stationary")
    monkeypatch.setenv("MTAD_CPU_LINEAR", "onednn")
    with pytest.raises(PairError, match="MTAD_CPU_LINEAR=onednn cannot run torch.bfloat16 here"):
        load(*tiny_dirs, device="cpu", dtype="bfloat16")
    layer = OneDNNLinear(nn.Linear(64, 32))
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", None)  # reordering again would fail
    layer.bfloat16()
    x = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
