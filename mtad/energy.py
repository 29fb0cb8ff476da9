"""Energy per window: NVML's GPU energy counter, a power-integration fallback, the CPU's RAPL counter, or n/a.

``EnergyMeter`` measures one window (``start``/``stop`` or ``with``). On a GPU: joules from NVML's
total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ, Volta and newer) read before
and after; where the counter is not supported, the trapezoid integral of
``nvmlDeviceGetPowerUsage`` (mW) sampled by a background thread. On the CPU: the package energy
counters of Linux powercap (``/sys/class/powercap/intel-rapl:N/energy_uj``, wrapping at
``max_energy_range_uj``) where they are readable. ``PowerSampler`` keeps a (seconds, watts) series for
live plots, drawn from differences of the same counter where there is one (NVML's own power reading
is a one-second average on Ampere and newer, which smears a lane of a few seconds), else from the
power reading (``source`` says which). Without any of these, both say so (``available`` is False,
``reason`` says why) and a reading carries ``joules=None``: never 0, never a guess.

NVML numbers GPUs in its own (PCI) order and ignores ``CUDA_VISIBLE_DEVICES``, while CUDA numbers
them fastest first, so the torch device is matched to its NVML handle by PCI bus id, else through
the ``CUDA_VISIBLE_DEVICES`` list.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

COUNTER_REFRESH_S = 0.1
"""The energy counter (and the power reading) refresh every 20-100 ms: shorter windows are not measured."""
FALLBACK_HZ = 20.0
"""Power samples per second when integrating power (the design asks for at least 10)."""

COUNTER_POLL_HZ = 100.0
"""How often the live plot polls an energy counter: a point is drawn at each change it sees."""
POWERCAP_ROOT = Path("/sys/class/powercap")
"""Where Linux exposes the RAPL counters; ``MTAD_POWERCAP_ROOT`` points elsewhere (a host sysfs mounted
into a container, a fake tree in tests)."""

SOURCE_COUNTER = "nvml-counter"
SOURCE_POWER = "nvml-power"
SOURCE_RAPL = "rapl"
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
        try:  # the binding's name: it calls the C library's _v2 itself
            return nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        except nvml.NVMLError:
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


def _read_watts(nvml: Any, handle: Any) -> float:
    return float(nvml.nvmlDeviceGetPowerUsage(handle)) / 1000.0


class NvmlCounter:
    """NVML's total-energy counter of one GPU (mJ since the driver loaded; its refresh: :data:`COUNTER_REFRESH_S`)."""

    source = SOURCE_COUNTER

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle

    def read(self) -> tuple[int, ...]:
        """The raw counter value (a tuple, like RAPL's one value per package)."""
        return (int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)),)

    def joules(self, start: tuple[int, ...], end: tuple[int, ...]) -> float | None:
        """Energy between two reads; None when the counter went backwards (a driver reset)."""
        return None if end[0] < start[0] else (end[0] - start[0]) / 1000.0


@dataclass(frozen=True)
class RaplZone:
    """One CPU package's powercap counter file and the value at which it wraps to 0."""

    energy_file: Path
    max_range_uj: int


class RaplCounter:
    """The CPU packages' RAPL energy counters (µJ, refreshed about every millisecond), summed.

    Each counter wraps to 0 at its ``max_energy_range_uj``; one wrap per window is undone (a window
    long enough to wrap twice, hours at a server's power, would be undercounted).
    """

    source = SOURCE_RAPL

    def __init__(self, zones: Sequence[RaplZone]) -> None:
        self.zones = list(zones)

    def read(self) -> tuple[int, ...]:
        """Each package's counter, in µJ."""
        return tuple(int(z.energy_file.read_text()) for z in self.zones)

    def joules(self, start: tuple[int, ...], end: tuple[int, ...]) -> float | None:
        """Energy between two reads, undoing a wrap-around of any package's counter."""
        total = 0
        for zone, e0, e1 in zip(self.zones, start, end, strict=True):
            total += e1 - e0 if e1 >= e0 else e1 + zone.max_range_uj - e0
        return total / 1e6


def open_rapl(root: Path | None = None) -> tuple[RaplCounter | None, str | None]:
    """(counter, None) over the readable package zones under ``root``, else (None, reason); ``root``
    defaults to ``MTAD_POWERCAP_ROOT``, else ``POWERCAP_ROOT``.

    Only top-level ``intel-rapl:N`` zones named ``package-*`` count: their sub-zones (core, uncore,
    dram) and ``psys`` overlap them.
    """
    root = Path(root or os.environ.get("MTAD_POWERCAP_ROOT") or POWERCAP_ROOT)
    zones = []
    for zone in sorted(root.glob("intel-rapl:*")):
        if zone.name.count(":") != 1:
            continue
        try:
            name = (zone / "name").read_text().strip() if (zone / "name").exists() else "package"
            int((zone / "energy_uj").read_text())
            max_range = int((zone / "max_energy_range_uj").read_text())
        except (OSError, ValueError):
            continue
        if name.startswith("package"):
            zones.append(RaplZone(zone / "energy_uj", max_range))
    if not zones:
        return None, "no GPU: running on cpu, and no readable RAPL energy counter"
    return RaplCounter(zones), None


