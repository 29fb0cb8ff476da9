"""GPU energy from NVML: the total-energy counter, a power-integration fallback, or "unavailable".

``EnergyMeter`` measures one window (``start``/``stop`` or ``with``): joules from NVML's
total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ, Volta and newer) read before
and after; where the counter is not supported, the trapezoid integral of
``nvmlDeviceGetPowerUsage`` (mW) sampled by a background thread. ``PowerSampler`` keeps the
(seconds, watts) series for live plots. On the CPU, or without NVML, both say so (``available``
is False, ``reason`` says why) and a reading carries ``joules=None``: never 0, never a guess.

NVML numbers GPUs in its own (PCI) order and ignores ``CUDA_VISIBLE_DEVICES``, so the torch
device is matched to its NVML handle by PCI bus id, else through the ``CUDA_VISIBLE_DEVICES`` list.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

COUNTER_REFRESH_S = 0.1
"""The energy counter (and the power reading) refresh every 20-100 ms: shorter windows are not measured."""
FALLBACK_HZ = 20.0
"""Power samples per second when integrating power (the design asks for at least 10)."""

SOURCE_COUNTER = "nvml-counter"
SOURCE_POWER = "nvml-power"
SOURCE_UNAVAILABLE = "unavailable"

_nvml_lock = threading.Lock()
_nvml_ready = False


@dataclass
class EnergyReading:
    """The energy of one window. ``joules`` is None when it could not be measured (``note`` says why)."""

    joules: float | None
    seconds: float
    source: str
    note: str | None = None

    def to_dict(self) -> dict:
        """Plain dict for JSON."""
        return {"joules": self.joules, "seconds": self.seconds, "source": self.source, "note": self.note}


def trapezoid_joules(samples: Sequence[tuple[float, float]]) -> float | None:
    """Integrate (seconds, watts) samples with the trapezoid rule; None for fewer than two samples.

    Samples must be in time order; a pair with a non-increasing time adds nothing.
    """
    if len(samples) < 2:
        return None
    total = 0.0
    for (t0, w0), (t1, w1) in zip(samples, samples[1:], strict=False):
        if t1 > t0:
            total += 0.5 * (w0 + w1) * (t1 - t0)
    return total


def short_window_note(seconds: float, refresh: float = COUNTER_REFRESH_S) -> str | None:
    """The caveat for a window shorter than the counter's refresh, or None for a long enough one."""
    if seconds >= refresh:
        return None
    return (
        f"window shorter than the counter's refresh (~20-100 ms): {seconds * 1000:.0f} ms is too short "
        f"to measure, so no energy figure is given; measure a window of at least {refresh * 1000:.0f} ms"
    )


def coarse_window_note(seconds: float, refresh: float = COUNTER_REFRESH_S) -> str | None:
    """The caveat for a window that is measurable but spans fewer than ten refreshes of the counter."""
    if seconds >= 10 * refresh or seconds < refresh:
        return None
    return (
        f"window of {seconds * 1000:.0f} ms spans fewer than ten refreshes of the counter (~20-100 ms): "
        f"the figure may be off by up to one refresh interval"
    )


def pci_bus_id(domain: int, bus: int, device: int) -> str:
    """NVML's PCI bus id string, e.g. ``00000000:3B:00.0``."""
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def visible_device_token(torch_index: int, visible: str | None) -> int | str | None:
    """What ``CUDA_VISIBLE_DEVICES`` says torch device ``torch_index`` is: an NVML index (int),
    a UUID (``GPU-...``/``MIG-...``) or None when the list does not say (then the index is NVML's)."""
    if visible is None or not visible.strip():
        return torch_index if visible is None else None
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if torch_index >= len(items):
        return None
    item = items[torch_index]
    return int(item) if item.isdigit() else item


def _sync(device: torch.device) -> None:
    """Wait for queued CUDA work so it is billed to the window that launched it."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _init_nvml() -> Any:
    """Import and initialise NVML once per process (NVML reference-counts init; we never shut it down)."""
    global _nvml_ready
    import pynvml

    with _nvml_lock:
        if not _nvml_ready:
            pynvml.nvmlInit()
            _nvml_ready = True
    return pynvml


def _handle_for(nvml: Any, index: int) -> Any:
    """The NVML handle of torch CUDA device ``index``: by PCI bus id, else by CUDA_VISIBLE_DEVICES."""
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, int):
        bus_id = pci_bus_id(
            int(getattr(props, "pci_domain_id", 0) or 0), bus, int(getattr(props, "pci_device_id", 0) or 0)
        )
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId_v2(bus_id)
        except (nvml.NVMLError, AttributeError):
            pass
    token = visible_device_token(index, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if isinstance(token, str):
        return nvml.nvmlDeviceGetHandleByUUID(token)
    return nvml.nvmlDeviceGetHandleByIndex(index if token is None else token)


def open_device(device: torch.device | str) -> tuple[Any, Any, str | None]:
    """(nvml module, handle, None) for a CUDA device NVML can read, else (None, None, reason)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None, None, f"no GPU: running on {dev.type}"
    if not torch.cuda.is_available():
        return None, None, "no GPU: CUDA is not available on this machine"
    try:
        nvml = _init_nvml()
    except ImportError as exc:
        return None, None, f"NVML not available: {exc} (install nvidia-ml-py)"
    except Exception as exc:  # pynvml.NVMLError and friends: no driver, no library
        return None, None, f"NVML not available: {exc}"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    try:
        return nvml, _handle_for(nvml, index), None
    except Exception as exc:
        return None, None, f"NVML not available: cannot find cuda:{index} in NVML ({exc})"


