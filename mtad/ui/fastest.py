"""The page's "Fastest on this device": γ and W predicted fastest here (``mtad.tuning``), set in the form.

The prediction times a few iterations of each candidate on the device (the first time on a machine; later
the seconds are read from disk), so it waits for the device like a run, and the waiting line shows it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import gradio as gr

from mtad.models.errors import PairError
from mtad.models.pair import ModelPair
from mtad.models.presets import presets
from mtad.settings import Settings
from mtad.tuning import fastest
from mtad.tuning.choose import Tuning
from mtad.tuning.table import table_path
from mtad.ui.inputs import DEFAULTS, parse_settings
from mtad.ui.outputs import message_html
from mtad.ui.run import check_pair
from mtad.ui.runner import DEVICE_LOCK, free_device_memory
from mtad.ui.state import PAGE, session_of

log = logging.getLogger(__name__)


def fastest_page(
    pair_name: object,
    tau: object,
    greedy: object,
    temperature: object,
    top_k: object,
    top_p: object,
    request: gr.Request | None = None,
) -> Iterator[tuple[object, object, str, object]]:
    """(γ, W, message, the defaults' note), streamed: what is being timed while it is ("MTAD γ 3, W 4: 5 of
    16"), then MTAD's fastest γ and W under the form's sampling and τ, with what was predicted for MTAD and
    SD; γ and W unchanged and the reason in the message when there is no prediction to make."""
    holder = f"{session_of(request)}:fastest"  # the line's clock of the device's current job, apart from any run
    PAGE.line.start(holder)  # the session may have queued a run too
    try:
        settings = parse_settings(
            tau, DEFAULTS.beams, DEFAULTS.gamma, DEFAULTS.max_new_tokens, greedy, temperature, top_k, top_p, 0
        )
        check_pair(pair_name)
        if table_path(pair_name) is None:  # said before loading anything
            yield gr.skip(), gr.skip(), message_html(no_table(pair_name), kind="info"), gr.skip()
            return
        pair = PAGE.pairs.get(pair_name)
        timing = Timing(pair, settings)
        timing.start()
        while timing.is_alive():
            yield gr.skip(), gr.skip(), message_html(timing.progress_text(), kind="info"), gr.skip()
            timing.join(TICK)
        tuning = timing.result()
    except (PairError, ValueError) as exc:
        yield gr.skip(), gr.skip(), message_html(f"No fastest settings: {exc}", kind="refused"), gr.skip()
        return
    except Exception as exc:  # noqa: BLE001 - out of memory, a compiler failing: a message, and the page goes on
        log.exception("timing the candidates failed")
        free_device_memory()
        failed = f"No fastest settings: timing failed ({type(exc).__name__})"
        yield gr.skip(), gr.skip(), message_html(failed, "refused"), gr.skip()
        return
    finally:
        PAGE.line.leave(holder)
    best = tuning.best("mtad").candidate
    note = f"γ {best.gamma}, W {best.beams}: **this device's fastest** for MTAD under the form's sampling and τ."
    yield best.gamma, best.beams, message_html(summary(tuning), kind="info"), note


TICK = 0.5  # seconds between the progress lines while timing


class Timing(threading.Thread):
    """:func:`mtad.tuning.fastest` in a thread holding the device, telling what it is timing as it goes."""

    def __init__(self, pair: ModelPair, settings: Settings) -> None:
        super().__init__(daemon=True, name="mtad-fastest")
        self.pair, self.settings = pair, settings
        self.told: tuple[int, int, Settings] | None = None
        self._tuning: Tuning | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            with DEVICE_LOCK:
                self._tuning = fastest(self.pair, self.settings, progress=self.hear)
        except BaseException as exc:  # noqa: BLE001 - handed to the page's thread by result()
            self._error = exc

    def hear(self, done: int, total: int, settings: Settings) -> None:
        self.told = (done, total, settings)

    def progress_text(self) -> str:
        """What is being timed now, in a visitor's words."""
        if self.told is None:
            return "Timing this device's candidates (once per machine; later the seconds are read from disk)…"
        done, total, s = self.told
        what = {"ar": "AR", "sd": f"SD γ {s.gamma}"}.get(s.method, f"MTAD γ {s.gamma}, W {s.beams}")
        return f"Timing this device's candidates (once per machine): {what}: {done + 1} of {total}…"

    def result(self) -> Tuning:
        """The ranking, or what the timing raised."""
        if self._error is not None:
            raise self._error
        assert self._tuning is not None
        return self._tuning


def no_table(pair_name: str) -> str:
    """Why a pair gets no prediction, in a visitor's words, and which pairs do."""
    others = [name for name, preset in presets().items() if preset.acceptance and name != pair_name]
    text = (
        f"The pair {pair_name!r} has no measured acceptance table (how many tokens each γ and W keeps per "
        "target call, measured once per pair by its operator), so its fastest settings cannot be predicted here"
    )
    return text + (f"; {' and '.join(others)} {'has' if len(others) == 1 else 'have'} one." if others else ".")


def summary(tuning: Tuning) -> str:
    """What was predicted and set, in a sentence or two."""
    mtad, sd = tuning.best("mtad"), tuning.best("sd")
    text = (
        f"Fastest on this device, predicted from its timings and the pair's measured tokens per target call: "
        f"MTAD with γ {mtad.candidate.gamma} and W {mtad.candidate.beams} ({mtad.speedup:.2f}× AR), "
        f"SD with γ {sd.candidate.gamma} ({sd.speedup:.2f}× AR). γ and W are set for MTAD"
    )
    if sd.candidate.gamma != mtad.candidate.gamma:
        text += f"; SD's lane runs with the same γ (its own best is {sd.candidate.gamma})"
    return text + ". Press Run to measure."
