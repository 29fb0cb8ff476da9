"""Run pressed, waiting for the device, Stop, a closed tab: the page's side of the waiting line
(:class:`mtad.ui.waiting.WaitingLine`) and of each session's Stop flag."""

from __future__ import annotations

import gradio as gr

from mtad.ui import tokens
from mtad.ui.outputs import lane_box, markdown_text, message_html
from mtad.ui.pickers import DEFAULT_RACE, shown_race
from mtad.ui.record import RunRecord
from mtad.ui.state import PAGE, session_of
from mtad.ui.waiting import full_text, place_text


def waiting_outputs(session: str, race: tuple[str, str] = DEFAULT_RACE) -> tuple | None:
    """(message, status, lane, lane, AR lane, keep ticking) for a session that pressed Run and has not started:
    its place in Gradio's queue, or, when its job never reached the queue (full), that it was not queued
    and nothing waits; None when there is nothing to say (not waiting, or first in line)."""
    place = PAGE.line.place(session)
    if place is None:
        return None
    text = place_text(place)
    if place.state == "refused":
        PAGE.line.leave(session)
        lanes = [
            tokens.placeholder_html(m, "Not queued: the queue was full. Press Run to try again.") for m in (*race, "ar")
        ]
        return message_html(text), f"Not run: {markdown_text(text)}", *lanes, False
    if place.position <= 1:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), True
    lanes = [tokens.placeholder_html(m, text, state="line") for m in (*race, "ar")]
    return gr.skip(), f"**{text}**", *lanes, True


def full_outputs(session: str, race: tuple[str, str]) -> tuple | None:
    """(message, status, lane, lane, AR lane) when Gradio's queue is full, so a Run now would not be queued."""
    jobs = PAGE.line.jobs() if PAGE.line.jobs is not None else None
    if jobs is None or not jobs.full:
        return None
    text = full_text(jobs)
    lanes = [
        tokens.placeholder_html(m, "Not queued: the queue was full. Press Run to try again.") for m in (*race, "ar")
    ]
    return message_html(text), f"Not run: {markdown_text(text)}", *lanes


def arm(left: str, right: str, request: gr.Request) -> tuple:
    """Run pressed (before the run is queued): a fresh Stop flag, a place in line, the old message cleared,
    and the ticker that shows the queue position while someone is ahead. A full queue is said at once (the
    job Gradio then refuses leaves nothing waiting)."""
    session = session_of(request)
    race = shown_race(left, right)
    full = full_outputs(session, race)
    if full is not None:
        return *full, gr.Timer(active=False)
    if PAGE.line.busy(session):  # Gradio queues no second run for this page while its first is queued or going
        text = (
            "your previous run is still queued or running, so this press started nothing: wait for it to end, "
            "or press Stop, then Run again"
        )
        return message_html(text, kind="info"), *(gr.skip(),) * 4, gr.Timer(active=False)
    PAGE.cancels.arm(session)
    PAGE.line.join(session)
    return _tick(session, left, right, cleared=True)


def waiting_tick(left: str, right: str, request: gr.Request) -> tuple:
    """Every second from Run until the run starts: the position again (or that the full queue refused the
    run); the ticker stops once the run has started, ended or was refused."""
    return _tick(session_of(request), left, right)


def _tick(session: str, left: str, right: str, cleared: bool = False) -> tuple:
    """(message, status, lane, lane, AR lane, timer); ``cleared``: the old message goes even when nothing else changes."""
    shown = waiting_outputs(session, shown_race(left, right))
    if shown is None:
        return message_html() if cleared else gr.skip(), *(gr.skip(),) * 4, gr.Timer(active=False)
    *outs, ticking = shown
    if cleared and isinstance(outs[0], dict):  # gr.skip(): the old message goes
        outs[0] = message_html()
    return *outs, gr.Timer(active=ticking)


def on_race_change(record: RunRecord | None, left: str, right: str) -> tuple:
    """Before the first run the empty lanes take the picked decoders' titles; a finished run's lanes stay."""
    if record is not None:
        return gr.skip(), gr.skip()
    return tuple(lane_box(None, m) for m in shown_race(left, right))


def stop(left: str, right: str, request: gr.Request) -> tuple:
    """Stop: the run ends after the iteration in progress and frees the device; a waiting run leaves the line
    (its place and the waiting lanes are cleared at once, and nobody behind it counts it any more)."""
    session = session_of(request)
    waiting = PAGE.line.place(session) is not None
    if not PAGE.cancels.stop(session):
        return message_html("nothing is running.", kind="info"), *(gr.skip(),) * 5
    if waiting:
        PAGE.line.leave(session, stopped=True)
        note = "Stopped while waiting: press Run to queue again."
        lanes = [tokens.placeholder_html(m, note) for m in (*shown_race(left, right), "ar")]
        text = "Stopped while waiting in the queue: the run left the queue and will not start."
        return message_html(text, kind="stop"), markdown_text(text), *lanes, gr.Timer(active=False)
    text = "Stop pressed: the run ends after the iteration in progress; later lanes do not start."
    return message_html(text, kind="stop"), *(gr.skip(),) * 5


def unload(request: gr.Request) -> None:
    """A closed tab stops its run and leaves the line."""
    session = session_of(request)
    PAGE.cancels.stop(session)
    PAGE.cancels.forget(session)
    PAGE.line.leave(session, stopped=True)
