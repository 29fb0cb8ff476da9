"""Run orchestration: the model-pair cache, one generation on the device at a time, lanes decoded in a
worker thread (so each lane's clock and energy count only its own work), Stop at the next iteration."""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator

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
                pair = None
                try:
                    pair = load_pair(name)
                    if pair.engine == "compiled":
                        pair = warmed_or_eager(pair, name)
                except torch.cuda.OutOfMemoryError:
                    pass  # released below: the traceback holds the half-loaded model until the handler ends
                if pair is None:
                    free_device_memory()
                    raise PairError(f"pair {name!r} does not fit in the GPU's memory; use a smaller pair")
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


def warmed_or_eager(pair: ModelPair, name: str) -> ModelPair:
    """``pair`` with every shape the page can ask for compiled before any visitor; where compiling fails (a
    compiler broken on this machine, or its on-disk cache still failing once emptied), the pair again on the
    eager engine, with a warning in the log, so that the page keeps serving (slower, and its status line
    says "eager")."""
    try:
        seconds = warm_up_pair(pair, int(PARAMS["gamma"].widget_range[1]) + 1)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the compiler raises, the page must go on
        lines = [line for line in str(exc).splitlines() if line.strip()]
        log.warning("compiling %s failed (%s: %s); it runs on the eager engine", name, type(exc).__name__, lines[-1:])
        del pair
        gc.collect()
        return load_pair(name, engine="eager")
    log.info("compiled the models of %s in %.0f s", name, seconds)
    return pair


def free_device_memory() -> None:
    """Return cached CUDA memory to the driver (a no-op on the CPU). Call it after an ``except`` block, not
    inside: until the handler ends, its traceback keeps the failed frames' caches and logits alive."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


ACTIVE: set[threading.Thread] = set()
HISTORY: deque[tuple[str, str, int]] = deque(maxlen=16)  # (method, final state, steps) of recent lanes


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
    ("end", state, error, LaneEnergy).
    """

    def __init__(self, pair: ModelPair, prompt_ids: list[int], settings: Settings, cancel: threading.Event) -> None:
        super().__init__(daemon=True, name=f"mtad-lane-{settings.method}")
        self.pair, self.prompt_ids, self.settings, self.cancel = pair, prompt_ids, settings, cancel
        self.events: queue.Queue = queue.Queue()
        self.sampler: object | None = None

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
        finally:
            ACTIVE.discard(self)

    def _decode(self) -> None:
        meter, sampler, reason = energy_tools(self.pair.device)
        energy = LaneEnergy(available=meter is not None, reason=reason or "")
        state, error, n, started = "done", None, 0, False
        try:
            if not self.cancel.is_set() and needs_warm_up(self.pair, self.settings):
                self.events.put(("compiling",))
                warm_up_settings(self.pair, self.settings)  # untimed: the clock is the decoder's alone
            if self.cancel.is_set():  # Stop pressed before the lane started (or while it compiled)
                state = "stopped"
            else:
                self.events.put(("started", LaneEnergy(available=energy.available, reason=energy.reason)))
                started, self.sampler = True, sampler
                if meter is not None:
                    meter.start()
                if self.sampler is not None:
                    self.sampler.start()
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
        except Exception as exc:  # noqa: BLE001 - the visitor gets a message, the log gets the traceback
            log.exception("decoding failed")
            state, error = "error", f"internal error while decoding ({type(exc).__name__}); see the server log"
        finally:
            if error == OOM_MESSAGE:
                free_device_memory()
            if started and meter is not None:
                reading = meter.stop()
                energy.joules, energy.note, energy.source = reading.joules, reading.note, reading.source
            if started and self.sampler is not None:
                self.sampler.stop()
                energy.samples = self.live_samples()
            HISTORY.append((self.settings.method, state, n))
            self.events.put(("end", state, error, energy))


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
