"""The page's event handlers: widget values in, rendered HTML and figures out, errors as messages."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from html import escape

import gradio as gr
import torch

from mtad.decoding import encode_prompt
from mtad.pair import PairError, configure_cpu_threads, default_pair_name, presets, resolve_device
from mtad.ui import cards, figures, tokens, verify
from mtad.ui.inputs import example_prompts, parse_settings
from mtad.ui.record import LABELS, LaneRecord, RunRecord
from mtad.ui.runner import CANCELS, OOM_MESSAGE, PAIRS, free_device_memory, run_lanes

log = logging.getLogger(__name__)
LANES = ("sd", "mtad", "ar")
"""The default lanes: two racing decoders (the visitor may pick others) and the optional AR lane."""
RACERS = ("sd", "mtad", "mtad-tree", "bild", "spectr", "specinfer")
"""The decoders a visitor may race against each other."""
PLOT_EVERY = 0.5  # seconds between live plot refreshes (lanes refresh every iteration batch)
EMPTY_PROMPT = "the prompt is empty: type some text to continue"


# ---------------------------------------------------------------- page set-up helpers


def pair_choices() -> list[tuple[str, str]]:
    """(label, name) for the pair dropdown: the operator's presets only."""
    return [(name + ("" if not p.needs_hub else " (Hub)"), name) for name, p in presets().items()]


def default_pair() -> str:
    """``MTAD_PAIR`` if it names a preset, else ``embedded``, else the first preset."""
    table = presets()
    name = default_pair_name()
    return name if name in table else ("embedded" if "embedded" in table else next(iter(table), ""))


def pair_info(name: str) -> str:
    """The preset's description, and whether it needs the Hub."""
    p = presets().get(name)
    if p is None:
        return ""
    hub = " Needs the Hugging Face Hub the first time (not available offline)." if p.needs_hub else ""
    return f"{escape(p.description)}.{hub} Loads once, on its first run, then stays in memory."


def examples_update(name: str) -> dict:
    """The example-prompt dropdown for a preset, its first prompt picked (empty, with a note, when none)."""
    ex = example_prompts(presets().get(name))
    label = "Example prompts" if ex else "Example prompts (none for this pair)"
    return gr.update(choices=ex, value=ex[0][1] if ex else None, label=label, interactive=bool(ex))


def on_pair_change(name: str) -> tuple[str, dict]:
    return pair_info(name), examples_update(name)


def on_example(prompt: str | None) -> dict:
    return gr.update(value=prompt) if prompt else gr.skip()


def server_device() -> str:
    """What this server decodes on, in words, for the page header."""
    dev = resolve_device("auto")
    if dev.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(dev)}"
    configure_cpu_threads()  # what loading a pair will set: the header must say what runs
    return f"{_cpu_label()}, no GPU"


def device_text(record: RunRecord) -> str:
    pair = PAIRS.peek(record.pair)
    size = ""
    if pair is not None:
        d, t = pair.parameters()
        dtype = str(pair.dtype).removeprefix("torch.")
        size = f" · draft {millions(d)}, target {millions(t)} parameters, {dtype}"
    return f"Ran on **{escape(record.device)}** · pair `{record.pair}`{size}"


def millions(n: int) -> str:
    """A parameter count in words: 68 M, 1.3 B, 250 k."""
    if n >= 1e9:
        return f"{n / 1e9:.1f} B"
    return f"{n / 1e6:.0f} M" if n >= 1e7 else (f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.0f} k")


def lane_note(method: str, settings: dict) -> str:
    """The settings that matter for a lane, for its title bar."""
    if method == "ar":
        return ""
    g = f"γ = {settings.get('gamma')}"
    if method == "sd":
        return g
    if method in ("spectr", "specinfer"):
        return f"m = {settings.get('num_drafts')}, {g}"
    if method == "bild":
        return f"{g}, τ1 = {settings.get('tau1'):g}, τ2 = {settings.get('tau2'):g}"
    return f"W = {settings.get('beams')}, {g}, τ = {settings.get('tau'):g}"


def slots(record: RunRecord | None) -> tuple[str, str, str]:
    """Which method each of the page's three lane boxes shows: the two racers, then AR."""
    racers = [m for m in record.lanes if m != "ar"] if record else []
    return (*racers, "ar") if len(racers) == 2 else LANES


# ---------------------------------------------------------------- run


