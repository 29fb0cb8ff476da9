"""The race: every lane's tokens against one shared time axis, played back in the browser by CSS alone.

Each lane is a bar that grows as its tokens did, on its own recorded clock: the easing function
``linear(...)`` carries the lane's curve (share of its tokens at share of the race's time), so the
animation needs no server updates. A first visitor sees a race recorded on a named device (shipped in
``assets/race.json`` by ``scripts/record_race.py``); every run ends by racing its own lanes.
"""

from __future__ import annotations

import json
from html import escape

from mtad.metrics import Metrics, speedup
from mtad.models.presets import ASSETS
from mtad.ui.figures import COLOURS
from mtad.ui.record import LABELS, LaneRecord

RACE_FILE = ASSETS / "race.json"
MAX_SECONDS = 15.0  # a longer race plays faster, as Replay does
MAX_POINTS = 120  # points of a lane's curve in its easing function


def lane_curve(lane: LaneRecord, ar: Metrics | None = None) -> dict:
    """A lane's race data: method, label, cumulative seconds of its own clock and tokens at each iteration,
    and its speed over the same run's AR lane (``ar``; ``mtad.metrics.speedup``), None without one."""
    m = lane.metrics()
    times_ar = speedup(m, ar) if ar is not None and lane.method != "ar" else None
    return {
        "method": lane.method,
        "label": lane.label,
        "seconds": [round(s, 4) for s in lane.own_seconds()],
        "tokens": lane.token_counts(),
        "times_ar": None if times_ar is None else round(times_ar, 3),
    }


def curves_of(lanes: list[LaneRecord]) -> list[dict]:
    """Race data of the lanes that have steps, each with its speed over the finished AR lane's."""
    ar = next((lane.metrics() for lane in lanes if lane.method == "ar" and lane.finished and lane.steps), None)
    return [lane_curve(lane, ar) for lane in lanes if lane.steps]


def easing(seconds: list[float], tokens: list[int], total: float) -> str:
    """``linear(...)`` mapping the share of the race's time to the share of this lane's tokens."""
    final = tokens[-1] or 1
    points = list(zip(seconds, tokens, strict=True))
    if len(points) > MAX_POINTS:
        stride = len(points) / MAX_POINTS
        points = [points[int(i * stride)] for i in range(MAX_POINTS)] + [points[-1]]
    stops = ["0 0%"]
    for t, n in points:
        stops.append(f"{n / final:.4f} {100 * t / total:.3f}%")
    stops.append("1 100%")
    return f"linear({', '.join(stops)})"


def race_html(curves: list[dict], caption: str) -> str:
    """The race of ``curves`` (see :func:`lane_curve`), each bar as long as its lane's token count relative
    to the longest, and each label with its tokens, seconds and speed over AR (when an AR lane ran)."""
    curves = [c for c in curves if c["seconds"] and c["tokens"]]
    if not curves:
        return ""
    total = max(c["seconds"][-1] for c in curves) or 1.0
    most = max(c["tokens"][-1] for c in curves) or 1
    play = min(total, MAX_SECONDS)
    rows = []
    for c in curves:
        n, secs = c["tokens"][-1], c["seconds"][-1]
        versus = f" · {c['times_ar']:.2f}× AR" if c.get("times_ar") is not None else ""
        style = (
            f"width: {100 * n / most:.1f}%; background: {COLOURS.get(c['method'], '#6b7280')}; "
            f"animation-duration: {play:.2f}s; "
            f"animation-timing-function: {easing(c['seconds'], c['tokens'], total)}"
        )
        label = LABELS.get(c["method"], c.get("label", c["method"]))
        rows.append(
            f'<div class="race-row" data-method="{escape(c["method"])}">'
            f'<span class="race-label">{escape(label)}</span>'
            f'<span class="race-track"><span class="race-bar" style="{escape(style, quote=True)}"></span></span>'
            f'<span class="race-end">{n} tokens in {secs:.2f} s{versus}</span></div>'
        )
    speed = "true time" if play == total else f"true time ×{total / play:.1f}"
    return (
        f'<div class="mtad-race"><div class="race-caption">{escape(caption)} '
        f'<span class="race-speed">({speed}; the bars grow as each lane produced its tokens)</span></div>'
        + "".join(rows)
        + "</div>"
    )


def run_race_html(lanes: list[LaneRecord], device: str) -> str:
    """A finished run's race, on one time axis, named by its device."""
    return race_html(curves_of(lanes), f"This run's race on one time axis ({device}):")


def recorded_race() -> dict | None:
    """The race shipped in ``assets/race.json``; None when it is missing or unreadable."""
    try:
        return json.loads(RACE_FILE.read_text())
    except (OSError, ValueError):
        return None


def recorded_race_html() -> str:
    """The recorded race for a first visit, saying where and on what it was recorded."""
    data = recorded_race()
    if not data:
        return ""
    s = data.get("settings", {})
    caption = (
        f"A race recorded earlier, before you wait for anything: pair {data['pair']} on {data['device']} "
        f"({data['dtype']}, {data.get('engine', 'eager')} engine, {data['recorded']}), "
        f"{s.get('max_new_tokens')} new tokens, "
        f"γ = {s.get('gamma')}, "
        f"W = {s.get('beams')}, τ = {s.get('tau')}, prompt “{data['prompt'][:60]}…”. Press Run for your own."
    )
    return race_html(data["lanes"], caption)
