"""Run orchestration: the model-pair cache, one generation on the device at a time, lanes decoded in a
worker thread (so each lane's clock and energy count only its own work), Stop at the next iteration."""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

import torch

from mtad.decoding import decode
from mtad.decoding.precompile import needs_warm_up, warm_up_pair, warm_up_settings
from mtad.energy import EnergyMeter, PowerSampler
from mtad.models.errors import PairError
from mtad.models.pair import ModelPair, load_pair
from mtad.models.presets import presets
from mtad.settings import PARAMS, Settings
from mtad.ui.record import LaneEnergy, RunRecord

log = logging.getLogger(__name__)

DEVICE_LOCK = threading.Lock()
OOM_MESSAGE = (
    "the GPU ran out of memory; its cache was emptied. Try fewer beams, a shorter draft, fewer new tokens "
    "or a smaller pair: the app keeps serving"
)


class PairCache:
    """Model pairs loaded once per process, by preset name, shared by every visitor.

    At most ``max_loaded`` pairs stay in memory (the least recently used is dropped first).
    """

    def __init__(self, max_loaded: int = 1) -> None:
        self.max_loaded = max(1, max_loaded)
        self._pairs: OrderedDict[str, ModelPair] = OrderedDict()
        self._lock = threading.Lock()

    def loaded(self, name: str) -> bool:
        return name in self._pairs

    def peek(self, name: str) -> ModelPair | None:
        """The pair if it is loaded, without loading it."""
        return self._pairs.get(name)

    def get(self, name: str) -> ModelPair:
        """The named preset's pair, loading it on first use; ``PairError`` with a readable message."""
        with self._lock:
            if name in self._pairs:
                self._pairs.move_to_end(name)
                return self._pairs[name]
            if name not in presets():
                raise PairError(f"unknown pair {name!r}; pick one of: {', '.join(presets())}")
            with DEVICE_LOCK:
                while len(self._pairs) >= self.max_loaded:
                    self._pairs.popitem(last=False)
                    free_device_memory()
                pair, failure = _load(name)
                if pair is None:  # nothing of the failed load is referenced any more (its traceback ended)
                    free_device_memory()
                    raise PairError(failure)
            self._pairs[name] = pair
            return pair

    def preload(self, name: str) -> threading.Thread:
        """Load (and, on the compiled engine, compile) a pair in the background, so the first visitor finds
        it ready; one who comes sooner waits for it behind the page's loading message."""

        def load() -> None:
            try:
                self.get(name)
            except PairError as exc:
                log.warning("preloading %s failed: %s", name, exc)

        thread = threading.Thread(target=load, daemon=True, name=f"mtad-preload-{name}")
        thread.start()
        return thread


def _load(name: str) -> tuple[ModelPair | None, str]:
    """(the preset's pair, "") ready to serve, compiled where it can be; (None, why) when it cannot be loaded.
    Nothing of a failed load survives the return: the caller frees the device's memory next."""
    try:
        pair = load_pair(name)
        if pair.engine != "compiled" or compiled(pair, name):
            return pair, ""
        del pair  # the compiled copy goes before the eager one loads: never both in memory
        free_device_memory()
        return load_pair(name, engine="eager"), ""
    except torch.cuda.OutOfMemoryError:
        return None, f"pair {name!r} does not fit in the GPU's memory; use a smaller pair"
    except PairError as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken file or package: the visitor reads a sentence, the log the rest
        log.exception("loading the pair %s failed", name)
        return None, f"pair {name!r} could not be loaded ({type(exc).__name__}: {str(exc)[:200]}); pick another pair"


def compiled(pair: ModelPair, name: str) -> bool:
    """Compile every shape the page can ask for before any visitor; False (with the traceback in the log) where
    compiling fails (a compiler broken on this machine, or its on-disk cache still failing once emptied): the
    pair then serves on the eager engine, slower, and its status line says "eager". Running out of memory
    while compiling is raised: such a pair does not fit."""
    try:
        seconds = warm_up_pair(pair, int(PARAMS["gamma"].widget_range[1]) + 1)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception:  # noqa: BLE001 - whatever the compiler raises, the page must go on
        # the traceback as text: a log record that kept the exception would keep the compiled pair alive
        log.warning("compiling %s failed; it runs on the eager engine\n%s", name, traceback.format_exc())
        return False
    log.info("compiled the models of %s in %.0f s", name, seconds)
    return True


