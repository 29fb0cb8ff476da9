"""The target's weight-read bound: the seconds that reading its weights once takes on this device.

A one-token forward reads every weight of the target once; at batch 1 memory is the limit, and no forward can
be faster than the weights' bytes over the device's read bandwidth. The bandwidth is measured once per machine
(a large tensor summed, the fastest of a few reads) and kept beside the tuning data under the cache directory.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from mtad.models.devices import device_model
from mtad.models.gguf_cache import cache_root

READ_BYTES = 256 * 2**20
"""Bytes read per measurement: far larger than any CPU cache, so the reads come from memory."""
READS = 5


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a one-token forward reads: every parameter and int8 weight buffer once, less the input embedding
    table when it is not the output's (a forward reads one row of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith("qweight"))
    get_in, get_out = (getattr(model, f, None) for f in ("get_input_embeddings", "get_output_embeddings"))
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if embedding is not None and (head is None or head.weight is not embedding.weight):
        total -= embedding.weight.numel() * embedding.weight.element_size()
    return total


def measure_read_bandwidth(device: torch.device, nbytes: int = READ_BYTES, reads: int = READS) -> float:
    """Bytes per second this device reads memory at, with this process's threads: the fastest of ``reads``
    sums over a float32 tensor of ``nbytes`` (after one untimed sum)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for i in range(reads + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        x.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def bandwidth_file(device: torch.device) -> tuple[dict, Path]:
    """The measurement's key (what the bandwidth depends on) and where it is kept."""
    key = {"device": device_model(device), "type": device.type, "threads": torch.get_num_threads()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return key, cache_root() / "tuning" / f"bandwidth-{digest}.json"


@functools.cache
def read_bandwidth(device: torch.device) -> float:
    """This machine's read bandwidth (bytes/s), measured on first use and then read from the cache directory."""
    key, path = bandwidth_file(device)
    with contextlib.suppress(OSError, ValueError, KeyError):
        return float(json.loads(path.read_text())["bytes_per_second"])
    measured = measure_read_bandwidth(device)
    with contextlib.suppress(OSError):  # a read-only cache only costs the next process a measurement
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"key": key, "date": datetime.now(UTC).isoformat(timespec="seconds"), "bytes_per_second": measured}
        path.write_text(json.dumps(record, indent=1) + "\n")
    return measured


def weight_read_seconds(model: torch.nn.Module, device: torch.device) -> float:
    """The weight-read bound of one token: the model's :func:`weight_bytes` over the device's read bandwidth."""
    return weight_bytes(model) / read_bandwidth(torch.device(device))
