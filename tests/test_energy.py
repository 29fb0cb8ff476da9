"""Energy meter: integration arithmetic, the unavailable path (this CPU), the short-window rule, device
mapping helpers, the counter/power logic against a fake NVML, and the real NVML path where a GPU exists."""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

import mtad.energy as energy
from mtad.energy import (
    EnergyMeter,
    EnergyReading,
    PowerSampler,
    coarse_window_note,
    pci_bus_id,
    short_window_note,
    trapezoid_joules,
    visible_device_token,
)

NO_GPU = "needs a CUDA GPU with NVML: this machine has none"


# --- pure arithmetic -------------------------------------------------------------------------------------------------


def test_trapezoid_constant_power_is_watts_times_seconds():
    samples = [(i * 0.05, 100.0) for i in range(41)]  # 100 W for 2 s
    assert trapezoid_joules(samples) == pytest.approx(200.0)


def test_trapezoid_linear_ramp_is_exact():
    # 0 W -> 100 W over 1 s, irregular spacing: the trapezoid rule is exact for a linear series
    ts = [0.0, 0.1, 0.15, 0.4, 0.7, 1.0]
    assert trapezoid_joules([(t, 100.0 * t) for t in ts]) == pytest.approx(50.0)


def test_trapezoid_known_series_by_hand():
    # (0,10) (1,30) (3,30): 1*(10+30)/2 + 2*(30+30)/2 = 20 + 60
    assert trapezoid_joules([(0.0, 10.0), (1.0, 30.0), (3.0, 30.0)]) == pytest.approx(80.0)


def test_trapezoid_needs_two_samples_and_skips_non_increasing_times():
    assert trapezoid_joules([]) is None
    assert trapezoid_joules([(0.0, 50.0)]) is None
    assert trapezoid_joules([(0.0, 10.0), (0.5, 30.0)]) == 10.0  # two are enough
    assert trapezoid_joules([(0.0, 10.0), (1.0, 10.0), (1.0, 999.0), (2.0, 10.0)]) == pytest.approx(10.0 + 504.5)


def test_short_window_note():
    note = short_window_note(0.03)
    assert note is not None and "shorter than the counter's refresh" in note and "30 ms" in note
    assert short_window_note(0.1) is None
    assert short_window_note(2.0) is None


def test_coarse_window_note_only_between_one_and_ten_refreshes():
    assert coarse_window_note(0.05) is None  # too short: that is short_window_note's case (no figure)
    assert "fewer than ten refreshes" in coarse_window_note(0.5)
    assert coarse_window_note(1.0) is None


def test_pci_bus_id_format():
    assert pci_bus_id(0, 0x3B, 0) == "00000000:3B:00.0"
    assert pci_bus_id(1, 7, 2) == "00000001:07:02.0"


@pytest.mark.parametrize(
    ("index", "visible", "expected"),
    [
        (0, None, 0),  # no CUDA_VISIBLE_DEVICES: torch order is NVML order (by index)
        (1, "2,3", 3),
        (0, " 5 , 1", 5),
        (1, "GPU-1234,GPU-abcd", "GPU-abcd"),
        (0, "MIG-xyz", "MIG-xyz"),
        (3, "0,1", None),
        (0, "", None),
    ],
)
def test_visible_device_token(index, visible, expected):
    assert visible_device_token(index, visible) == expected


# --- the unavailable path (runs here) --------------------------------------------------------------------------------


def test_cpu_meter_is_unavailable_and_never_reports_zero():
    m = EnergyMeter("cpu")  # conftest points MTAD_POWERCAP_ROOT at nothing: no RAPL
    assert m.available is False
    assert m.reason == "no GPU: running on cpu, and no readable RAPL energy counter"
    m.start()
    time.sleep(0.01)
    r = m.stop()
    assert isinstance(r, EnergyReading)
    assert r.joules is None and r.source == "unavailable" and r.note == m.reason
    assert r.seconds >= 0.01


def test_cpu_meter_as_context_manager():
    with EnergyMeter(torch.device("cpu")) as m:
        sum(range(1000))
    assert m.reading is not None and m.reading.joules is None and m.reading.source == "unavailable"
    assert m.reading.to_dict()["joules"] is None


