"""Where and how a pair computes: the device, the dtype, CPU threads, device maps and the faster kernels."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from pathlib import Path

import torch

from mtad.models.errors import PairError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | None = "auto") -> torch.device:
    """CUDA when there is one, else the CPU; an explicit choice wins, checked against this machine's GPUs."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PairError(f"device must be auto, cpu, cuda or cuda:N; got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise PairError(f"device must be auto, cpu, cuda or cuda:N; got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PairError(f"device {device!r} asked for, but this machine has no CUDA GPU; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= (count := torch.cuda.device_count()):
        raise PairError(
            f"device {device!r} asked for, but this machine has {count} CUDA GPU{'s' if count != 1 else ''} "
            f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})"
        )
    return dev


def configure_cpu_threads() -> int:
    """Use all cores but one for torch's intra-op threads on the CPU (``MTAD_CPU_THREADS`` overrides).

    On a machine with one core busy elsewhere (a web server, a second job), torch's threads on every core
    spin on a descheduled peer and run far slower than one thread. Leaving a core free keeps the UI
    responsive and the timings honest.
    """
    wanted = os.environ.get("MTAD_CPU_THREADS")
    try:
        n = int(wanted) if wanted else max(1, (os.cpu_count() or 1) - 1)
    except ValueError as exc:
        raise PairError(f"MTAD_CPU_THREADS must be a whole number of threads; got {wanted!r}") from exc
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's instruction-set flags, lower case, in PyTorch's spelling (``avx512_f``, ``avx512_bf16``,
    ``amx_bf16``, …): PyTorch's own reading where it has one, else ``/proc/cpuinfo``'s (empty where neither
    says)."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        return {name for name, present in caps().items() if present is True}
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return set()
    return {CPUINFO_SPELLING.get(f, f) for f in flags}


CPUINFO_SPELLING = {"avx512f": "avx512_f", "fma": "fma3"}
"""``/proc/cpuinfo``'s names that PyTorch spells otherwise."""


CAPPED_ISA = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
"""Variables that cap a CPU's instruction sets (how an AVX2-only CPU is emulated on a newer one)."""


def capped_isa() -> dict[str, str]:
    """The instruction-set caps this process runs under, by variable (empty when none is set)."""
    return {v: os.environ[v] for v in CAPPED_ISA if v in os.environ}


def device_model(dev: torch.device) -> str:
    """The GPU's name, or the CPU's model name from /proc/cpuinfo (else the platform's word for it)."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when this process computes bf16 natively (AMX-BF16 or AVX512-BF16, and not capped to fewer
    instructions by :data:`CAPPED_ISA`), where it is no slower than fp32."""
    return bool(cpu_flags(cpuinfo) & {"amx_bf16", "avx512_bf16"}) and onednn_runs(torch.bfloat16)


def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked products (``torch.ops.mkldnn``) can run ``dtype`` in this process: fp32
    wherever PyTorch has oneDNN, bf16 only with AVX512-BW/VL/DQ or AVX-NE-CONVERT, and not under
    ``ONEDNN_MAX_CPU_ISA=AVX2``, as oneDNN itself decides."""
    if dtype == torch.float32:
        return torch.backends.mkldnn.is_available()
    return dtype == torch.bfloat16 and _onednn_runs_bf16()


@functools.cache
def _onednn_runs_bf16() -> bool:
    """oneDNN's own answer for bf16, read once: the instruction sets cannot change within a process."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_note(device: torch.device, dtype: torch.dtype) -> str | None:
    """A sentence saying that bf16 runs emulated on this CPU (it works, slower than fp32), or None."""
    if device.type != "cpu" or dtype != torch.bfloat16 or cpu_has_native_bf16():
        return None
    return (
        "this CPU has no native bf16 (AVX512-BF16 or AMX) usable here, so bf16 runs on PyTorch's own "
        "products, converted in software and slower than fp32; --dtype float32 is faster"
    )


def auto_dtype(device: torch.device) -> torch.dtype:
    """What a device computes best: bf16 on CUDA from compute capability 8.0 (Ampere) on, fp16 below it
    (a T4 only emulates bf16); on the CPU bf16 where it is native, else fp32."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, preset: str | None = None) -> torch.dtype:
    """An explicit dtype wins, then the operator's ``MTAD_DTYPE``, then the preset's own, else :func:`auto_dtype`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        dtype = os.environ.get("MTAD_DTYPE") or preset or "auto"
        if dtype == "auto":
            return auto_dtype(device)
    if dtype not in DTYPES:
        raise PairError(f"dtype must be auto or one of {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def resolve_device_map(device_map: str | None) -> str | None:
    """``"auto"`` (split the target over every GPU, then the CPU) or None (one device); ``MTAD_DEVICE_MAP``
    is the default."""
    value = device_map if device_map is not None else os.environ.get("MTAD_DEVICE_MAP") or None
    if value not in (None, "auto", "none"):
        raise PairError(f"device map must be auto or none; got {value!r}")
    return None if value == "none" else value


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA through pinned memory, without blocking (a copy from pageable
    memory would wait for the queued work: a host sync)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def first_device(model: torch.nn.Module) -> torch.device:
    """Where a (possibly split) model takes its input ids: accelerate's main device (the first GPU in its
    device map, else the CPU), or where the input embeddings are for a model on one device."""
    placed = getattr(model, "hf_device_map", None)
    if not placed:
        return model.get_input_embeddings().weight.device
    gpus = [d for d in placed.values() if d not in ("cpu", "disk")]
    main = gpus[0] if gpus else "cpu"
    return torch.device("cuda", main) if isinstance(main, int) else torch.device(main)


def use_cuda_kernels() -> None:
    """Keep scaled-dot-product attention off cuDNN on CUDA (process-wide), for flash or memory-efficient.

    torch sends SDPA to cuDNN first on Hopper and newer, and cuDNN builds an execution plan for every
    new shape; decoding meets a new key length at every step (and new row counts with beams), so each
    step would pay for a new plan.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)
