"""Replay: a finished run's lanes re-animated on one true time axis, with their cards and plots."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import gradio as gr

from mtad.ui import cards, figures
from mtad.ui.outputs import Refused, api_error, lane_box, lane_slots, message_html
from mtad.ui.record import RunRecord

PLOT_EVERY = 2.0  # seconds between plot refreshes in Replay (a live run redraws them when a lane ends)


def replay(record: RunRecord | None) -> Iterator[tuple]:
    """The API's replay: :func:`replay_page`, with an error when there is nothing to replay."""
    try:
        yield from _replay(record)
    except Refused as exc:
        raise api_error(exc) from None


def replay_page(record: RunRecord | None) -> Iterator[tuple]:
    """Re-animate every lane, its card and the plots on one true time axis."""
    with contextlib.suppress(Refused):
        yield from _replay(record)


def _replay(record: RunRecord | None, max_seconds: float = 15.0) -> Iterator[tuple]:
    """Each step appears when its lane's own clock reached it (sped up to last at most ``max_seconds``)."""
    if record is None or not any(lane.steps for lane in record.lanes.values()):
        message = "nothing to replay yet: run a prompt first"
        yield message_html(message), f"Not replayed: {message}", *(gr.skip(),) * 6
        raise Refused(message)
    ends = {m: lane.own_seconds() for m, lane in record.lanes.items()}
    total = max((e[-1] for e in ends.values() if e), default=0.0)
    speed = max(1.0, total / max_seconds)
    start = time.perf_counter()
    shown: dict[str, int] = {}
    last_plot = -math.inf
    slots = lane_slots(record)
    while True:
        t = (time.perf_counter() - start) * speed
        done = t >= total
        upto = {m: (len(e) if done else sum(1 for x in e if x <= t)) for m, e in ends.items()}
        if upto != shown or done:
            shown = upto
            speed_note = "" if speed == 1 else f", ×{speed:.1f} speed"
            status = f"Replay on one time axis: t = {min(t, total):.2f} s of {total:.2f} s (true time{speed_note})"
            if done:
                status = f"Replayed on one time axis: {total:.2f} s (true time{speed_note})"
            lanes = [lane.upto(upto[m]) for m, lane in record.lanes.items()]
            htmls = [lane_box(record, m, upto=upto.get(m), live=not done) if m else lane_box(None, None) for m in slots]
            now = time.perf_counter()
            if done or now - last_plot >= PLOT_EVERY:
                last_plot = now
                figs = (figures.tokens_vs_seconds(lanes), figures.accepted_per_iteration(lanes))
            else:
                figs = (gr.skip(), gr.skip())
            yield message_html(), status, *htmls, cards.cards_html(lanes), *figs
        if done:
            return
        time.sleep(0.1)
