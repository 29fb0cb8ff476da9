"""The page's "Fastest on this device": γ and W predicted fastest here (``mtad.tuning``), set in the form.

The prediction times a few iterations of each candidate on the device (the first time on a machine; later
the seconds are read from disk), so it waits for the device like a run, and the waiting line shows it."""

from __future__ import annotations

import logging

import gradio as gr

from mtad.models.errors import PairError
from mtad.models.presets import presets
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
) -> tuple[object, object, str]:
    """(γ, W, message): MTAD's fastest γ and W under the form's sampling and τ, with what was predicted for
    MTAD and SD; γ and W unchanged and the reason in the message when there is no prediction to make."""
    holder = f"{session_of(request)}:fastest"  # the line's clock of the device's current job, apart from any run
    PAGE.line.start(holder)  # the session may have queued a run too
    try:
        settings = parse_settings(
            tau, DEFAULTS.beams, DEFAULTS.gamma, DEFAULTS.max_new_tokens, greedy, temperature, top_k, top_p, 0
        )
        check_pair(pair_name)
        if table_path(pair_name) is None:  # said before loading anything
            return gr.skip(), gr.skip(), message_html(no_table(pair_name), kind="info")
        pair = PAGE.pairs.get(pair_name)
        with DEVICE_LOCK:
            tuning = fastest(pair, settings)
    except (PairError, ValueError) as exc:
        return gr.skip(), gr.skip(), message_html(f"No fastest settings: {exc}", kind="refused")
    except Exception as exc:  # noqa: BLE001 - out of memory, a compiler failing: a message, and the page goes on
        log.exception("timing the candidates failed")
        free_device_memory()
        return (
            gr.skip(),
            gr.skip(),
            message_html(f"No fastest settings: timing failed ({type(exc).__name__})", "refused"),
        )
    finally:
        PAGE.line.leave(holder)
    best = tuning.best("mtad").candidate
    return best.gamma, best.beams, message_html(summary(tuning), kind="info")


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
