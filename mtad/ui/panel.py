"""The verification panel's events: a lane and an iteration picked, τ moved, previous / next; the panel
itself is drawn by :mod:`mtad.ui.verify`."""

from __future__ import annotations

import math

import gradio as gr

from mtad.ui import verify
from mtad.ui.pickers import DEFAULT_RACE
from mtad.ui.record import LABELS, LaneRecord, RunRecord, nearest_iteration
from mtad.ui.state import PAGE


def lane_choices(record: RunRecord | None = None) -> list[tuple[str, str]]:
    """The lanes the verification panel can inspect: the raced methods (AR drafts nothing)."""
    methods = [m for m in record.lanes if m != "ar"] if record else list(DEFAULT_RACE)
    return [(LABELS.get(m, m), m) for m in methods]


def _lane(record: RunRecord | None, method: str) -> LaneRecord | None:
    return record.lane(method) if record else None


def _tokenizer(record: RunRecord | None) -> object | None:
    pair = PAGE.pairs.peek(record.pair) if record else None
    return pair.tokenizer if pair is not None else None


def verify_view(record: RunRecord | None, method: str, iteration: float, tau: float) -> tuple:
    """Panel HTML and chart for 1-based ``iteration`` of ``method``'s lane re-judged at ``tau``. A value typed
    into the sliders' boxes out of range (they reach here unchecked) is taken at the nearest end."""
    lane = _lane(record, method)
    tau = min(1.0, max(0.0, float(tau if isinstance(tau, int | float) and math.isfinite(tau) else 0.0)))
    index = nearest_iteration(lane, iteration) - 1
    run_tau = record.settings.get("tau", tau) if record else tau
    settings = record.settings if record else {}
    html = verify.verify_html(lane, index, tau, run_tau, _tokenizer(record), settings)
    return html, verify.verify_figure(lane, index, tau, settings)


def verify_lane(record: RunRecord | None, method: str, tau: float) -> tuple:
    """A lane picked: iteration 1 and the slider's range for that lane; tau kept."""
    lane = _lane(record, method)
    n = max(1, len(lane.steps)) if lane else 1
    html, fig = verify_view(record, method, 1, tau)
    return gr.update(maximum=max(n, 2), value=1, interactive=n > 1), html, fig


def verify_reset(record: RunRecord | None, method: str, wanted: dict | None = None) -> tuple:
    """After a run: the picked lane (or, when it has no steps, e.g. after a Stop, the last lane that has),
    its first iteration, judged at the run's own tau; ``wanted`` (from a link's ``lane`` and ``it``) picks
    the lane and iteration once, then is spent."""
    tau = record.settings.get("tau", 0.1) if record else 0.1
    choices = lane_choices(record)
    with_steps = [m for _, m in choices if (lane := _lane(record, m)) is not None and lane.steps]
    wanted = wanted or {}
    if wanted.get("lane") in with_steps:
        method = wanted["lane"]
    if method not in with_steps and with_steps:
        method = with_steps[-1]
    slider, html, fig = verify_lane(record, method, tau)
    lane = _lane(record, method)
    n = len(lane.steps) if lane else 1
    it = wanted.get("it")
    if isinstance(it, int) and 1 < it <= n:
        slider = gr.update(maximum=max(n, 2), value=it, interactive=n > 1)
        html, fig = verify_view(record, method, it, tau)
    spent = None if record is not None and record.lanes else wanted or None
    return gr.update(choices=choices, value=method), slider, gr.update(value=tau), html, fig, spent


def shift_iteration(record: RunRecord | None, method: str, iteration: float, delta: int) -> dict:
    """The iteration slider moved by ``delta`` (previous / next), kept within the lane's iterations."""
    lane = _lane(record, method)
    return gr.update(value=nearest_iteration(lane, nearest_iteration(lane, iteration) + delta))


def previous_iteration(record: RunRecord | None, method: str, iteration: float) -> dict:
    """◀ previous: one iteration back, never before the first."""
    return shift_iteration(record, method, iteration, -1)


def next_iteration(record: RunRecord | None, method: str, iteration: float) -> dict:
    """next ▶: one iteration on, never past the lane's last."""
    return shift_iteration(record, method, iteration, +1)
