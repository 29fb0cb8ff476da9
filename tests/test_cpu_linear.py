"""The weight-first bf16 product: same values as ``F.linear``, swapped in only where it is used."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mtad.models.cpu_linear import StationaryLinear, stationary_linear
from mtad.models.kernels import use_linear_kernel
from mtad.models.pair import load


@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 5, 64), (8, 1, 64), (3, 64), (2, 9, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_product_equals_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).bfloat16()
    w = torch.randn(96, 64, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    got, want = stationary_linear(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    # both accumulate in fp32 and round once to bf16: at most one bf16 step apart
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * 2**-8, atol=1e-2)
    exact = (x.float().reshape(-1, 64) @ w.float().t()).reshape(want.shape) + (b.float() if bias else 0)
    assert (got.float() - exact).abs().max() <= (want.float() - exact).abs().max() * 1.5 + 1e-2


def test_other_dtypes_and_autograd_take_f_linear_exactly() -> None:
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    assert torch.equal(stationary_linear(x, w), F.linear(x, w))
    xb = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)
    wb = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    out = stationary_linear(xb, wb)
    assert torch.equal(out, F.linear(xb, wb))
    out.float().sum().backward()
    assert xb.grad is not None and wb.grad is not None


def test_swap_keeps_parameters_and_ties() -> None:
    emb = nn.Embedding(10, 6)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 6, bias=False), nn.Linear(6, 10, bias=False))
    model[3].weight = emb.weight  # a tied head
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    x = torch.randn(3, 6)
    want = model(x)
    assert use_linear_kernel(model, "stationary") == 3
    assert all(type(m) is StationaryLinear for m in (model[0], model[2], model[3]))
    assert model[3].weight is emb.weight
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    assert torch.equal(model(x), want)  # fp32: the same F.linear
    assert use_linear_kernel(model, "stationary") == 0  # nothing left to swap


def test_bf16_cpu_pairs_get_the_kernel_they_are_told(
    tiny_dirs: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def linears(model: nn.Module) -> set[type]:
        return {type(m) for m in model.modules() if isinstance(m, nn.Linear)}

    monkeypatch.setenv("MTAD_CPU_LINEAR", "stationary")
    bf16 = load(*tiny_dirs, device="cpu", dtype="bfloat16")
    assert linears(bf16.target) == {StationaryLinear} and linears(bf16.draft) == {StationaryLinear}
    assert bf16.kernels == {"draft": "stationary", "target": "stationary"}
    monkeypatch.setenv("MTAD_CPU_LINEAR", "mkl")
    fp32 = load(*tiny_dirs, device="cpu", dtype="float32")
    assert linears(fp32.target) == {nn.Linear} and fp32.kernels == {"draft": "mkl", "target": "mkl"}
