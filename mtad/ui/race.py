"""The race: every lane's tokens against one shared time axis, played back in the browser by CSS alone.

Each lane is a bar that grows as its tokens did, on its own recorded clock: the easing function
``linear(...)`` carries the lane's curve (share of its tokens at share of the race's time), so the
animation needs no server updates. A first visitor sees this device's latest race (kept on disk after
every run, per device and pair), else one recorded elsewhere (shipped in ``assets/race.json`` by
``scripts/record_race.py``) with its device contrasted with this one; every run ends by racing its own lanes.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
from html import escape
from pathlib import Path

import torch

from mtad.metrics import Metrics, speedup
from mtad.models.devices import device_model
from mtad.models.gguf_cache import cache_root
from mtad.models.pair import ModelPair
from mtad.models.presets import ASSETS, presets
from mtad.ui.figures import COLOURS
from mtad.ui.inputs import example_prompts
from mtad.ui.record import LABELS, LaneRecord, RunRecord

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
    """The race of ``curves`` (see :func:`lane_curve`), each label with its tokens, seconds and speed over AR
    (when an AR lane ran). The bars grow as the lanes did and come to rest as long as each lane's tokens a
    second relative to the fastest lane's, so the winner (marked) is the one full bar."""
    curves = [c for c in curves if c["seconds"] and c["tokens"]]
    if not curves:
        return ""
    total = max(c["seconds"][-1] for c in curves) or 1.0
    most = max(c["tokens"][-1] for c in curves) or 1
    rates = [c["tokens"][-1] / max(c["seconds"][-1], 1e-9) for c in curves]
    best = max(range(len(curves)), key=rates.__getitem__)
    play = min(total, MAX_SECONDS)
    rows = []
    for i, c in enumerate(curves):
        n, secs = c["tokens"][-1], c["seconds"][-1]
        versus = f" · {c['times_ar']:.2f}× AR" if c.get("times_ar") is not None else ""
        style = (
            f"--grown: {100 * n / most:.1f}%; --rest: {100 * rates[i] / rates[best]:.1f}%; "
            f"background: {COLOURS.get(c['method'], '#6b7280')}; animation-duration: {play:.2f}s, 0.8s; "
            f"animation-delay: 0s, {play:.2f}s; "
            f"animation-timing-function: {easing(c['seconds'], c['tokens'], total)}, ease-out"
        )
        label = LABELS.get(c["method"], c.get("label", c["method"]))
        won = ' <b class="race-won">fastest</b>' if i == best and len(curves) > 1 else ""
        share = "" if i == best else f" · {rates[i] / rates[best]:.0%} of the fastest's speed"
        rows.append(
            f'<div class="race-row{" race-winner" if won else ""}" data-method="{escape(c["method"])}">'
            f'<span class="race-label">{escape(label)}{won}</span>'
            f'<span class="race-track"><span class="race-bar" style="{escape(style, quote=True)}"></span></span>'
            f'<span class="race-end">{n} tokens in {secs:.2f} s ({rates[i]:.1f} tok/s){versus}{share}</span></div>'
        )
    speed = "true time" if play == total else f"true time ×{total / play:.1f}"
    return (
        f'<div class="mtad-race"><div class="race-caption">{escape(caption)} '
        f'<span class="race-speed">({speed}; the bars grow as each lane produced its tokens, then rest at each '
        "lane's speed against the fastest)</span></div>" + "".join(rows) + "</div>"
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


def recorded_race_html(server: str = "") -> str:
    """The recorded race for a first visit, saying where and on what it was recorded, and, given this
    ``server``'s device in words, that its own speeds will differ."""
    data = recorded_race()
    if not data:
        return ""
    elsewhere = f" This server decodes on {server}: its own speeds differ." if server else ""
    caption = (
        f"A race recorded elsewhere, before you wait for anything: {described(data)}.{elsewhere} "
        "Press Run for a race on this device."
    )
    return race_html(data["lanes"], caption)


def described(data: dict) -> str:
    """A kept race's pair, device, dtype, engine, date, settings and prompt, in words."""
    s = data.get("settings", {})
    return (
        f"pair {data['pair']} on {data['device']} ({data['dtype']}, {data.get('engine', 'eager')} engine, "
        f"{data['recorded']}), {s.get('max_new_tokens')} new tokens, γ = {s.get('gamma')}, W = {s.get('beams')}, "
        f"τ = {s.get('tau')}, prompt “{data['prompt'][:60]}…”"
    )


def race_record(record: RunRecord, pair: ModelPair) -> dict:
    """A finished run's race as kept on disk (``assets/race.json``'s format): its pair, device, dtype, engine,
    date, settings, prompt and lanes' curves."""
    threads = torch.get_num_threads()
    device = (
        torch.cuda.get_device_name(pair.device)
        if pair.device.type == "cuda"
        else f"{device_model(torch.device('cpu'))}, {threads} thread{'s' if threads != 1 else ''}"
    )
    return {
        "pair": record.pair,
        "device": device,
        "dtype": str(pair.dtype).removeprefix("torch."),
        "engine": pair.engine,
        "recorded": datetime.date.today().isoformat(),
        "prompt": record.prompt,
        "settings": {k: record.settings.get(k) for k in ("tau", "beams", "gamma", "max_new_tokens", "greedy", "seed")},
        "lanes": curves_of(list(record.lanes.values())),
    }


def latest_race_file(pair_name: str) -> Path:
    """Where this device's latest race of ``pair_name`` is kept (under the cache, one file per device)."""
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    key = f"{device_model(dev)}|{pair_name}"
    return cache_root() / "races" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def keep_latest_race(record: RunRecord, pair: ModelPair) -> None:
    """Keep a finished run's race as this device's latest, for the next first visit. The prompt is kept only
    when it is one of the pair's example prompts: a visitor's own text is never shown to the next one. Lanes
    that were stopped or failed do not make a race worth showing, and are not kept."""
    if len(record.lanes) < 2 or any(lane.state != "done" or not lane.steps for lane in record.lanes.values()):
        return
    data = race_record(record, pair)
    if record.prompt not in {text for _, text in example_prompts(presets().get(record.pair))}:
        data["prompt"] = "a visitor's own (not shown)"
    path = latest_race_file(record.pair)
    with contextlib.suppress(OSError):  # a read-only cache only costs the next visitor this device's race
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(data, indent=1) + "\n")
        partial.replace(path)


def latest_race_html(pair_name: str) -> str:
    """This device's latest race of ``pair_name`` for a first visit, named as such; empty when none is kept."""
    try:
        data = json.loads(latest_race_file(pair_name).read_text())
        caption = f"This device's latest race, before you wait for anything: {described(data)}. Press Run for yours."
        return race_html(data["lanes"], caption)
    except (OSError, ValueError, KeyError, TypeError):
        return ""
