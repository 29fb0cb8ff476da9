"""Where a decoder iteration's time goes: wall time, kernel launches outside CUDA graphs, graph replays, and the
operators that cost the host most.

``python scripts/profile_iterations.py --pair smollm2 --device cuda`` decodes one chat prompt with each decoder
three times: a warm-up (which compiles and captures the graphs), a timed run, and a run under
``torch.profiler``. On a GPU the launches outside graphs are what the host spends between forwards
(docs/journal/2026-11-26-h100-grown-draft.md; how to run it: docs/dev/gpu-checks.md, section 10). On a CPU there
are no launches and the table shows the host's operators.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtad.decoding import decode  # noqa: E402
from mtad.decoding.spec import check
from mtad.models.pair import ModelPair, load_pair  # noqa: E402
from mtad.settings import Settings  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def profile_method(pair: ModelPair, ids: list[int], settings: Settings, rows: int) -> str:
    """One decoder's report: its timed run per iteration, then its profiled run's launches and top operators."""
    list(decode(pair, ids, settings))
    t0 = time.perf_counter()
    timed = list(decode(pair, ids, settings))
    wall = time.perf_counter() - t0
    cuda = pair.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        steps = list(decode(pair, ids, settings))
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    replays = sum(e.count for e in events if e.key == "cudaGraphLaunch")
    tokens = sum(len(s.appended_ids) for s in timed)
    head = (
        f"### {settings.method}: {len(timed)} iterations, {tokens / len(timed):.2f} tokens each, "
        f"{wall / len(timed) * 1e3:.2f} ms each ({tokens / wall:.1f} tokens/s); profiled run: {len(steps)} "
        f"iterations, {launches / len(steps):.1f} kernel launches outside graphs and {replays / len(steps):.1f} "
        f"graph replays an iteration"
    )
    if cuda:
        busy = sum(e.self_device_time_total for e in events) / 1e3
        head += f", the GPU busy {busy / len(steps):.2f} ms an iteration"
    return head + "\n" + events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--methods", default="ar,sd,mtad")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="Explain how a rainbow forms, in a short paragraph.")
    parser.add_argument("--rows", type=int, default=25, help="operators listed per decoder")
    args = parser.parse_args(argv)
    pair = load_pair(args.pair, device=args.device)
    name = torch.cuda.get_device_name(pair.device) if pair.device.type == "cuda" else "cpu"
    print(f"{args.pair} on {name}: {pair.engine} engine, {pair.dtype}, torch {torch.__version__}", flush=True)
    ids = pair.encode(args.prompt)
    for method in args.methods.split(","):
        settings = check(Settings(method=method, max_new_tokens=args.max_new_tokens, seed=0))
        print(profile_method(pair, ids, settings, args.rows), flush=True)


if __name__ == "__main__":
    main()
