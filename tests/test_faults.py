"""Faults injected into the page's engine side (mtad/ui/runner.py): an energy counter that turns unreadable, a
meter that fails, a decoder that raises, a lane worker that dies, out of memory or a broken compiler while a
pair warms up, a pair file that cannot be read. Each must end in a message and leave the device free; none
may hang a run or cache a broken pair."""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from pathlib import Path

import pytest
import torch

from mtad.events import Step
from mtad.models.errors import PairError
from mtad.models.pair import load
from mtad.settings import Settings
from mtad.ui import runner
from mtad.ui.record import LaneRecord, RunRecord

SETTINGS = Settings(max_new_tokens=12, gamma=2, beams=2, tau=0.5, seed=0)
RANGE_UJ = 262_143_328_850


def fake_powercap(root: Path, energy_uj: int = 1_000_000) -> Path:
    """One RAPL package zone, as Linux lays it out under /sys/class/powercap."""
    zone = root / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "name").write_text("package-0\n")
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{RANGE_UJ}\n")
    return root


def record(pair, methods=("sd", "mtad")) -> RunRecord:  # noqa: ANN001
    ids = pair.encode("abc def")
    return RunRecord("tiny", "cpu", "abc def", SETTINGS.to_dict(), {m: LaneRecord(m, ids) for m in methods})


def finish(rec: RunRecord, pair, seconds: float = 120.0) -> RunRecord:  # noqa: ANN001
    """Drain ``run_lanes`` in a thread; fail (instead of hanging the suite) when it has not ended in time."""
    done, failure = threading.Event(), []

    def drain() -> None:
        try:
            for _ in runner.run_lanes(pair, rec, SETTINGS, threading.Event(), interval=0.02):
                pass
        except BaseException as exc:  # noqa: BLE001
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=drain, daemon=True).start()
    assert done.wait(seconds), "the run never ended: a lane left no end event and the drain loop kept waiting"
    assert not failure, failure
    return rec


def device_free(seconds: float = 10.0) -> bool:
    """True once no lane worker holds the device (it lets go right after its last event)."""
    for _ in range(int(seconds / 0.05)):
        if not runner.DEVICE_LOCK.locked():
            return True
        threading.Event().wait(0.05)
    return False


def test_an_energy_counter_that_turns_unreadable_mid_run_ends_the_lane_without_energy(
    tiny_pair, tmp_path, monkeypatch
) -> None:
    root = fake_powercap(tmp_path / "powercap")
    monkeypatch.setenv("MTAD_POWERCAP_ROOT", str(root))
    counter = root / "intel-rapl:0" / "energy_uj"
    real = runner.decode

    def decode(pair, prompt_ids, settings):  # noqa: ANN001, ANN202
        for i, step in enumerate(real(pair, prompt_ids, settings)):
            if i == 1 and counter.exists():
                counter.unlink()  # the counter file goes away between two iterations
            yield step

    monkeypatch.setattr(runner, "decode", decode)
    rec = finish(record(tiny_pair), tiny_pair)
    sd, mtad = rec.lanes["sd"], rec.lanes["mtad"]
    assert sd.state == "done" and sd.steps and sd.error is None  # the tokens are kept: energy is a side figure
    assert sd.energy.available and sd.energy.joules is None
    assert sd.energy.note == runner.METER_FAILED
    assert sd.metrics().joules is None and sd.metrics().energy_note == runner.METER_FAILED
    assert mtad.state == "done" and mtad.steps  # the next lane runs (no counter left: no meter at all)
    assert not mtad.energy.available and "no readable RAPL energy counter" in mtad.energy.reason
    assert device_free()


def test_a_readable_counter_gives_the_lane_joules(tiny_pair, tmp_path, monkeypatch) -> None:
    """The control: the same fake tree, left alone, is read at the lane's start and end."""
    root = fake_powercap(tmp_path / "powercap")
    monkeypatch.setenv("MTAD_POWERCAP_ROOT", str(root))
    counter = root / "intel-rapl:0" / "energy_uj"
    real = runner.decode

    def decode(pair, prompt_ids, settings):  # noqa: ANN001, ANN202
        for step in real(pair, prompt_ids, settings):
            counter.write_text(f"{int(counter.read_text()) + 500_000}\n")  # 0.5 J an iteration
            yield step

    monkeypatch.setattr(runner, "decode", decode)
    rec = finish(record(tiny_pair, ("sd",)), tiny_pair)
    lane = rec.lanes["sd"]
    assert lane.state == "done" and lane.energy.source == "rapl"
    assert lane.energy.joules == pytest.approx(0.5 * len(lane.steps))


def test_a_meter_that_fails_to_start_leaves_the_lane_unmetered(tiny_pair, tmp_path, monkeypatch) -> None:
    from mtad.energy import EnergyMeter

    monkeypatch.setenv("MTAD_POWERCAP_ROOT", str(fake_powercap(tmp_path / "powercap")))

    def start(self: EnergyMeter) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(EnergyMeter, "start", start)
    rec = finish(record(tiny_pair, ("sd",)), tiny_pair)
    lane = rec.lanes["sd"]
    assert lane.state == "done" and lane.steps
    assert lane.energy.joules is None and lane.energy.note == runner.METER_FAILED
    assert device_free()


class Abort(BaseException):
    """Not an ``Exception``: what a decoder's bug may raise past ``except Exception``."""