class PowerSampler:
    """Sample the device's power draw (watts) on a background thread for live plots.

    From an energy counter where there is one (NVML's total energy, or RAPL on the CPU): a point at
    each change of the counter, its energy difference over the time between; else (``source`` is
    ``nvml-power``) NVML's power reading, which on Ampere and newer is a one-second average.
    """

    def __init__(
        self, device: torch.device | str = "cuda", hz: float = FALLBACK_HZ, powercap_root: Path | None = None
    ) -> None:
        if not hz > 0:
            raise ValueError(f"sampling rate must be > 0 Hz; got {hz}")
        self.device = torch.device(device)
        self.hz = float(hz)
        self._counter: NvmlCounter | RaplCounter | None = None
        self._nvml: Any = None
        self._handle: Any = None
        if self.device.type == "cpu":
            self._counter, self.reason = open_rapl(powercap_root)
        else:
            nvml, handle, self.reason = open_device(self.device)
            if nvml is not None:
                self._counter, self.reason = _probe_counter(nvml, handle)
                if self._counter is None:
                    try:
                        _read_watts(nvml, handle)
                        self._nvml, self._handle, self.reason = nvml, handle, None
                    except Exception as exc:
                        self.reason = f"this GPU does not report its power draw through NVML ({exc})"
        self.source = (
            self._counter.source if self._counter else SOURCE_POWER if self._nvml is not None else SOURCE_UNAVAILABLE
        )
        self.available = self.source != SOURCE_UNAVAILABLE
        self._samples: list[tuple[float, float]] = []
        self._last: tuple[float, tuple[int, ...]] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self) -> None:
        """Forget earlier samples and start sampling (a no-op when unavailable)."""
        self.stop()
        with self._lock:
            self._samples, self._last = [], None
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
        period = 1.0 / (max(self.hz, COUNTER_POLL_HZ) if self._counter is not None else self.hz)
        while not self._stop.wait(period):
            self._sample()

    def _sample(self, final: bool = False) -> None:
        try:
            value = self._counter.read() if self._counter is not None else _read_watts(self._nvml, self._handle)
        except Exception:
            return  # a missed sample only lowers the resolution
        t = time.perf_counter() - self._t0
        with self._lock:
            if not final and self._stop.is_set():
                return  # nothing lands after the final sample
            if self._counter is None:
                self._samples.append((t, value))
                return
            if self._last is not None and value == self._last[1]:
                return  # the counter has not refreshed yet
            last, self._last = self._last, (t, value)
            if last is None or t <= last[0]:
                return
            joules = self._counter.joules(last[1], value)
            if joules is not None:  # a counter that went backwards restarts the series
                self._samples.append((t, joules / (t - last[0])))


def _probe_counter(nvml: Any, handle: Any) -> tuple[NvmlCounter | None, str | None]:
    """NVML's energy counter when this GPU has one (Volta and newer), else (None, why not)."""
    counter = NvmlCounter(nvml, handle)
    try:
        counter.read()
    except Exception as exc:
        return None, f"this GPU has no energy counter ({exc})"
    return counter, None


class EnergyMeter:
    """Joules over a window on one device: ``start()``/``stop()``, or ``with EnergyMeter(dev) as m:`` then
    ``m.reading``. A GPU's energy counter, else its integrated power; the CPU's RAPL counters."""

    def __init__(self, device: torch.device | str = "cuda", powercap_root: Path | None = None) -> None:
        self.device = torch.device(device)
        self.source = SOURCE_UNAVAILABLE
        self._counter: NvmlCounter | RaplCounter | None = None
        self._sampler: PowerSampler | None = None
        if self.device.type == "cpu":
            self._counter, self.reason = open_rapl(powercap_root)
        else:
            nvml, handle, self.reason = open_device(self.device)
            if nvml is not None:
                self._counter, counter_reason = _probe_counter(nvml, handle)
                if self._counter is None:
                    self.reason = self._probe_power(nvml, handle, counter_reason)
        if self._counter is not None:
            self.source, self.reason = self._counter.source, None
        self.available = self.source != SOURCE_UNAVAILABLE
        self.reading: EnergyReading | None = None
        self._t0: float | None = None
        self._e0: tuple[int, ...] = ()

    def _probe_power(self, nvml: Any, handle: Any, counter_reason: str | None) -> str | None:
        """Fall back to integrating sampled power; the reason when that is missing too."""
        try:
            _read_watts(nvml, handle)
        except Exception as power_exc:
            return f"{counter_reason}, and no power reading either ({power_exc}): neither can be measured"
        self._sampler = PowerSampler(self.device, hz=FALLBACK_HZ)
        self.source = SOURCE_POWER
        return None

    def start(self) -> None:
        """Begin a window: synchronise the device, then read the counter (or start sampling power)."""
        _sync(self.device)
        self.reading = None
        if self._counter is not None:
            self._e0 = self._counter.read()
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
        if self._counter is not None:
            self.reading = self._counter_reading(seconds)
        elif self.source == SOURCE_POWER:
            self.reading = self._power_reading(seconds)
        else:
            self.reading = EnergyReading(None, seconds, SOURCE_UNAVAILABLE, self.reason)
        return self.reading

    def _counter_reading(self, seconds: float) -> EnergyReading:
        e1 = self._counter.read()
        source = self._counter.source
        nvml = source == SOURCE_COUNTER  # RAPL refreshes about every millisecond: no window is too short
        note = short_window_note(seconds) if nvml else None
        if note is not None:
            return EnergyReading(None, seconds, source, note)
        joules = self._counter.joules(self._e0, e1)
        if joules is None:
            return EnergyReading(None, seconds, source, "the energy counter went backwards (driver reset?)")
        return EnergyReading(joules, seconds, source, coarse_window_note(seconds) if nvml else None)

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
