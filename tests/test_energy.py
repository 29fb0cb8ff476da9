"""Energy meter: integration arithmetic, the unavailable path (this CPU), the short-window rule, device
mapping helpers, the counter/power logic against a fake NVML, and the real NVML path where a GPU exists."""

from __future__ import annotations

import math
import threading
import time

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

NO_GPU = "needs a CUDA GPU with NVML: this machine has none (the NVML path is run on a GPU by the lead)"


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
    m = EnergyMeter("cpu")
    assert m.available is False
    assert m.reason == "no GPU: running on cpu"
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
    assert s.available is False and s.reason == "no GPU: running on cpu"
    s.start()
    s.stop()
    assert s.samples() == []


def test_power_sampler_rejects_a_bad_rate():
    with pytest.raises(ValueError, match="Hz"):
        PowerSampler("cpu", hz=0)


# --- the NVML logic against a fake NVML ------------------------------------------------------------------------------


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """A GPU drawing a constant ``watts``: the counter grows with wall time; either reading may be unsupported."""

    NVMLError = FakeNVMLError

    def __init__(self, watts: float = 100.0, counter: bool = True, power: bool = True) -> None:
        self.watts, self.counter, self.power = watts, counter, power
        self.t0 = time.perf_counter()
        self.power_calls = 0
        self.lock = threading.Lock()

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.counter:
            raise FakeNVMLError("Not Supported")
        return int(self.watts * (time.perf_counter() - self.t0) * 1000.0)  # mJ

    def nvmlDeviceGetPowerUsage(self, handle):
        if not self.power:
            raise FakeNVMLError("Not Supported")
        with self.lock:
            self.power_calls += 1
        return int(self.watts * 1000)  # mW


@pytest.fixture
def fake_nvml(monkeypatch):
    def install(**kwargs):
        fake = FakeNVML(**kwargs)
        monkeypatch.setattr(energy, "open_device", lambda device: (fake, "handle-0", None))
        return fake

    return install


def test_counter_path_reads_joules_before_and_after(fake_nvml):
    fake_nvml(watts=100.0)
    m = EnergyMeter("cuda")
    assert m.available and m.source == "nvml-counter" and m.reason is None
    m.start()
    time.sleep(0.3)
    r = m.stop()
    assert r.source == "nvml-counter" and "fewer than ten refreshes" in r.note  # 0.3 s: a figure, with a caveat
    assert r.joules == pytest.approx(100.0 * r.seconds, rel=0.1, abs=0.5)


def test_counter_path_short_window_gives_a_note_not_a_figure(fake_nvml):
    fake_nvml(watts=100.0)
    m = EnergyMeter("cuda")
    m.start()
    r = m.stop()
    assert r.joules is None and r.source == "nvml-counter"
    assert "shorter than the counter's refresh" in r.note


def test_power_fallback_integrates_sampled_power(fake_nvml):
    fake = fake_nvml(watts=50.0, counter=False)
    with EnergyMeter("cuda") as m:
        assert m.available and m.source == "nvml-power"
        time.sleep(0.4)
    r = m.reading
    assert r.source == "nvml-power" and r.joules is not None
    assert r.joules == pytest.approx(50.0 * r.seconds, rel=0.15)
    assert fake.power_calls >= 0.4 * energy.FALLBACK_HZ * 0.5  # sampled at >= 10 Hz on a loaded machine


def test_power_fallback_short_window(fake_nvml):
    fake_nvml(counter=False)
    m = EnergyMeter("cuda")
    m.start()
    r = m.stop()
    assert r.joules is None and "refresh" in r.note


def test_neither_counter_nor_power_is_unavailable(fake_nvml):
    fake_nvml(counter=False, power=False)
    m = EnergyMeter("cuda")
    assert m.available is False and "neither" in m.reason
    m.start()
    time.sleep(0.12)
    r = m.stop()
    assert r.joules is None and r.source == "unavailable" and r.note == m.reason


def test_power_sampler_collects_a_thread_safe_series(fake_nvml):
    fake_nvml(watts=75.0)
    s = PowerSampler("cuda", hz=50)
    assert s.available
    s.start()
    time.sleep(0.3)
    mid = s.samples()
    s.stop()
    final = s.samples()
    assert len(final) >= 5 and len(final) >= len(mid)
    assert all(w == 75.0 for _, w in final)
    times = [t for t, _ in final]
    assert times == sorted(times) and times[0] >= 0
    mid.clear()  # a snapshot, not the live list
    assert len(s.samples()) == len(final)


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
