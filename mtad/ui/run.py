"""A run, from the page's Run or the ``/run`` API: the form checked by name, the pair loaded, the lanes
decoded one after another and streamed to the page."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

import gradio as gr
import torch

from mtad.decoding import check_prompt_text, encode_prompt, refusal
from mtad.decoding.spec import check
from mtad.models.errors import PairError
from mtad.models.presets import presets
from mtad.models.static_llama import resolve_engine
from mtad.settings import Settings
from mtad.ui import availability, race
from mtad.ui.form import RunForm
from mtad.ui.inputs import as_bool, parse_settings
from mtad.ui.outputs import Refused, Stream, api_error, blank_outputs, message_html, refuse
from mtad.ui.pickers import DEFAULT_RACE, bound_text, device_name, device_text, pick_racers, shown_race
from mtad.ui.record import LaneRecord, RunRecord
from mtad.ui.runner import OOM_MESSAGE, free_device_memory, run_lanes
from mtad.ui.state import PAGE, session_of

log = logging.getLogger(__name__)
LIVE_EVERY = 0.3  # seconds between live lane refreshes (a long run must not drown the browser)
MAX_PROMPT_TOKENS_DEFAULT = 1024
"""Prompt tokens a visitor may send (``MTAD_MAX_PROMPT_TOKENS``; 0: no cap). Each lane reads the whole
prompt before its first token, so the cap bounds how long one visitor holds the device (docs/bench.md, (f))."""


def operator_int(name: str, default: int, least: int) -> int:
    """An operator's integer setting from the environment variable ``name`` (read at every run): ``default``
    when unset, or, with a warning in the log, when it is not an integer; never below ``least``."""
    raw = os.environ.get(name, "")
    try:
        return max(least, int(raw)) if raw.strip() else default
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", name, raw, default)
        return default


def max_prompt_tokens() -> int:
    """The operator's cap on a visitor's prompt tokens (``MTAD_MAX_PROMPT_TOKENS``, read at every run)."""
    return operator_int("MTAD_MAX_PROMPT_TOKENS", MAX_PROMPT_TOKENS_DEFAULT, 0)


MAX_PROMPT_CHARS_DEFAULT = 20_000
"""Prompt characters a visitor may send (``MTAD_MAX_PROMPT_CHARS``), checked before tokenizing: the token cap
bounds the device's time, this one the tokenizer's (a megabyte of text took seconds to tokenize)."""


def max_prompt_chars() -> int:
    """The operator's cap on a visitor's prompt characters (``MTAD_MAX_PROMPT_CHARS``, read at every run)."""
    return operator_int("MTAD_MAX_PROMPT_CHARS", MAX_PROMPT_CHARS_DEFAULT, 1)


def check_prompt(prompt: object) -> None:
    """ValueError naming the prompt when it is empty, longer than the operator allows in characters, or not
    text; cheap checks, made before any tokenizing."""
    if isinstance(prompt, str) and len(prompt) > (cap := max_prompt_chars()):
        raise ValueError(
            f"the prompt is {len(prompt):,} characters long; this server takes at most {cap:,} characters: shorten it"
        )
    check_prompt_text(prompt)


def check_prompt_length(n_tokens: int) -> None:
    """ValueError naming the prompt when it is longer than the operator allows."""
    cap = max_prompt_tokens()
    if cap and n_tokens > cap:
        raise ValueError(
            f"the prompt is {n_tokens:,} tokens long; this server takes at most {cap:,} prompt tokens "
            "(each lane reads the whole prompt before its first token, holding the shared device): shorten it"
        )


def check_run(
    prompt: object,
    pair_name: object,
    with_ar: object,
    values: dict,
    left: object = DEFAULT_RACE[0],
    right: object = DEFAULT_RACE[1],
) -> tuple[Settings, list[str]]:
    """Everything the run event received, checked (the API can send anything): the settings and the two
    decoders to race; ValueError naming the field."""
    check_prompt(prompt)
    check_pair(pair_name)
    as_bool("AR baseline lane", with_ar)
    chosen = pick_racers(left, right)
    settings = parse_settings(**values)
    for method in chosen:  # a method's own range (its spec) may be narrower than the page's
        check(settings.with_(method=method))
    return settings, chosen


def check_pair(pair_name: object) -> None:
    """ValueError unless ``pair_name`` is a preset this server offers and can run (the page never loads
    anything else)."""
    table = presets()
    if not isinstance(pair_name, str) or pair_name not in table:
        raise ValueError(f"model pair {str(pair_name)[:80]!r} is not offered here; pick one of: {', '.join(table)}")
    reason = availability.unavailable_reason(table[pair_name])
    if reason:
        raise ValueError(f"model pair {pair_name!r} cannot run on this server: it {reason}; pick another pair")


def run(
    prompt: str,
    pair_name: str,
    tau: float,
    beams: int,
    gamma: int,
    max_new_tokens: int,
    greedy: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    with_ar: bool,
    left: str,
    right: str,
    num_drafts: int,
    tau1: float,
    tau2: float,
    request: gr.Request,
) -> Iterator[tuple]:
    """The API's ``/run``: generate with the two raced decoders, one after another (then AR if asked),
    streaming the lanes; a refusal or a failed lane ends the job with an error naming the field or the lane.
    Its parameters are :class:`RunForm`'s fields, in order, named as the API names them."""
    form = RunForm(**{name: value for name, value in locals().items() if name != "request"})
    try:
        yield from _run(session_of(request), form)
    except Refused as exc:
        raise api_error(exc) from None