def _read_counter_mj(nvml: Any, handle: Any) -> float:
    return float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))


def _read_watts(nvml: Any, handle: Any) -> float:
    return float(nvml.nvmlDeviceGetPowerUsage(handle)) / 1000.0


class PowerSampler:
    """Sample the GPU's power draw (watts) on a background thread for live plots."""

    def __init__(self, device: torch.device | str = "cuda", hz: float = FALLBACK_HZ) -> None:
        if not hz > 0:
            raise ValueError(f"sampling rate must be > 0 Hz; got {hz}")
        self.device = torch.device(device)
        self.hz = float(hz)
        self._nvml, self._handle, self.reason = open_device(self.device)
        if self._nvml is not None:
            try:
                _read_watts(self._nvml, self._handle)
            except Exception as exc:
                self._nvml, self._handle = None, None
                self.reason = f"this GPU does not report its power draw through NVML ({exc})"
        self.available = self._nvml is not None
        self._samples: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self) -> None:
        """Forget earlier samples and start sampling (a no-op when unavailable)."""
        self.stop()
        with self._lock:
            self._samples = []
        if not self.available:
            return
        self._stop.clear()
        self._t0 = time.perf_counter()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="mtad-power-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling with one last sample taken now, not after the thread wakes (samples stay readable)."""
        if self._thread is None:
            return
        self._stop.set()
        self._sample(final=True)
        self._thread.join()
        self._thread = None

    def samples(self) -> list[tuple[float, float]]:
        """A snapshot of (seconds since start, watts), safe to call while sampling."""
        with self._lock:
            return list(self._samples)

    def _loop(self) -> None:
        period = 1.0 / self.hz
        while not self._stop.wait(period):
            self._sample()

    def _sample(self, final: bool = False) -> None:
        try:
            watts = _read_watts(self._nvml, self._handle)
        except Exception:
            return  # a missed sample only lowers the resolution
        with self._lock:
            if final or not self._stop.is_set():  # nothing lands after the final sample
                self._samples.append((time.perf_counter() - self._t0, watts))


class EnergyMeter:
    """Joules over a window on one GPU: ``start()``/``stop()``, or ``with EnergyMeter(dev) as m:`` then
    ``m.reading``. Uses the energy counter when the GPU has one, else integrates sampled power."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        self._nvml, self._handle, self.reason = open_device(self.device)
        self.source = SOURCE_UNAVAILABLE
        self._sampler: PowerSampler | None = None
        if self._nvml is not None:
            self.source, self.reason = self._probe()
        self.available = self.source != SOURCE_UNAVAILABLE
        self.reading: EnergyReading | None = None
        self._t0: float | None = None
        self._e0 = 0.0

    def _probe(self) -> tuple[str, str | None]:
        """Which NVML reading this GPU supports: the counter first, then power."""
        try:
            _read_counter_mj(self._nvml, self._handle)
            return SOURCE_COUNTER, None
        except Exception as counter_exc:
            try:
                _read_watts(self._nvml, self._handle)
            except Exception as power_exc:
                return SOURCE_UNAVAILABLE, (
                    f"this GPU reports neither its energy counter ({counter_exc}) nor its power draw ({power_exc})"
                )
            self._sampler = PowerSampler(self.device, hz=FALLBACK_HZ)
            return SOURCE_POWER, None

    def start(self) -> None:
        """Begin a window: synchronise the device, then read the counter (or start sampling power)."""
        _sync(self.device)
        self.reading = None
        if self.source == SOURCE_COUNTER:
            self._e0 = _read_counter_mj(self._nvml, self._handle)
        elif self.source == SOURCE_POWER:
            self._sampler.start()
        self._t0 = time.perf_counter()

    def stop(self) -> EnergyReading:
        """End the window: synchronise, read, and return (and keep in ``reading``) its energy."""
        if self._t0 is None:
            raise RuntimeError("EnergyMeter.stop() called before start()")
        _sync(self.device)
        seconds = time.perf_counter() - self._t0
        self._t0 = None
        if self.source == SOURCE_COUNTER:
            self.reading = self._counter_reading(seconds)
        elif self.source == SOURCE_POWER:
            self.reading = self._power_reading(seconds)
        else:
            self.reading = EnergyReading(None, seconds, SOURCE_UNAVAILABLE, self.reason)
        return self.reading

    def _counter_reading(self, seconds: float) -> EnergyReading:
        e1 = _read_counter_mj(self._nvml, self._handle)
        note = short_window_note(seconds)
        if note is not None:
            return EnergyReading(None, seconds, SOURCE_COUNTER, note)
        if e1 < self._e0:
            return EnergyReading(None, seconds, SOURCE_COUNTER, "the energy counter went backwards (driver reset?)")
        return EnergyReading((e1 - self._e0) / 1000.0, seconds, SOURCE_COUNTER, coarse_window_note(seconds))

    def _power_reading(self, seconds: float) -> EnergyReading:
        self._sampler.stop()
        note = short_window_note(seconds)
        if note is not None:
            return EnergyReading(None, seconds, SOURCE_POWER, note)
        joules = trapezoid_joules(self._sampler.samples())
        if joules is None:
            return EnergyReading(None, seconds, SOURCE_POWER, "too few power samples to integrate")
        return EnergyReading(joules, seconds, SOURCE_POWER, f"integrated from power sampled at {FALLBACK_HZ:g} Hz")

    def __enter__(self) -> EnergyMeter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