def arm(request: gr.Request) -> None:
    """Before a run is queued: a fresh Stop flag for this session (so Stop works while queued)."""
    CANCELS.arm(request.session_hash or "api")


def stop(request: gr.Request) -> None:
    """Stop: the run ends at its next iteration and frees the device."""
    if CANCELS.stop(request.session_hash or "api"):
        gr.Info("Stopping at the next iteration.")


def unload(request: gr.Request) -> None:
    """A closed tab stops its run."""
    session = request.session_hash or "api"
    CANCELS.stop(session)
    CANCELS.forget(session)


def outputs(record: RunRecord | None, status: str, plots: bool, final: bool = False) -> tuple:
    """The run event's outputs, in the order app.py lists them."""
    lanes = list(record.lanes.values()) if record else []
    prompt = record.prompt if record else ""
    notes = {m: lane_note(m, record.settings) for m in slots(record)} if record else {}
    lane_htmls = [
        tokens.lane_html(record.lane(m) if record else None, prompt, note=notes.get(m, "")) for m in slots(record)
    ]
    if plots:
        energy = figures.energy_figure(lanes)
        plot_out = (
            figures.tokens_vs_seconds(lanes),
            figures.accepted_per_iteration(lanes),
            gr.update(value=energy, visible=True) if energy is not None else gr.update(visible=False),
            energy_note(lanes),
        )
    else:
        plot_out = (gr.skip(), gr.skip(), gr.skip(), gr.skip())
    data = record.to_dict(with_steps=final) if record else {}
    return (status, *lane_htmls, cards.cards_html(lanes), *plot_out, record, data)


def energy_note(lanes: list[LaneRecord]) -> str:
    if any(lane.energy.available for lane in lanes):
        return ""
    reason = next((lane.energy.reason for lane in lanes if lane.energy.reason), "no GPU")
    return (
        f'<div class="energy-na">Energy: <b>n/a — {escape(reason)}</b>. On a GPU the page plots power (W) and '
        "joules per token from NVML's energy counter.</div>"
    )


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
    request: gr.Request,
    left: str = "sd",
    right: str = "mtad",
    num_drafts: int = 4,
    tau1: float = 0.9,
    tau2: float = 2.0,
) -> Iterator[tuple]:
    """Generate with the two picked decoders (default SD, then MTAD; then AR if asked), streaming the lanes."""
    try:
        settings = parse_settings(
            tau, beams, gamma, max_new_tokens, greedy, temperature, top_k, top_p, seed, num_drafts, tau1, tau2
        )
        racers = pick_racers(left, right)
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    if not isinstance(prompt, str) or not prompt.strip():
        raise gr.Error(EMPTY_PROMPT)
    if pair_name not in presets():
        raise gr.Error(f"unknown pair {pair_name!r}; pick one of the listed pairs")
    cancel = CANCELS.take(request.session_hash or "api")
    if not PAIRS.loaded(pair_name):
        yield outputs(None, f"Loading the pair `{pair_name}` (first run only)…", plots=False)
    try:
        pair = PAIRS.get(pair_name)
        prompt_ids = encode_prompt(pair, prompt, settings)
    except (PairError, ValueError) as exc:
        raise gr.Error(str(exc)) from None
    methods = racers + (["ar"] if with_ar else [])
    record = RunRecord(
        pair=pair_name,
        device=_device_name(pair.device),
        prompt=prompt,
        settings=settings.to_dict(),
        lanes={m: LaneRecord(method=m, prompt_ids=prompt_ids) for m in methods},
    )
    last_plot = 0.0
    try:
        for rec in run_lanes(pair, record, settings, cancel):
            now = time.perf_counter()
            plots = now - last_plot >= PLOT_EVERY or any(
                lane.state in ("done", "stopped") for lane in rec.lanes.values()
            )
            if plots:
                last_plot = now
            running = next((lane for lane in rec.lanes.values() if not lane.finished), None)
            status = f"{device_text(rec)} · running **{running.label}**…" if running else device_text(rec)
            yield outputs(rec, status, plots=plots)
    except torch.cuda.OutOfMemoryError:
        free_device_memory()
        raise gr.Error(OOM_MESSAGE) from None
    stopped = any(lane.state == "stopped" for lane in record.lanes.values())
    tail = " · stopped" if stopped else " · done: press Replay to race the lanes on one time axis"
    yield outputs(record, device_text(record) + tail, plots=True, final=True)
    errors = [f"{lane.label}: {lane.error}" for lane in record.lanes.values() if lane.error]
    if errors:
        raise gr.Error("; ".join(errors))