def run_page(request: gr.Request, **form: object) -> Iterator[tuple]:
    """The page's Run: the form's fields by name (app.py's ``inputs_kwargs``); a refusal only stays in the
    message area (no error badge or toast that hides the message and leaves the old status behind)."""
    with contextlib.suppress(Refused):
        yield from _run(session_of(request), RunForm(**form))


def _run(session: str, form: RunForm) -> Iterator[tuple]:
    PAGE.line.start(session)
    cancel = PAGE.cancels.take(session)
    try:
        yield from _generate(form, cancel)
    finally:
        PAGE.cancels.release(session, cancel)
        PAGE.line.leave(session)


def compiled_engine() -> bool:
    """True when pairs load on the compiled engine here: ``MTAD_ENGINE=compiled``, or ``auto`` (the default;
    ``mtad.models.static_llama.choose_engine``: a Llama target is compiled on a CPU and on a GPU alike)."""
    return resolve_engine(None) in ("auto", "compiled")


def _generate(form: RunForm, cancel: threading.Event) -> Iterator[tuple]:
    prompt, pair_name, with_ar = form.prompt, form.pair_name, form.with_ar
    left, right = form.left, form.right
    race = shown_race(left, right)
    try:
        settings, racers = check_run(prompt, pair_name, with_ar, form.settings_values(), left, right)
    except ValueError as exc:
        yield from refuse(str(exc))
    if cancel.is_set():
        stopped = message_html("Stopped while waiting in the queue.", kind="stop")
        yield blank_outputs(stopped, "Stopped before start.", race)
        return
    if not PAGE.pairs.loaded(pair_name):
        compiling = " and compiling it for this machine, under a minute" if compiled_engine() else ""
        since = "since the server started" if pair_name in PAGE.preloaded else "(first run only)"
        yield blank_outputs(message_html(), f"Loading the pair `{pair_name}`{compiling} {since}…", race)
    try:
        pair = PAGE.pairs.get(pair_name)
        prompt_ids = encode_prompt(pair, prompt, settings)
        check_prompt_length(len(prompt_ids))
        for method in racers:
            if (why := refusal(pair, method)) is not None:
                raise ValueError(f"{why} (pick another lane)")
    except (PairError, ValueError) as exc:
        yield from refuse(str(exc))
    methods = racers + (["ar"] if with_ar else [])
    record = RunRecord(
        pair=pair_name,
        device=device_name(pair.device),
        prompt=prompt,
        settings=settings.to_dict(),
        lanes={m: LaneRecord(method=m, prompt_ids=prompt_ids) for m in methods},
    )
    stream = Stream()
    try:
        for rec in run_lanes(pair, record, settings, cancel, interval=LIVE_EVERY):
            running = next((lane for lane in rec.lanes.values() if not lane.finished), None)
            now = device_text(rec, running=running is not None)
            if running is None:
                status = now
            elif cancel.is_set():
                status = f"{now} · **stopping** after the iteration in progress…"
            elif running.state == "compiling":
                status = (
                    f"{now} · compiling **{running.label}** for this device: its first run with "
                    "these settings here; the clock starts after…"
                )
            else:
                status = f"{now} · running **{running.label}**…"
            yield stream.outputs(rec, status, message=message_html() if not stream.sent else None)
    except torch.cuda.OutOfMemoryError:
        free_device_memory()
        yield from refuse(OOM_MESSAGE)
    errors = "; ".join(f"{lane.label}: {lane.error}" for lane in record.lanes.values() if lane.error)
    status = device_text(record) + bound_text(record) + (" · failed" if errors else run_tail(record))
    yield stream.outputs(record, status, message=message_html(errors) if errors else None, final=True)
    if errors:
        raise Refused(errors)


def run_tail(record: RunRecord) -> str:
    """How the run ended, for the status line."""
    if not any(lane.state == "stopped" for lane in record.lanes.values()):
        return " · done: the race above replays the lanes on one time axis (Replay re-animates the lanes too)"
    with_steps = [lane for lane in record.lanes.values() if lane.steps]
    last = with_steps[-1] if with_steps else None
    where = f" ({last.label} stopped after {len(last.steps)} iterations)" if last and last.state == "stopped" else ""
    return f" · stopped by Stop{where}"


def race_after_run(record: RunRecord | None) -> str | dict:
    """When a run ends, its lanes race again on one time axis (nothing changes when no lane has steps)."""
    if record is None or not any(lane.steps for lane in record.lanes.values()):
        return gr.skip()
    pair = PAGE.pairs.peek(record.pair)
    if pair is not None:
        race.keep_latest_race(record, pair)
    return race.run_race_html(list(record.lanes.values()), record.device)


def toggle_ar(with_ar: bool) -> dict:
    """The AR lane's box shows only while the AR baseline lane is asked for."""
    return gr.update(visible=bool(with_ar))