def test_stop_before_start_is_an_error():
    with pytest.raises(RuntimeError, match="before start"):
        EnergyMeter("cpu").stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_meter_without_cuda_says_why():
    m = EnergyMeter("cuda")
    assert m.available is False and "no GPU" in m.reason and "CUDA" in m.reason
    m.start()
    assert m.stop().joules is None


def test_cpu_power_sampler_is_unavailable_and_empty():
    s = PowerSampler("cpu")
    assert s.available is False and s.reason.startswith("no GPU: running on cpu")
    s.start()
    s.stop()
    assert s.samples() == []


def test_power_sampler_rejects_a_bad_rate():
    with pytest.raises(ValueError, match="Hz"):
        PowerSampler("cpu", hz=0)
    assert PowerSampler("cpu", hz=0.5).hz == 0.5  # slow, but a rate


# --- the NVML logic against a realistic fake NVML --------------------------------------------------------------------


class FakeNVMLError(Exception):
    pass


class FakeGPU:
    """One GPU as NVML shows it: a power draw the test changes, an energy counter that starts at a large
    offset and refreshes every 20-100 ms, and a power reading averaged over the last second (Ampere+)."""

    def __init__(self, watts: float, bus_id: str, uuid: str, counter: bool, power: bool, seed: int) -> None:
        self.bus_id, self.uuid, self.counter, self.power = bus_id, uuid, counter, power
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        now = time.perf_counter()
        self.segments = [(now - 10.0, watts)]  # (since, watts): it has been drawing ``watts`` for a while
        self.offset_mj = 7_654_321_000 + self.rng.randrange(10**6)
        self.shown = self._true_mj(now)
        self.next_refresh = now + self.rng.uniform(0.02, 0.1)
        self.counter_reads = self.power_reads = 0

    def _joules(self, t: float) -> float:
        """Energy drawn from the first segment's start up to ``t``."""
        total = 0.0
        for i, (since, watts) in enumerate(self.segments):
            until = self.segments[i + 1][0] if i + 1 < len(self.segments) else math.inf
            total += watts * max(0.0, min(t, until) - since)
        return total

    def _true_mj(self, t: float) -> int:
        return self.offset_mj + int(self._joules(t) * 1000)

    def set_watts(self, watts: float) -> None:
        with self.lock:
            self.segments.append((time.perf_counter(), watts))

    def step_back(self, mj: int) -> None:
        """The counter shows ``mj`` less from its next refresh on (what a driver reset looks like)."""
        with self.lock:
            self.offset_mj -= mj

    def energy_mj(self) -> int:
        with self.lock:
            self.counter_reads += 1
            now = time.perf_counter()
            if now >= self.next_refresh:
                self.shown = self._true_mj(now)
                self.next_refresh = now + self.rng.uniform(0.02, 0.1)
            return self.shown

    def power_mw(self) -> int:
        with self.lock:
            self.power_reads += 1
            now = time.perf_counter()
            return int((self._joules(now) - self._joules(now - 1.0)) * 1000)