def pick_racers(left: object, right: object) -> list[str]:
    """The two decoders to race, checked: known, and not the same one twice."""
    for side, m in (("left", left), ("right", right)):
        if m not in RACERS:
            raise ValueError(f"the {side} lane must be one of {', '.join(RACERS)}; got {m!r}")
    if left == right:
        raise ValueError(f"both lanes are {LABELS[left]}: pick two different decoders to race")
    return [str(left), str(right)]


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return _cpu_label()


def _cpu_label() -> str:
    n = torch.get_num_threads()
    return f"CPU ({n} thread{'s' if n != 1 else ''})"


def toggle_ar(with_ar: bool) -> dict:
    return gr.update(visible=bool(with_ar))


# ---------------------------------------------------------------- replay


def replay(record: RunRecord | None, max_seconds: float = 15.0) -> Iterator[tuple]:
    """Re-animate every lane on one true time axis (each step appears when its lane's clock reached it)."""
    if record is None or not any(lane.steps for lane in record.lanes.values()):
        raise gr.Error("nothing to replay yet: run a prompt first")
    ends = {m: lane.own_seconds() for m, lane in record.lanes.items()}
    total = max((e[-1] for e in ends.values() if e), default=0.0)
    speed = max(1.0, total / max_seconds)
    start = time.perf_counter()
    shown: dict[str, int] = {}
    while True:
        t = (time.perf_counter() - start) * speed
        upto = {m: sum(1 for x in e if x <= t) for m, e in ends.items()}
        if upto != shown or t >= total:
            shown = upto
            speed_note = "" if speed == 1 else f", ×{speed:.1f} speed"
            status = f"Replay on one time axis: t = {min(t, total):.2f} s of {total:.2f} s (true time{speed_note})"
            htmls = []
            for m in slots(record):
                lane = record.lane(m)
                note = lane_note(m, record.settings)
                htmls.append(tokens.lane_html(lane, record.prompt, upto=upto.get(m), note=note))
            yield (status, *htmls)
        if t >= total:
            return
        time.sleep(0.05)


# ---------------------------------------------------------------- verification panel


def _lane(record: RunRecord | None, method: str) -> LaneRecord | None:
    return record.lane(method) if record else None


def _tokenizer(record: RunRecord | None) -> object | None:
    pair = PAIRS.peek(record.pair) if record else None
    return pair.tokenizer if pair is not None else None


def verify_view(record: RunRecord | None, method: str, iteration: float, tau: float) -> tuple:
    """Panel HTML and chart for 1-based ``iteration`` of ``method``'s lane re-judged at ``tau``."""
    lane = _lane(record, method)
    tau = min(1.0, max(0.0, float(tau if tau is not None and math.isfinite(tau) else 0.0)))
    index = int(iteration or 1) - 1
    run_tau = record.settings.get("tau", tau) if record else tau
    html = verify.verify_html(lane, index, tau, run_tau, _tokenizer(record))
    return html, verify.verify_figure(lane, index, tau)


def verify_lane(record: RunRecord | None, method: str, tau: float) -> tuple:
    """A lane picked: iteration 1 and the slider's range for that lane; tau kept."""
    lane = _lane(record, method)
    n = max(1, len(lane.steps)) if lane else 1
    html, fig = verify_view(record, method, 1, tau)
    return gr.update(maximum=max(n, 2), value=1, interactive=n > 1), html, fig


def verify_reset(record: RunRecord | None, method: str) -> tuple:
    """After a run: the lane's first iteration, judged at the run's own tau."""
    tau = record.settings.get("tau", 0.1) if record else 0.1
    slider, html, fig = verify_lane(record, method, tau)
    return slider, gr.update(value=tau), html, fig


def verify_reset_lanes(record: RunRecord | None, method: str) -> tuple:
    """After a run: the lane picker offers the raced decoders (kept if still raced), then :func:`verify_reset`."""
    choices = lane_choices(record)
    values = [v for _, v in choices]
    method = method if method in values else values[-1]
    return (gr.update(choices=choices, value=method), *verify_reset(record, method))


def lane_choices(record: RunRecord | None = None) -> list[tuple[str, str]]:
    return [(LABELS[m], m) for m in slots(record)[:2]]