def free_device_memory() -> None:
    """Return cached CUDA memory to the driver (a no-op on the CPU). Call it after an ``except`` block, not
    inside: until the handler ends, its traceback keeps the failed frames' caches and logits alive."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


ACTIVE: set[threading.Thread] = set()
HISTORY: deque[tuple[str, str, int]] = deque(maxlen=16)  # (method, final state, steps) of recent lanes
WORKER_LOST = "the lane ended without a result (an error in the server; its log has the details)"


def energy_tools(device: torch.device) -> tuple[object | None, object | None, str]:
    """(meter, sampler, reason) from ``mtad.energy``; (None, None, reason) where there is none."""
    try:
        meter, sampler = EnergyMeter(device), PowerSampler(device, hz=20)
    except Exception as exc:  # noqa: BLE001 - a broken meter must never break a run
        return None, None, f"energy meter failed: {exc}"
    if not meter.available:
        return None, None, meter.reason or "no GPU"
    return meter, (sampler if sampler.available else None), ""


class LaneWorker(threading.Thread):
    """Decodes one lane on the device, alone, and reports each Step through ``events``.

    Events: ("compiling",) when the compiled engine first meets these settings' shapes (compiled untimed,
    before the clock), ("started", LaneEnergy without readings), ("step", Step, wall_seconds_since_start),
    and always, last, ("end", state, error, LaneEnergy), whatever the decoder, the meter or the sampler raised.
    """

    def __init__(self, pair: ModelPair, prompt_ids: list[int], settings: Settings, cancel: threading.Event) -> None:
        super().__init__(daemon=True, name=f"mtad-lane-{settings.method}")
        self.pair, self.prompt_ids, self.settings, self.cancel = pair, prompt_ids, settings, cancel
        self.events: queue.Queue = queue.Queue()
        self.sampler: object | None = None
        self.ended = False

    def live_samples(self) -> list[tuple[float, float]]:
        """Power samples so far (empty without a sampler)."""
        try:
            return list(self.sampler.samples()) if self.sampler is not None else []
        except Exception:  # noqa: BLE001
            return []

    def run(self) -> None:
        ACTIVE.add(self)
        try:
            with DEVICE_LOCK:
                self._decode()
        except BaseException as exc:  # noqa: BLE001 - outside the decoder's own guard: still an end event
            log.exception("lane %s failed", self.settings.method)
            if not self.ended:
                self._end("error", internal_error(exc), LaneEnergy(reason="no reading: the lane failed"))
        finally:
            ACTIVE.discard(self)

    def _end(self, state: str, error: str | None, energy: LaneEnergy) -> None:
        self.ended = True
        self.events.put(("end", state, error, energy))

    def _decode(self) -> None:
        meter, sampler, reason = energy_tools(self.pair.device)
        energy = LaneEnergy(available=meter is not None, reason=reason or "")
        state, error, n, metering = "done", None, 0, False
        try:
            if not self.cancel.is_set() and needs_warm_up(self.pair, self.settings):
                self.events.put(("compiling",))
                warm_up_settings(self.pair, self.settings)  # untimed: the clock is the decoder's alone
            if self.cancel.is_set():  # Stop pressed before the lane started (or while it compiled)
                state = "stopped"
            else:
                self.events.put(("started", LaneEnergy(available=energy.available, reason=energy.reason)))
                if meter is not None:
                    metering = guarded(meter.start, "energy meter")[0]
                    energy.note = None if metering else METER_FAILED
                if sampler is not None and guarded(sampler.start, "power sampler")[0]:
                    self.sampler = sampler
                t0 = time.perf_counter()
                for step in decode(self.pair, self.prompt_ids, self.settings):
                    self.events.put(("step", step, time.perf_counter() - t0))
                    n += 1
                    if self.cancel.is_set():
                        state = "stopped"
                        break
        except torch.cuda.OutOfMemoryError:
            state, error = "error", OOM_MESSAGE  # memory is released below, once the traceback is gone
        except ValueError as exc:
            state, error = "error", str(exc)
        except BaseException as exc:  # noqa: BLE001 - the visitor gets a message, the log gets the traceback
            log.exception("decoding failed")
            state, error = "error", internal_error(exc)
        finally:
            if error == OOM_MESSAGE:
                free_device_memory()
            if metering:
                ok, reading = guarded(meter.stop, "energy meter")
                if ok:
                    energy.joules, energy.note, energy.source = reading.joules, reading.note, reading.source
                else:
                    energy.note = METER_FAILED
            if self.sampler is not None:
                guarded(self.sampler.stop, "power sampler")
                energy.samples = self.live_samples()
            HISTORY.append((self.settings.method, state, n))
            self._end(state, error, energy)


def internal_error(exc: BaseException) -> str:
    """What a visitor reads when a lane fails for a reason of the server's own (its log has the traceback)."""
    return f"internal error while decoding ({type(exc).__name__}); see the server log"