class FakeNVML:
    """The few pynvml functions mtad calls, over GPUs in NVML's (PCI) order. Only names the real binding
    defines are given (checked by a test), so a call to a name it lacks fails here as it would there."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus: list[FakeGPU]) -> None:
        self.gpus = gpus
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.gpus):
            raise FakeNVMLError("Invalid Argument")
        return self.gpus[index]

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        for gpu in self.gpus:
            if gpu.bus_id.lower() == bus_id.lower():
                return gpu
        raise FakeNVMLError("Not Found")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise FakeNVMLError("Not Found")

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not handle.counter:
            raise FakeNVMLError("Not Supported")
        return handle.energy_mj()

    def nvmlDeviceGetPowerUsage(self, handle):
        if not handle.power:
            raise FakeNVMLError("Not Supported")
        return handle.power_mw()


def make_gpu(watts=100.0, bus_id="00000000:3B:00.0", uuid="GPU-aaaa", counter=True, power=True, seed=0) -> FakeGPU:
    return FakeGPU(watts, bus_id, uuid, counter, power, seed)


def test_fake_nvml_only_uses_names_the_real_binding_has():
    pynvml = pytest.importorskip("pynvml", reason="needs nvidia-ml-py (in requirements.txt)")
    called = [n for n in vars(FakeNVML) if n.startswith("nvml")]
    assert len(called) == 6
    assert [n for n in called if not callable(getattr(pynvml, n, None))] == []
    assert not hasattr(pynvml, "nvmlDeviceGetHandleByPciBusId_v2")  # the name defect 1 called


def test_fake_counter_has_the_real_counters_habits():
    gpu = make_gpu(watts=100.0)
    first = gpu.energy_mj()
    assert first > 10**9  # a large offset: the driver counts from when it loaded
    seen, t0 = [first], time.perf_counter()
    while time.perf_counter() - t0 < 0.4:
        seen.append(gpu.energy_mj())
        time.sleep(0.002)
    values = sorted(set(seen))
    assert 4 <= len(values) <= 21  # refreshed every 20-100 ms, not at every read
    gpu.step_back(10**6)
    time.sleep(0.11)
    assert gpu.energy_mj() < values[-1]  # it can step backwards


# handle selection: two GPU models; NVML lists them in PCI order, CUDA fastest first


L40 = "00000000:3B:00.0"
H100 = "00000000:86:00.0"


@pytest.fixture
def two_gpus(monkeypatch):
    """NVML order: an L40 (bus 3B) then an H100 (bus 86); torch's cuda:0 is the H100, cuda:1 the L40."""
    gpus = [make_gpu(bus_id=L40, uuid="GPU-l40"), make_gpu(bus_id=H100, uuid="GPU-h100", seed=1)]
    nvml = FakeNVML(gpus)
    props = {
        0: types.SimpleNamespace(name="NVIDIA H100", pci_bus_id=0x86, pci_device_id=0, pci_domain_id=0),
        1: types.SimpleNamespace(name="NVIDIA L40", pci_bus_id=0x3B, pci_device_id=0, pci_domain_id=0),
    }
    monkeypatch.setattr(energy, "_init_nvml", lambda: nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return nvml, props


def test_handle_is_found_by_pci_bus_id_not_by_index(two_gpus):
    nvml, _ = two_gpus
    l40, h100 = nvml.gpus
    assert energy.open_device("cuda:0")[1:] == (h100, None)
    assert energy.open_device("cuda:1")[1:] == (l40, None)
    assert energy.open_device("cuda")[1] is h100  # the current device


def test_bus_id_wins_over_cuda_visible_devices(two_gpus, monkeypatch):
    nvml, _ = two_gpus
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # says NVML index 0 (the L40): the bus id knows better
    assert energy.open_device("cuda:0")[1] is nvml.gpus[1]


def test_without_a_bus_id_cuda_visible_devices_maps_the_index(two_gpus, monkeypatch):
    nvml, props = two_gpus
    for p in props.values():
        del p.pci_bus_id  # an older torch without the property
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert energy.open_device("cuda:0")[1] is nvml.gpus[1]
    assert energy.open_device("cuda:1")[1] is nvml.gpus[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-h100")
    assert energy.open_device("cuda:0")[1] is nvml.gpus[1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert energy.open_device("cuda:1")[1] is nvml.gpus[1]  # no list: torch's index is NVML's


def test_the_bus_id_carries_the_pci_domain_and_device(monkeypatch):
    """Two GPUs on bus 0x86 of different PCI domains (multi-socket servers): the domain and the device
    number pick the right one."""
    near, far = (
        make_gpu(bus_id="00000000:86:00.0", uuid="GPU-near"),
        make_gpu(bus_id="00000001:86:02.0", uuid="GPU-far"),
    )
    nvml = FakeNVML([near, far])
    props = {0: types.SimpleNamespace(name="NVIDIA H100", pci_bus_id=0x86, pci_device_id=2, pci_domain_id=1)}
    monkeypatch.setattr(energy, "_init_nvml", lambda: nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert energy.open_device("cuda:0")[1:] == (far, None)


def test_a_bus_id_nvml_does_not_know_falls_back_to_the_list(two_gpus, monkeypatch):
    nvml, props = two_gpus
    props[0].pci_bus_id = 0x99
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert energy.open_device("cuda:0")[1] is nvml.gpus[1]


def test_a_device_nvml_cannot_find_is_unavailable_with_the_reason(two_gpus, monkeypatch):
    _, props = two_gpus
    props[0].pci_bus_id = 0x99
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-gone")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    m = EnergyMeter("cuda:0")
    assert m.available is False and "cannot find cuda:0" in m.reason and "Not Found" in m.reason


def test_meter_reads_the_gpu_its_device_is_on(two_gpus, monkeypatch):
    nvml, _ = two_gpus
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    nvml.gpus[0].set_watts(400.0)  # the L40 is busy with someone else's job; our H100 draws 100 W
    with EnergyMeter("cuda:0") as m:
        time.sleep(0.5)
    assert m.reading.joules == pytest.approx(100.0 * m.reading.seconds, abs=12.0)
    assert nvml.gpus[1].counter_reads >= 2 and nvml.gpus[0].counter_reads == 0


# the meter and the sampler against one fake GPU


@pytest.fixture
def fake_nvml(monkeypatch):
    """Installs one fake GPU behind ``open_device``, which records the devices it is asked to open."""

    def install(**kwargs):
        gpu = make_gpu(**kwargs)
        gpu.opened = []

        def open_device(device):
            gpu.opened.append(torch.device(device))  # a device spec, as the real one parses it
            return FakeNVML([gpu]), gpu, None

        monkeypatch.setattr(energy, "open_device", open_device)
        return gpu

    return install


def test_meter_and_sampler_open_the_gpu_they_are_given(fake_nvml):
    gpu = fake_nvml(watts=100.0)
    EnergyMeter("cuda:1")
    PowerSampler("cuda:1")
    assert gpu.opened == [torch.device("cuda:1")] * 2


def test_counter_reading_is_the_difference_from_the_windows_start(fake_nvml):
    fake_nvml(watts=100.0)
    m = EnergyMeter("cuda")
    assert m.available and m.source == "nvml-counter" and m.reason is None
    m.start()
    time.sleep(0.5)
    r = m.stop()
    assert r.source == "nvml-counter" and "fewer than ten refreshes" in r.note  # 0.5 s: a figure, with a caveat
    # each end is at most one refresh (100 ms at 100 W) stale; the counter itself reads over 7.6 MJ
    assert r.joules == pytest.approx(100.0 * r.seconds, abs=12.0)


def test_counter_reading_follows_a_power_change(fake_nvml):
    gpu = fake_nvml(watts=50.0)
    with EnergyMeter("cuda") as m:
        time.sleep(0.4)
        gpu.set_watts(250.0)
        time.sleep(0.6)
    expected = 50.0 * 0.4 + 250.0 * (m.reading.seconds - 0.4)
    assert m.reading.joules == pytest.approx(expected, abs=30.0)
    assert m.reading.note is None  # >= 1 s: no caveat


def test_counter_that_steps_backwards_gives_no_figure(fake_nvml):
    gpu = fake_nvml(watts=100.0)
    m = EnergyMeter("cuda")
    m.start()
    gpu.step_back(10**6)  # 1 kJ back: more than the window draws
    time.sleep(0.25)
    r = m.stop()
    assert r.joules is None and "went backwards" in r.note
    assert r.source == "nvml-counter" and r.seconds >= 0.25  # a window without a figure still says what it was


def test_counter_path_short_window_gives_a_note_not_a_figure(fake_nvml):
    fake_nvml(watts=100.0)
    m = EnergyMeter("cuda")
    m.start()
    r = m.stop()
    assert r.joules is None and r.source == "nvml-counter" and 0 <= r.seconds < 0.02
    assert "shorter than the counter's refresh" in r.note


def _time_weighted_mean(samples, after: float) -> float:
    """Mean power over samples later than ``after``: each sample is the mean since the previous one."""
    pairs = [(t0, t1, w) for (t0, _), (t1, w) in zip(samples, samples[1:], strict=False) if t0 >= after]
    return sum(w * (t1 - t0) for t0, t1, w in pairs) / sum(t1 - t0 for t0, t1, _ in pairs)


def test_live_power_comes_from_the_counter_and_does_not_lag(fake_nvml):
    gpu = fake_nvml(watts=300.0)  # the previous lane drew 300 W ...
    gpu.set_watts(50.0)  # ... this one draws 50 W
    assert gpu.power_mw() / 1000 > 250.0  # what the one-second average says now: the lag
    gpu.power_reads = 0
    s = PowerSampler("cuda", hz=20)
    assert s.available and s.source == "nvml-counter"
    s.start()
    time.sleep(0.8)
    s.stop()
    samples = s.samples()
    assert len(samples) >= 6  # a point per refresh of the counter
    assert _time_weighted_mean(samples, after=0.15) == pytest.approx(50.0, rel=0.25)
    assert statistics.median(w for _, w in samples) < 100.0
    assert gpu.power_reads == 0


def test_live_power_survives_a_counter_stepping_back(fake_nvml):
    gpu = fake_nvml(watts=80.0)
    s = PowerSampler("cuda")
    s.start()
    time.sleep(0.3)
    gpu.step_back(10**6)
    time.sleep(0.5)
    s.stop()
    watts = [w for _, w in s.samples()]
    assert len(watts) >= 4 and all(w >= 0 for w in watts)  # the backward step is no point at all
    assert statistics.median(watts) == pytest.approx(80.0, rel=0.35)


def test_power_fallback_is_labelled_and_integrates_sampled_power(fake_nvml):
    gpu = fake_nvml(watts=50.0, counter=False)
    s = PowerSampler("cuda")
    assert s.available and s.source == "nvml-power"
    with EnergyMeter("cuda") as m:
        assert m.available and m.source == "nvml-power"
        time.sleep(0.4)
    r = m.reading
    assert r.source == "nvml-power" and r.joules is not None and "integrated from power" in r.note
    assert r.joules == pytest.approx(50.0 * r.seconds, rel=0.15)
    assert gpu.power_reads >= 0.4 * energy.FALLBACK_HZ * 0.5  # sampled at >= 10 Hz on a loaded machine


def test_power_fallback_short_window(fake_nvml):
    fake_nvml(counter=False)
    m = EnergyMeter("cuda")
    m.start()
    r = m.stop()
    assert r.joules is None and "refresh" in r.note and r.source == "nvml-power" and 0 <= r.seconds < 0.02


def test_power_fallback_without_samples_says_so(fake_nvml):
    """The GPU answered the probe, then stopped reporting power: a window with no samples has no figure
    and says why (never 0 J)."""
    gpu = fake_nvml(watts=50.0, counter=False)
    m = EnergyMeter("cuda")
    assert m.source == "nvml-power"
    gpu.power = False
    m.start()
    time.sleep(0.25)
    r = m.stop()
    assert r.joules is None and r.note == "too few power samples to integrate"
    assert r.source == "nvml-power" and r.seconds >= 0.25


def test_neither_counter_nor_power_is_unavailable(fake_nvml):
    fake_nvml(counter=False, power=False)
    m = EnergyMeter("cuda")
    assert m.available is False and "neither" in m.reason
    s = PowerSampler("cuda")
    assert s.available is False and s.source == "unavailable" and "power draw" in s.reason
    m.start()
    time.sleep(0.12)
    r = m.stop()
    assert r.joules is None and r.source == "unavailable" and r.note == m.reason


def test_no_sample_lands_after_the_final_one(fake_nvml):
    """A poll that read the GPU just as ``stop()`` began lands nothing after stop's own final sample."""
    gpu = fake_nvml(watts=60.0, counter=False)
    s = PowerSampler("cuda", hz=50)
    polled = threading.Event()

    def power_mw():
        if threading.current_thread().name != "mtad-power-sampler":
            return 123_000 if s._stop.is_set() else 60_000  # stop's final sample is the 123 W one
        if not polled.is_set():
            polled.set()
            s._stop.wait(5)  # hold this poll's reading until stop() has begun...
            time.sleep(0.05)  # ...and has taken its final sample
        return 60_000

    gpu.power_mw = power_mw
    s.start()
    assert polled.wait(5)
    s.stop()
    assert s.samples()[-1][1] == 123.0


def test_power_sampler_collects_a_thread_safe_series(fake_nvml):
    fake_nvml(watts=75.0, counter=False)
    s = PowerSampler("cuda", hz=50)
    assert s.available
    s.start()
    time.sleep(0.3)
    mid = s.samples()
    s.stop()
    final = s.samples()
    assert len(final) >= 5 and len(final) >= len(mid)
    assert all(w == pytest.approx(75.0, abs=0.01) for _, w in final)
    times = [t for t, _ in final]
    assert times == sorted(times) and times[0] >= 0
    mid.clear()  # a snapshot, not the live list
    assert len(s.samples()) == len(final)


# --- RAPL on a CPU host, against a fake powercap tree ----------------------------------------------------------------

MAX_RANGE = 262_143_328_850  # a real package's max_energy_range_uj


def powercap_tree(root, zones: dict[str, tuple[str, int]]):
    """Write ``intel-rapl:*`` zone directories: name -> (zone name, energy_uj)."""
    for zone, (name, uj) in zones.items():
        d = root / zone
        d.mkdir(parents=True, exist_ok=True)
        (d / "name").write_text(name + "\n")
        (d / "energy_uj").write_text(f"{uj}\n")
        (d / "max_energy_range_uj").write_text(f"{MAX_RANGE}\n")
    return root


def set_uj(root, zone: str, uj: int) -> None:
    (root / zone / "energy_uj").write_text(f"{uj}\n")


def test_rapl_meter_sums_packages_and_undoes_a_wrap(tmp_path):
    root = powercap_tree(
        tmp_path,
        {
            "intel-rapl:0": ("package-0", MAX_RANGE - 1_000),
            "intel-rapl:0:0": ("core", 5_000),  # inside package 0: not counted twice
            "intel-rapl:1": ("package-1", 123_456_789),
            "intel-rapl:2": ("psys", 10**9),  # the platform: overlaps the packages
        },
    )
    (tmp_path / "intel-rapl").mkdir()  # the control-type directory has no counter
    m = EnergyMeter("cpu", powercap_root=root)
    assert m.available and m.source == "rapl" and m.reason is None
    m.start()
    set_uj(root, "intel-rapl:0", 4_000)  # wrapped: 1,000 before the wrap and 4,000 after
    set_uj(root, "intel-rapl:0:0", 999_999_999)
    set_uj(root, "intel-rapl:1", 123_456_789 + 2_000_000)
    set_uj(root, "intel-rapl:2", 5 * 10**9)
    r = m.stop()
    assert r.source == "rapl" and r.note is None
    assert r.joules == pytest.approx((1_000 + 4_000 + 2_000_000) / 1e6, rel=1e-12)


def test_rapl_counter_of_an_idle_package_reads_no_energy_not_a_wrap(tmp_path):
    """A package whose counter did not move in the window (idle, or a window inside one refresh)
    added nothing; reading it as a full wrap would add ``max_energy_range_uj``."""
    root = powercap_tree(tmp_path, {"intel-rapl:0": ("package-0", 777), "intel-rapl:1": ("package-1", 1_000)})
    m = EnergyMeter("cpu", powercap_root=root)
    m.start()
    set_uj(root, "intel-rapl:1", 251_000)
    assert m.stop().joules == pytest.approx(0.25, rel=1e-12)


def test_nvml_counter_that_did_not_move_reads_zero_joules():
    counter = energy.NvmlCounter(nvml=None, handle=None)
    assert counter.joules((5_000,), (5_000,)) == 0.0
    assert counter.joules((5_000,), (7_500,)) == 2.5
    assert counter.joules((5_000,), (4_999,)) is None


def test_energy_reading_to_dict_names_its_fields():
    r = EnergyReading(None, 1.5, "rapl", "why not")
    assert r.to_dict() == {"joules": None, "seconds": 1.5, "source": "rapl", "note": "why not"}


def test_rapl_from_the_environment(tmp_path, monkeypatch):
    root = powercap_tree(tmp_path, {"intel-rapl:0": ("package-0", 0)})
    monkeypatch.setenv("MTAD_POWERCAP_ROOT", str(root))
    with EnergyMeter("cpu") as m:
        set_uj(root, "intel-rapl:0", 3_500_000)
    assert m.reading.joules == pytest.approx(3.5)


def test_a_sampler_left_running_does_not_keep_the_process_alive(tmp_path):
    """Its thread is a daemon: a script that starts a sampler and never stops it still exits."""
    root = powercap_tree(tmp_path, {"intel-rapl:0": ("package-0", 1_000_000)})
    script = (
        "from mtad.energy import PowerSampler\n"
        f"s = PowerSampler('cpu', powercap_root={str(root)!r})\n"
        "s.start()\n"
        "assert s._thread.is_alive()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_rapl_sampler_draws_power_from_counter_differences(tmp_path):
    root = powercap_tree(tmp_path, {"intel-rapl:0": ("package-0", MAX_RANGE - 500_000)})
    s = PowerSampler("cpu", powercap_root=root)
    assert s.available and s.source == "rapl"
    s.start()
    uj, t0 = MAX_RANGE - 500_000, time.perf_counter()
    while time.perf_counter() - t0 < 0.6:  # 20 W: 1 J every 50 ms, wrapping on the way
        time.sleep(0.05)
        uj = (uj + 1_000_000) % MAX_RANGE
        set_uj(root, "intel-rapl:0", uj)
    set_uj(root, "intel-rapl:0", uj + 1_000_000)
    last_change = time.perf_counter() - t0
    s.stop()  # its final read catches the change, if the sampling thread did not
    samples = s.samples()
    assert samples[-1][0] >= last_change  # the series runs to the stop, not to the last poll before it
    assert len(samples) >= 5 and all(w > 0 for _, w in samples)
    assert all(0 < t < 1.0 for t, _ in samples)  # seconds since the sampler started
    assert _time_weighted_mean(samples, after=0.1) == pytest.approx(20.0, rel=0.3)


@pytest.mark.parametrize(
    "zones",
    [
        {},  # no powercap at all (this machine)
        {"intel-rapl:0:0": ("core", 1)},  # only a sub-zone
        {"intel-rapl:0": ("psys", 1)},
    ],
)
def test_no_readable_rapl_is_na_with_the_reason(tmp_path, zones):
    root = powercap_tree(tmp_path, zones)
    m = EnergyMeter("cpu", powercap_root=root)
    assert m.available is False and m.reason == "no GPU: running on cpu, and no readable RAPL energy counter"
    with m:
        pass
    assert m.reading.joules is None and m.reading.note == m.reason
    s = PowerSampler("cpu", powercap_root=root)
    assert s.available is False and s.reason == m.reason


def test_an_unreadable_counter_is_skipped(tmp_path):
    zones = {f"intel-rapl:{i}": (f"package-{i}", 1) for i in range(3)}
    root = powercap_tree(tmp_path, zones)
    (root / "intel-rapl:0" / "energy_uj").unlink()  # as if not readable (root-only since 2020 kernels)
    (root / "intel-rapl:0" / "energy_uj").mkdir()
    (root / "intel-rapl:2" / "name").unlink()  # an old kernel without zone names: a package
    m = EnergyMeter("cpu", powercap_root=root)
    assert m.available and [z.energy_file.parent.name for z in m._counter.zones] == ["intel-rapl:1", "intel-rapl:2"]


def test_a_rapl_window_carries_no_note_about_nvml_refreshes(tmp_path):
    """RAPL refreshes about every millisecond: a 0.3 s window is no coarse window (NVML's would be)."""
    root = powercap_tree(tmp_path, {"intel-rapl:0": ("package-0", 0)})
    m = EnergyMeter("cpu", powercap_root=root)
    m.start()
    time.sleep(0.3)
    set_uj(root, "intel-rapl:0", 3_000_000)
    r = m.stop()
    assert r.joules == pytest.approx(3.0) and r.note is None
    with pytest.raises(RuntimeError, match="before start"):
        m.stop()  # a window is stopped once


# --- the real NVML path (GPU only) -----------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_nvml_handle_is_the_torch_device():
    nvml, handle, reason = energy.open_device("cuda:0")
    assert reason is None, reason
    props = torch.cuda.get_device_properties(0)
    if isinstance(getattr(props, "pci_bus_id", None), int):
        bus = nvml.nvmlDeviceGetPciInfo(handle).busId
        bus = bus.decode() if isinstance(bus, bytes) else bus
        assert int(bus.split(":")[1], 16) == props.pci_bus_id


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_nvml_meter_measures_a_real_load():
    m = EnergyMeter("cuda")
    assert m.available, m.reason
    x = torch.randn(4096, 4096, device="cuda")
    with m:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            x = (x @ x).tanh_()
    r = m.reading
    assert r.joules is not None and r.joules > 0, r.note
    watts = r.joules / r.seconds
    assert 5 < watts < 2000 and math.isfinite(watts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_nvml_power_sampler_samples_at_the_asked_rate():
    s = PowerSampler("cuda", hz=20)
    assert s.available, s.reason
    s.start()
    time.sleep(1.0)
    s.stop()
    samples = s.samples()
    assert len(samples) >= 10 and all(w > 0 for _, w in samples)
