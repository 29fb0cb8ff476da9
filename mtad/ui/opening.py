"""What a visitor finds on opening the page: whether the pair is loaded and compiled, this device's fastest γ
and W (timed once per machine in the background after start-up, kept on disk) with one click back to the
paper's settings, and this device's latest race, else one recorded elsewhere contrasted with this device."""

from __future__ import annotations

import logging
import os
import threading
from html import escape

import gradio as gr

from mtad.models.errors import PairError
from mtad.models.pair import ModelPair
from mtad.settings import Settings
from mtad.tuning import fastest, known_fastest
from mtad.tuning.choose import Tuning
from mtad.tuning.table import table_path
from mtad.ui import race
from mtad.ui.inputs import DEFAULTS
from mtad.ui.pickers import pair_facts, pair_info, server_device
from mtad.ui.runner import DEVICE_LOCK, free_device_memory
from mtad.ui.state import PAGE

log = logging.getLogger(__name__)

TIMING: dict[str, str] = {}
"""The background timing of each pair's candidates, by pair: ``timing``, ``done`` or why it failed."""


def paper_settings() -> Settings:
    """The settings the page opens with when this device's fastest are not known: the paper's γ and W, and
    the page's default sampling (what the background timing times under)."""
    return DEFAULTS


def start(pair_name: str) -> None:
    """At start-up: load and compile ``pair_name`` in the background, then (unless ``MTAD_TIME_AT_START=0``)
    time its candidates on this device once, so the page can open with this device's fastest settings."""
    loading = PAGE.pairs.preload(pair_name)
    PAGE.preloaded[pair_name] = loading
    if os.environ.get("MTAD_TIME_AT_START", "1").strip() in ("0", "false", "no"):
        return
    if table_path(pair_name) is None:
        return
    thread = threading.Thread(target=time_candidates, args=(pair_name, loading), daemon=True, name="mtad-timing")
    thread.start()


def time_candidates(pair_name: str, loading: threading.Thread) -> None:
    """Time the pair's candidates under the page's defaults once it is loaded (read from disk when this
    machine timed them before), holding the device as a run does."""
    loading.join()
    pair = PAGE.pairs.peek(pair_name)
    if pair is None:
        return
    TIMING[pair_name] = "timing"
    try:
        with DEVICE_LOCK:
            fastest(pair, paper_settings())
        TIMING[pair_name] = "done"
    except Exception as exc:  # noqa: BLE001 - the page serves on at the paper's settings, and says why
        log.exception("timing %s's candidates at start-up failed", pair_name)
        free_device_memory()
        TIMING[pair_name] = f"failed ({type(exc).__name__})"


def device_fastest(pair_name: str) -> Tuning | None:
    """This device's fastest settings for the loaded ``pair_name`` under the page's defaults, from what it
    timed before; None when the pair is not loaded or was never timed here."""
    pair = PAGE.pairs.peek(pair_name)
    return None if pair is None else known_fastest(pair, paper_settings())


def defaults_note(pair_name: str, tuning: Tuning | None) -> str:
    """The line under γ and W saying where their values come from."""
    paper = f"γ {DEFAULTS.gamma}, W {DEFAULTS.beams}"
    if tuning is None:
        state = TIMING.get(pair_name, "")
        if state == "timing":
            return f"{paper}: the paper's settings. This device's fastest are being timed in the background…"
        if state.startswith("failed"):
            return f"{paper}: the paper's settings (timing this device's fastest {escape(state)})."
        return f"{paper}: the paper's settings (this device's fastest are not timed yet)."
    mtad, sd = tuning.best("mtad"), tuning.best("sd")
    return (
        f"γ {mtad.candidate.gamma}, W {mtad.candidate.beams}: **this device's fastest** for MTAD "
        f"(predicted {mtad.speedup:.2f}× AR; SD's best γ {sd.candidate.gamma}, {sd.speedup:.2f}× AR), timed here "
        f"under the default sampling. The paper's settings are {paper}."
    )


def status_text(pair_name: str) -> str:
    """The status line on opening: the pair ready (loaded, and compiled where it is), or loading."""
    pair = PAGE.pairs.peek(pair_name)
    if pair is not None:
        return f"Pair `{pair_name}` {ready_words(pair)} on **{escape(server_device())}** · {pair_facts(pair)} · press **Run**."
    loading = PAGE.preloaded.get(pair_name)
    if loading is not None and loading.is_alive():
        return (
            f"Starting up: loading the pair `{pair_name}` and compiling it for this device (once per start); "
            "a run pressed now starts when it is ready."
        )
    return "Nothing run yet: pick or type a prompt and press **Run** (the pair loads on its first run)."


def ready_words(pair: ModelPair) -> str:
    """Loaded, and compiled when it is."""
    return "loaded and compiled" if pair.engine == "compiled" else "loaded"


def opening_race(pair_name: str) -> str:
    """This device's latest race of the pair, else the recorded one contrasted with this device."""
    return race.latest_race_html(pair_name) or race.recorded_race_html(server_device())


def on_load(pair_name: str | None, request: gr.Request | None = None) -> tuple:
    """Page load: (γ, W, the defaults' note, status, race, the pair's note). γ and W become this device's
    fastest where they are known, unless a link sets them."""
    name = pair_name or ""
    query = dict(request.query_params) if request is not None else {}
    try:
        tuning = None if "gamma" in query or "beams" in query else device_fastest(name)
    except (PairError, ValueError, OSError):
        tuning = None
    gamma = beams = gr.skip()
    if tuning is not None:
        best = tuning.best("mtad").candidate
        gamma, beams = best.gamma, best.beams
    return gamma, beams, defaults_note(name, tuning), status_text(name), opening_race(name), pair_info(name)


def on_refresh(pair_name: str | None, shown: str | None = None) -> tuple:
    """While the pair loads at start-up: the status line says so, then that it is ready, and the timer stops.
    A status line that says anything else (a run, a refusal) is left alone."""
    name = pair_name or ""
    loading = PAGE.preloaded.get(name)
    done = PAGE.pairs.peek(name) is not None or loading is None or not loading.is_alive()
    ours = shown is None or shown.startswith(("Starting up", "Nothing run yet"))
    return (status_text(name) if ours else gr.skip()), gr.update(active=not done)


def back_to_paper(pair_name: str | None) -> tuple:
    """The paper's γ and W, back in the form, and the note saying so."""
    note = f"γ {DEFAULTS.gamma}, W {DEFAULTS.beams}: the paper's settings."
    tuning = device_fastest(pair_name or "")
    if tuning is not None:
        best = tuning.best("mtad").candidate
        note += f" This device's fastest for MTAD are γ {best.gamma}, W {best.beams}."
    return DEFAULTS.gamma, DEFAULTS.beams, note
