"""``mtad kernels``: what each CPU linear-layer kernel costs here for a pair's target, and which one a load
would choose (:mod:`mtad.models.kernels` chooses by the same probe)."""

from __future__ import annotations

import argparse
import copy
import os

import torch

from mtad.models.devices import resolve_dtype
from mtad.models.kernels import candidates, forward_ms, probe, probe_weights, use_linear_kernel
from mtad.models.pair import load_pair


def main(argv: list[str] | None = None) -> int:
    """``mtad kernels``: what each linear kernel costs here for a pair's target, and which one a
    load would choose: the probe's figures, then whole forwards of 1 and 5 tokens with each kernel,
    the kernels alternating (medians of 7 rounds)."""
    ap = argparse.ArgumentParser(prog="mtad kernels", description=main.__doc__.splitlines()[0])
    ap.add_argument("--pair", default="embedded")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    os.environ["MTAD_CPU_LINEAR"] = "mkl"  # load plain, then try each kernel on the same weights
    pair = load_pair(args.pair, device="cpu", dtype=args.dtype)
    os.environ.pop("MTAD_CPU_LINEAR")
    target = pair.target
    dtype = resolve_dtype(args.dtype, pair.device)
    allowed = candidates(dtype)
    print(
        f"{args.pair} target, {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} thread(s), "
        f"PyTorch dispatches to {torch.backends.cpu.get_cpu_capability()}"
    )
    timed = probe(probe_weights(target), allowed)
    models = {}
    for k in allowed:
        models[k] = copy.deepcopy(target)
        use_linear_kernel(models[k], k)
    fwd = forward_ms(models)
    print(
        f"{'kernel':12s} {'probe 1 row':>12s} {'probe 5 rows':>13s} {'forward 1 tok':>14s} {'forward 5 tok':>14s} {'5 / 1':>6s}"
    )
    for k in allowed:
        one, five = fwd[k][1], fwd[k][5]
        print(
            f"{k:12s} {timed[k][1] * 1e6:10.0f}µs {timed[k][5] * 1e6:11.0f}µs {one:11.1f} ms {five:11.1f} ms {five / one:6.2f}"
        )
    print(f"a load would choose: {min(allowed, key=lambda k: sum(timed[k].values()))}")
    return 0