METER_FAILED = "the energy meter failed during the lane, so no energy figure is given"


def guarded(call: Callable[[], object], what: str) -> tuple[bool, object]:
    """(True, ``call()``'s result), or (False, None) with one line in the log when the meter or the sampler
    fails (a counter file that turned unreadable, NVML gone, a CUDA error its synchronisation re-raised):
    energy is a figure beside the tokens, never a reason for a lane to fail or hang."""
    try:
        return True, call()
    except Exception as exc:  # noqa: BLE001
        log.warning("the %s failed (%s: %s); this lane has no energy figure", what, type(exc).__name__, exc)
        return False, None


def run_lanes(
    pair: ModelPair, record: RunRecord, settings: Settings, cancel: threading.Event, interval: float = 0.1
) -> Iterator[RunRecord]:
    """Decode the record's lanes one after another, yielding the record as it fills (at most every
    ``interval`` seconds, and whenever a lane ends). Closing this generator stops the worker at its
    next iteration and frees the device."""
    for method, lane in record.lanes.items():
        if cancel.is_set():
            lane.state = "stopped"
            continue
        lane.state = "queued"
        worker = LaneWorker(pair, lane.prompt_ids, settings.with_(method=method), cancel)
        worker.start()
        try:
            last = 0.0
            yield record
            while not lane.finished:
                changed = _drain(worker, lane, pair.tokenizer, interval)
                if not lane.finished and not worker.is_alive() and worker.events.empty():
                    lane.state, lane.error, changed = "error", WORKER_LOST, True  # died without its end event
                if lane.finished or (changed and time.perf_counter() - last >= interval):
                    if worker.sampler is not None and not lane.finished:
                        lane.energy.samples = worker.live_samples()
                    last = time.perf_counter()
                    yield record
        finally:
            if not lane.finished:
                cancel.set()  # closed (Stop, cancelled job, closed tab): stop at the next iteration
        if lane.state == "error":
            for other in record.lanes.values():
                if other.state == "waiting":
                    other.state = "stopped"
            break


def _drain(worker: LaneWorker, lane: object, tokenizer: object, wait: float) -> bool:
    """Apply the worker's pending events to the lane; True if anything changed."""
    deadline = time.perf_counter() + wait
    changed = False
    while True:
        timeout = deadline - time.perf_counter()
        try:
            ev = worker.events.get(timeout=timeout) if timeout > 0 and not changed else worker.events.get_nowait()
        except queue.Empty:
            return changed
        changed = True
        if ev[0] == "compiling":
            lane.state = "compiling"
        elif ev[0] == "started":
            lane.state, lane.energy = "running", ev[1]
        elif ev[0] == "step":
            lane.add(ev[1], tokenizer, ev[2])
        elif ev[0] == "end":
            _, state, error, energy = ev
            lane.state, lane.error, lane.energy = state, error, energy
            return True