@pytest.mark.parametrize("error", [RuntimeError("index out of range"), Abort("gone")], ids=["exception", "base"])
def test_a_decoder_that_raises_ends_its_lane_with_an_error(tiny_pair, monkeypatch, error) -> None:
    def decode(pair, prompt_ids, settings):  # noqa: ANN001, ANN202
        yield Step(index=0, method=settings.method, appended_ids=[1], from_target=[True], target_logprobs=[-1.0])
        raise error

    monkeypatch.setattr(runner, "decode", decode)
    rec = finish(record(tiny_pair), tiny_pair)
    sd, mtad = rec.lanes["sd"], rec.lanes["mtad"]
    assert sd.state == "error" and len(sd.steps) == 1
    assert sd.error == f"internal error while decoding ({type(error).__name__}); see the server log"
    assert mtad.state == "stopped" and not mtad.steps  # lanes after a failed one do not start
    assert device_free()


def test_a_worker_that_dies_without_its_end_event_is_noticed(tiny_pair, monkeypatch) -> None:
    monkeypatch.setattr(runner.LaneWorker, "run", lambda self: None)  # the thread ends, having said nothing
    rec = finish(record(tiny_pair), tiny_pair, seconds=30)
    assert rec.lanes["sd"].state == "error" and rec.lanes["sd"].error == runner.WORKER_LOST
    assert rec.lanes["mtad"].state == "stopped"


# --- the pair cache: a pair that fails while it loads or warms up is never cached ------------------------------


@pytest.fixture
def fresh_pairs(tiny_dirs, monkeypatch):
    """``runner.load_pair`` loading the tiny pair anew each call (compiled unless asked for eager); the list of
    what it loaded, and weak references to each load's target."""
    loaded: list[tuple[str, weakref.ref]] = []

    def load_pair(name: str, engine: str | None = "auto"):  # noqa: ANN202
        pair = load(*tiny_dirs, device="cpu", name=name, engine="eager")
        pair = dataclasses.replace(pair, engine="eager" if engine == "eager" else "compiled")
        loaded.append((pair.engine, weakref.ref(pair.target)))
        return pair

    monkeypatch.setattr(runner, "load_pair", load_pair)
    monkeypatch.setattr(runner, "presets", lambda: {"tiny": None})
    return loaded


def test_out_of_memory_while_warming_up_is_not_cached_and_frees_the_pair(fresh_pairs, monkeypatch) -> None:
    alive_at_release: list[bool] = []
    monkeypatch.setattr(
        runner, "free_device_memory", lambda: alive_at_release.append(any(r() is not None for _, r in fresh_pairs))
    )

    def warm_up_pair(pair, tokens):  # noqa: ANN001, ANN202
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setattr(runner, "warm_up_pair", warm_up_pair)
    cache = runner.PairCache()
    with pytest.raises(PairError, match="does not fit in the GPU's memory") as info:
        cache.get("tiny")
    assert not cache.loaded("tiny") and cache.peek("tiny") is None
    assert alive_at_release == [False]  # the compiled pair was gone when the memory was released
    assert info.value.__context__ is None
    with pytest.raises(PairError, match="does not fit"):  # tried again on the next run, not served broken
        cache.get("tiny")
    assert [engine for engine, _ in fresh_pairs] == ["compiled", "compiled"]


def test_a_broken_compiler_serves_eager_after_freeing_the_compiled_pair(fresh_pairs, monkeypatch, caplog) -> None:
    def warm_up_pair(pair, tokens):  # noqa: ANN001, ANN202
        raise RuntimeError("inductor: C++ compile error")

    monkeypatch.setattr(runner, "warm_up_pair", warm_up_pair)
    real_load = runner.load_pair
    alive_when_eager_loads: list[bool] = []

    def load_pair(name: str, engine: str | None = "auto"):  # noqa: ANN202
        if engine == "eager":
            alive_when_eager_loads.append(fresh_pairs[0][1]() is not None)
        return real_load(name, engine=engine)

    monkeypatch.setattr(runner, "load_pair", load_pair)
    with caplog.at_level(logging.WARNING, logger=runner.__name__):
        pair = runner.PairCache().get("tiny")
    assert pair.engine == "eager" and [e for e, _ in fresh_pairs] == ["compiled", "eager"]
    assert alive_when_eager_loads == [False]  # never both copies in memory
    [warning] = [r.getMessage() for r in caplog.records if "compiling tiny failed" in r.getMessage()]
    assert "Traceback (most recent call last)" in warning and "RuntimeError: inductor: C++ compile error" in warning


@pytest.mark.parametrize("make_error", ["safetensors", "import"])
def test_a_pair_that_cannot_be_read_is_a_sentence_not_cached(fresh_pairs, monkeypatch, make_error) -> None:
    from safetensors import SafetensorError

    error = SafetensorError("Error while deserializing header: HeaderTooLarge")
    if make_error == "import":
        error = ImportError("No module named 'gguf'")

    def load_pair(name: str, engine: str | None = "auto"):  # noqa: ANN202
        raise error

    monkeypatch.setattr(runner, "load_pair", load_pair)
    cache = runner.PairCache()
    with pytest.raises(PairError) as info:
        cache.get("tiny")
    message = str(info.value)
    assert message.startswith("pair 'tiny' could not be loaded (") and type(error).__name__ in message
    assert message.endswith("pick another pair") and not cache.loaded("tiny")
