"""The page's event handlers: widget values in, rendered HTML and figures out, errors as messages."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import time
from collections.abc import Iterator
from html import escape
from urllib.parse import urlencode

import gradio as gr
import torch
import transformers

from mtad.decoding import encode_prompt
from mtad.decoding.spec import racers, spec_of
from mtad.models.devices import configure_cpu_threads, resolve_device
from mtad.models.errors import PairError
from mtad.models.presets import default_pair_name, presets
from mtad.settings import Settings
from mtad.ui import availability, cards, figures, race, tokens, verify
from mtad.ui.inputs import as_bool, example_prompts, parse_settings
from mtad.ui.record import LABELS, LaneRecord, RunRecord
from mtad.ui.runner import CANCELS, OOM_MESSAGE, PAIRS, free_device_memory, run_lanes
from mtad.ui.waiting import LINE, full_text, place_text

log = logging.getLogger(__name__)
PLOT_EVERY = 2.0  # seconds between plot refreshes in Replay (a live run redraws them when a lane ends)
LIVE_EVERY = 0.3  # seconds between live lane refreshes (a long run must not drown the browser)
LIVE_TAIL = 60  # iterations a live lane draws; the whole lane is drawn once it ends
EMPTY_PROMPT = "the prompt is empty: type some text to continue"
MAX_PROMPT_TOKENS_DEFAULT = 1024
"""Prompt tokens a visitor may send (``MTAD_MAX_PROMPT_TOKENS``; 0: no cap). Each lane reads the whole
prompt before its first token; measured on the smollm2 pair, 2-core CPU, see docs/benchmarks.md."""


def max_prompt_tokens() -> int:
    """The operator's cap on a visitor's prompt tokens (``MTAD_MAX_PROMPT_TOKENS``, read at every run)."""
    raw = os.environ.get("MTAD_MAX_PROMPT_TOKENS", "")
    try:
        return max(0, int(raw)) if raw.strip() else MAX_PROMPT_TOKENS_DEFAULT
    except ValueError:
        log.warning("MTAD_MAX_PROMPT_TOKENS=%r is not an integer; using %d", raw, MAX_PROMPT_TOKENS_DEFAULT)
        return MAX_PROMPT_TOKENS_DEFAULT


def check_prompt_length(n_tokens: int) -> None:
    """ValueError naming the prompt when it is longer than the operator allows."""
    cap = max_prompt_tokens()
    if cap and n_tokens > cap:
        raise ValueError(
            f"the prompt is {n_tokens:,} tokens long; this server takes at most {cap:,} prompt tokens "
            "(each lane reads the whole prompt before its first token, holding the shared device): shorten it"
        )


# ---------------------------------------------------------------- page set-up helpers

DEFAULT_RACE = ("sd", "mtad")  # the two lanes' methods, in page order, until the visitor picks others


def pair_choices() -> list[tuple[str, str]]:
    """(label, name) for the pair dropdown: the operator's presets, those that cannot run here marked
    (or hidden, when ``MTAD_UNAVAILABLE_PAIRS=hide``; never all of them)."""
    out, hidden = [], []
    for name, p in presets().items():
        reason = availability.unavailable_reason(p)
        if reason:
            short = "needs the internet" if "internet" in reason else "needs a GPU"
            (hidden if availability.hide_unavailable() else out).append((f"{name} ({short}: not on this server)", name))
        else:
            out.append((name + (" (Hub)" if p.needs_hub else ""), name))
    return out or hidden


def pair_dropdown(current: str | None) -> dict:
    """The pair dropdown as of now (the Hub probe may have answered since the page was built)."""
    choices = pair_choices()
    names = [n for _, n in choices]
    return gr.update(choices=choices, value=current if current in names else (names[0] if names else None))


def default_pair() -> str:
    """``MTAD_PAIR`` if it names a preset, else ``embedded``, else the first preset."""
    table = presets()
    name = default_pair_name()
    return name if name in table else ("embedded" if "embedded" in table else next(iter(table), ""))


def pair_info(name: str) -> str:
    """The preset's description, whether it needs the Hub, and why it cannot run here if it cannot."""
    p = presets().get(name)
    if p is None:
        return ""
    reason = availability.unavailable_reason(p)
    if reason:
        return f"{escape(p.description)}. **Cannot run on this server:** it {escape(reason)}."
    hub = " Needs the Hugging Face Hub the first time." if p.needs_hub else ""
    return f"{escape(p.description)}.{hub} Loads once, on its first run, then stays in memory."


def pair_examples(name: str | None) -> list[tuple[str, str]]:
    """The preset's example prompts, one per label (prompt sets repeat first lines, e.g. many ``def f():``)."""
    seen, out = set(), []
    for label, text in example_prompts(presets().get(name)):
        if label not in seen:
            seen.add(label)
            out.append((label, text))
    return out


def examples_update(name: str, value: str | None) -> dict:
    """The example-prompt dropdown for a preset, ``value`` picked (empty, with a note, when it has none)."""
    ex = pair_examples(name)
    label = "Example prompts" if ex else "Example prompts (none for this pair)"
    return gr.update(choices=ex, value=value, label=label, interactive=bool(ex))


def on_pair_change(name: str, prompt: str | None) -> tuple[str, dict, dict]:
    """A new pair: its description and examples; the prompt follows only if the visitor had not typed one."""
    ex = pair_examples(name)
    typed = bool(prompt and prompt.strip()) and not any(
        prompt == text for other in presets() for _, text in pair_examples(other)
    )
    if typed or not ex:
        return pair_info(name), examples_update(name, None), gr.skip()
    return pair_info(name), examples_update(name, ex[0][1]), gr.update(value=ex[0][1])


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
    """The status line's facts about a run: the device, the pair and, read from the loaded models (the
    page's one home for them), parameter counts, dtype and engine."""
    pair = PAIRS.peek(record.pair)
    facts = f" · {pair_facts(pair)}" if pair is not None else ""
    return f"Ran on **{escape(record.device)}** · pair `{record.pair}`{facts}"


def pair_facts(pair: object) -> str:
    """Parameter counts, dtype and engine of a loaded pair, computed from the models themselves."""
    d, t = pair.parameters()
    dtype = str(pair.dtype).removeprefix("torch.")
    attention = getattr(pair.target.config, "_attn_implementation", None) or "eager"
    engine = f"transformers {transformers.__version__}, {attention} attention"
    return f"draft {millions(d)}, target {millions(t)} parameters · {dtype} · {escape(engine)}"


def millions(n: int) -> str:
    """A parameter count to three significant figures: 11.8 M, 135 M, 1.34 B, 250 k."""
    if n >= 1e9:
        return f"{n / 1e9:.3g} B"
    return f"{n / 1e6:.3g} M" if n >= 1e6 else f"{n / 1e3:.3g} k"


def lane_note(method: str, settings: dict) -> str:
    """The settings that matter for a lane, for its title bar: the ones its spec uses, by their symbols."""
    return spec_of(method).note(settings)


def racer_choices() -> list[tuple[str, str]]:
    """The lane dropdowns' (label, method) choices: every registered method its spec offers as a racer."""
    return [(LABELS[m], m) for m in racers()]


def __getattr__(name: str) -> tuple[str, ...]:
    """``RACERS``: the decoders a visitor may race against each other (the AR lane is the optional third),
    read from the registry when asked for."""
    if name == "RACERS":
        return racers()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------- messages and the waiting line


def message_html(text: str = "", kind: str = "error") -> str:
    """The message area under Run: stays until the next Run (empty when there is nothing to say)."""
    if not text:
        return '<div class="mtad-message mtad-message-empty"></div>'
    role = ' role="alert"' if kind == "error" else ""
    title = {"error": "Not run: ", "stop": "", "info": ""}.get(kind, "")
    return f'<div class="mtad-message mtad-message-{escape(kind)}"{role}><b>{title}</b>{escape(text)}</div>'


def _session(request: gr.Request | None) -> str:
    return (request.session_hash if request is not None else None) or "api"


def shown_race(left: object, right: object) -> tuple[str, str]:
    """The two lanes to title before a run: the visitor's picks, or the default race while they cannot run
    (the run itself refuses them with a message)."""
    try:
        first, second = pick_racers(left, right)
    except ValueError:
        return DEFAULT_RACE
    return first, second


def waiting_outputs(session: str, race: tuple[str, str] = DEFAULT_RACE) -> tuple | None:
    """(message, status, lane, lane, AR lane, keep ticking) for a session that pressed Run and has not started:
    its place in Gradio's queue, or, when its job never reached the queue (full), that it was not queued
    and nothing waits; None when there is nothing to say (not waiting, or first in line)."""
    place = LINE.place(session)
    if place is None:
        return None
    text = place_text(place)
    if place.state == "refused":
        LINE.leave(session)
        lanes = [
            tokens.placeholder_html(m, "Not queued: the queue was full. Press Run to try again.") for m in (*race, "ar")
        ]
        return message_html(text), f"Not run: {escape(text)}", *lanes, False
    if place.position <= 1:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), True
    lanes = [tokens.placeholder_html(m, text, state="line") for m in (*race, "ar")]
    return gr.skip(), f"**{text}**", *lanes, True


def full_outputs(session: str, race: tuple[str, str]) -> tuple | None:
    """(message, status, lane, lane, AR lane) when Gradio's queue is full, so a Run now would not be queued."""
    jobs = LINE.jobs() if LINE.jobs is not None else None
    if jobs is None or not jobs.full:
        return None
    text = full_text(jobs)
    lanes = [
        tokens.placeholder_html(m, "Not queued: the queue was full. Press Run to try again.") for m in (*race, "ar")
    ]
    return message_html(text), f"Not run: {escape(text)}", *lanes


def arm(left: str, right: str, request: gr.Request) -> tuple:
    """Run pressed (before the run is queued): a fresh Stop flag, a place in line, the old message cleared,
    and the ticker that shows the queue position while someone is ahead. A full queue is said at once (the
    job Gradio then refuses leaves nothing waiting)."""
    session = _session(request)
    race = shown_race(left, right)
    full = full_outputs(session, race)
    if full is not None:
        return *full, gr.Timer(active=False)
    CANCELS.arm(session)
    LINE.join(session)
    return _tick(session, left, right, cleared=True)


def on_race_change(record: RunRecord | None, left: str, right: str) -> tuple:
    """Before the first run the empty lanes take the picked decoders' titles; a finished run's lanes stay."""
    if record is not None:
        return gr.skip(), gr.skip()
    return tuple(lane_box(None, m) for m in shown_race(left, right))


def waiting_tick(left: str, right: str, request: gr.Request) -> tuple:
    """Every second from Run until the run starts: the position again (or that the full queue refused the
    run); the ticker stops once the run has started, ended or was refused."""
    return _tick(_session(request), left, right)


def _tick(session: str, left: str, right: str, cleared: bool = False) -> tuple:
    """(message, status, lane, lane, AR lane, timer); ``cleared``: the old message goes even when nothing else changes."""
    shown = waiting_outputs(session, shown_race(left, right))
    if shown is None:
        return message_html() if cleared else gr.skip(), *(gr.skip(),) * 4, gr.Timer(active=False)
    *outs, ticking = shown
    if cleared and isinstance(outs[0], dict):  # gr.skip(): the old message goes
        outs[0] = message_html()
    return *outs, gr.Timer(active=ticking)


def stop(left: str, right: str, request: gr.Request) -> tuple:
    """Stop: the run ends after the iteration in progress and frees the device; a waiting run leaves the line
    (its place and the waiting lanes are cleared at once, and nobody behind it counts it any more)."""
    session = _session(request)
    waiting = LINE.place(session) is not None
    if not CANCELS.stop(session):
        return message_html("nothing is running.", kind="info"), *(gr.skip(),) * 5
    if waiting:
        LINE.leave(session, stopped=True)
        note = "Stopped while waiting: press Run to queue again."
        lanes = [tokens.placeholder_html(m, note) for m in (*shown_race(left, right), "ar")]
        text = "Stopped while waiting in the queue: the run left the queue and will not start."
        return message_html(text, kind="stop"), escape(text), *lanes, gr.Timer(active=False)
    text = "Stop pressed: the run ends after the iteration in progress; later lanes do not start."
    return message_html(text, kind="stop"), *(gr.skip(),) * 5


def unload(request: gr.Request) -> None:
    """A closed tab stops its run and leaves the line."""
    session = _session(request)
    CANCELS.stop(session)
    CANCELS.forget(session)
    LINE.leave(session, stopped=True)


# ---------------------------------------------------------------- run


def lane_slots(record: RunRecord | None, race: tuple[str, str] = DEFAULT_RACE) -> list[str | None]:
    """The methods shown in the page's three lane boxes: the two raced methods (``race`` before a run),
    then AR (or nothing)."""
    if record is None:
        return [*race, "ar"]
    methods = [m for m in record.lanes if m != "ar"]
    return [*(methods + [None, None])[:2], "ar" if "ar" in record.lanes else None]


def lane_box(record: RunRecord | None, method: str | None, upto: int | None = None, live: bool = False) -> str:
    """One lane box's HTML: the lane (a live one drawn from its last ``LIVE_TAIL`` iterations), or its
    titled placeholder."""
    if record is None or method is None or record.lane(method) is None:
        return tokens.placeholder_html(method, "Press Run to generate.")
    lane = record.lane(method)
    tail = LIVE_TAIL if live and not (lane.finished and upto is None) else None
    return tokens.lane_html(lane, record.prompt, upto=upto, note=lane_note(method, record.settings), tail=tail)


def plots(lanes: list[LaneRecord]) -> tuple:
    """Tokens-vs-seconds, accepted-per-iteration, the energy figure (or hidden) and the energy note."""
    energy = figures.energy_figure(lanes)
    return (
        figures.tokens_vs_seconds(lanes),
        figures.accepted_per_iteration(lanes),
        gr.update(value=energy, visible=True) if energy is not None else gr.update(visible=False),
        energy_note(lanes),
    )


class Stream:
    """Turns a filling run into page updates: only lanes that changed, each drawn from its last
    iterations, and the plots only when a lane ends (or every ``plot_every`` seconds, when given).

    Measured in headless Chromium on the 2-core test machine: re-sending whole lanes every tenth of a
    second, and plotly redrawing thousand-bar charts every half second, blocked the browser for seconds at
    a time, so a click on Stop took seconds to go out.
    """

    def __init__(self, plot_every: float = math.inf) -> None:
        self.plot_every = plot_every
        self.sent: dict[str, tuple] = {}
        self.last_plot = time.perf_counter()

    def outputs(self, record: RunRecord, status: str, message: str | None = None, final: bool = False) -> tuple:
        """The run event's outputs, in the order app.py lists them."""
        slots = lane_slots(record)
        htmls = []
        changed = ended = False
        for m in slots:
            lane = record.lane(m) if m else None
            sig = (len(lane.steps), lane.state, lane.error) if lane else None
            if final or self.sent.get(m or "") != sig:
                self.sent[m or ""] = sig
                htmls.append(lane_box(record, m, live=not final))
                changed = True
                ended = ended or (lane is not None and lane.finished)
            else:
                htmls.append(gr.skip())
        lanes = list(record.lanes.values())
        now = time.perf_counter()
        if final or ended or (changed and now - self.last_plot >= self.plot_every):
            self.last_plot = now
            plot_out = plots(lanes)
        else:
            plot_out = (gr.skip(),) * 4
        card = cards.cards_html(lanes) if changed or final else gr.skip()
        data = record.to_dict(with_steps=True) if final else gr.skip()
        msg = gr.skip() if message is None else message
        return (msg, status, *htmls, card, *plot_out, record, data)


def blank_outputs(message: str, status: str, race: tuple[str, str] = DEFAULT_RACE) -> tuple:
    """Outputs for a run that did not start: the message, a fresh status, empty lanes titled ``race``."""
    htmls = [lane_box(None, m) for m in lane_slots(None, race)]
    empty = cards.cards_html([])
    return (message, status, *htmls, empty, gr.skip(), gr.skip(), gr.skip(), gr.skip(), None, {})


def energy_note(lanes: list[LaneRecord]) -> str:
    if any(lane.energy.available for lane in lanes):
        return ""
    reason = next((lane.energy.reason for lane in lanes if lane.energy.reason), "no GPU")
    return (
        f'<div class="energy-na">Energy: <b>n/a — {escape(reason)}</b>. On a GPU the page plots power (W) and '
        "joules per token from NVML's energy counter.</div>"
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
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(EMPTY_PROMPT)
    table = presets()
    if not isinstance(pair_name, str) or pair_name not in table:
        raise ValueError(f"model pair {str(pair_name)[:80]!r} is not offered here; pick one of: {', '.join(table)}")
    reason = availability.unavailable_reason(table[pair_name])
    if reason:
        raise ValueError(f"model pair {pair_name!r} cannot run on this server: it {reason}; pick another pair")
    as_bool("AR baseline lane", with_ar)
    chosen = pick_racers(left, right)
    settings = parse_settings(**values)
    for method in chosen:  # a method's own range (its spec) may be narrower than the page's
        settings.with_(method=method).validate()
    return settings, chosen


class Refused(Exception):
    """A run that did not start or failed, with the message the page already shows."""


def refuse(message: str, race: tuple[str, str] = DEFAULT_RACE) -> Iterator[tuple]:
    """Show why a run did not start (it stays on the page, the old status replaced), then end the event."""
    yield blank_outputs(message_html(message), f"Not run: {escape(message)}", race)
    raise Refused(message)


def api_error(exc: Refused) -> gr.Error:
    """The API's form of a refusal: the same words, as an error the client raises."""
    return gr.Error(str(exc), print_exception=False)


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
    """The API's run: generate with the two raced decoders, one after another (then AR if asked), streaming
    the lanes; a refusal or a failed lane ends the job with an error naming the field or the lane."""
    values = dict(locals())
    values.pop("request")
    try:
        yield from _run(_session(request), values)
    except Refused as exc:
        raise api_error(exc) from None


@functools.wraps(run, assigned=("__annotations__",))  # Gradio reads run's parameters through __wrapped__
def run_page(*args: object, **kwargs: object) -> Iterator[tuple]:
    """The page's run: :func:`run`'s parameters, but a refusal only stays in the message area (no error
    badge or toast that hides the message and leaves the old status behind)."""
    values = dict(inspect.signature(run).bind(*args, **kwargs).arguments)
    request = values.pop("request")
    with contextlib.suppress(Refused):
        yield from _run(_session(request), values)


def _run(session: str, values: dict) -> Iterator[tuple]:
    LINE.start(session)
    try:
        yield from _generate(session, values)
    finally:
        LINE.leave(session)


def _generate(session: str, values: dict) -> Iterator[tuple]:
    prompt, pair_name, with_ar = values.pop("prompt"), values.pop("pair_name"), values.pop("with_ar")
    left, right = values.pop("left"), values.pop("right")
    race = shown_race(left, right)
    try:
        settings, racers = check_run(prompt, pair_name, with_ar, values, left, right)
    except ValueError as exc:
        yield from refuse(str(exc), race)
    cancel = CANCELS.take(session)
    if cancel.is_set():
        stopped = message_html("Stopped while waiting in the queue.", kind="stop")
        yield blank_outputs(stopped, "Stopped before start.", race)
        return
    if not PAIRS.loaded(pair_name):
        yield blank_outputs(message_html(), f"Loading the pair `{pair_name}` (first run only)…", race)
    try:
        pair = PAIRS.get(pair_name)
        prompt_ids = encode_prompt(pair, prompt, settings)
        check_prompt_length(len(prompt_ids))
    except (PairError, ValueError) as exc:
        yield from refuse(str(exc), race)
    methods = racers + (["ar"] if with_ar else [])
    record = RunRecord(
        pair=pair_name,
        device=_device_name(pair.device),
        prompt=prompt,
        settings=settings.to_dict(),
        lanes={m: LaneRecord(method=m, prompt_ids=prompt_ids) for m in methods},
    )
    stream = Stream()
    try:
        for rec in run_lanes(pair, record, settings, cancel, interval=LIVE_EVERY):
            running = next((lane for lane in rec.lanes.values() if not lane.finished), None)
            if running is None:
                status = device_text(rec)
            elif cancel.is_set():
                status = f"{device_text(rec)} · **stopping** after the iteration in progress…"
            else:
                status = f"{device_text(rec)} · running **{running.label}**…"
            yield stream.outputs(rec, status, message=message_html() if not stream.sent else None)
    except torch.cuda.OutOfMemoryError:
        free_device_memory()
        yield from refuse(OOM_MESSAGE, race)
    errors = "; ".join(f"{lane.label}: {lane.error}" for lane in record.lanes.values() if lane.error)
    status = device_text(record) + (" · failed" if errors else run_tail(record))
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


def pick_racers(left: object, right: object) -> list[str]:
    """The two decoders to race, checked: known, and not the same one twice."""
    for side, m in (("left", left), ("right", right)):
        if m not in racers():
            raise ValueError(f"the {side} lane must be one of {', '.join(racers())}; got {m!r}")
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


def race_after_run(record: RunRecord | None) -> str | dict:
    """When a run ends, its lanes race again on one time axis (nothing changes when no lane has steps)."""
    if record is None or not any(lane.steps for lane in record.lanes.values()):
        return gr.skip()
    return race.run_race_html(list(record.lanes.values()), record.device)


def toggle_ar(with_ar: bool) -> dict:
    return gr.update(visible=bool(with_ar))


# ---------------------------------------------------------------- replay


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
    n = max(1, len(lane.steps)) if lane else 1
    return gr.update(value=min(n, max(1, int(iteration or 1) + delta)))


def previous_iteration(record: RunRecord | None, method: str, iteration: float) -> dict:
    return shift_iteration(record, method, iteration, -1)


def next_iteration(record: RunRecord | None, method: str, iteration: float) -> dict:
    return shift_iteration(record, method, iteration, +1)


LINK_KEYS = {  # query parameter -> the run's settings key
    "tau": "tau",
    "beams": "beams",
    "gamma": "gamma",
    "max_new": "max_new_tokens",
    "greedy": "greedy",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "seed",
    "m": "num_drafts",
    "tau1": "tau1",
    "tau2": "tau2",
}


def link_query(record: RunRecord, method: str, iteration: float) -> str:
    """The query string that reopens the page on this run's prompt, pair, settings, seed, lanes and
    iteration (see :func:`from_query`)."""
    racers = [m for m in record.lanes if m != "ar"]
    params: dict[str, object] = {"prompt": record.prompt, "pair": record.pair}
    for key, name in LINK_KEYS.items():
        value = record.settings.get(name)
        if value is not None:
            params[key] = int(value) if isinstance(value, bool) else value
    if len(racers) == 2:
        params["left"], params["right"] = racers
    params["ar"] = int("ar" in record.lanes)
    params["lane"], params["it"] = method, int(iteration or 1)
    return urlencode(params)


def link_html(record: RunRecord | None, method: str, iteration: float) -> str:
    """A link to this run and iteration, for a teacher to share."""
    if record is None or not any(lane.steps for lane in record.lanes.values()):
        return ""
    query = link_query(record, method, iteration)
    return (
        f'<div class="v-link"><a href="?{escape(query, quote=True)}" target="_blank" rel="noopener">'
        f"Link to this run at iteration {int(iteration or 1)} of {escape(LABELS.get(method, method))}</a>: it "
        "opens the page with this prompt, pair, settings and seed; Run there gives the same tokens on the same "
        "device, and the panel opens at this iteration.</div>"
    )


def from_query(current_pair: str | None, request: gr.Request) -> tuple:
    """Page load: the pair list as of now and, from a link's query parameters, the prompt, pair, settings,
    lanes and the iteration to open after the next run. Values are only put in the boxes: the run checks
    them by name as it checks typed ones; a pair must be one of the operator's presets."""
    q = dict(request.query_params) if request is not None else {}
    choices = pair_choices()
    names = [n for _, n in choices]
    pair = q.get("pair") if q.get("pair") in names else current_pair
    pair_out = gr.update(choices=choices, value=pair if pair in names else (names[0] if names else None))
    keep = gr.skip()
    outs = {key: keep for key in ("prompt", *LINK_KEYS, "ar", "left", "right")}
    if "prompt" in q:
        outs["prompt"] = gr.update(value=q["prompt"][:20_000])
    for key in LINK_KEYS:
        if key in q:
            value = q[key]
            if key == "greedy":
                outs[key] = gr.update(value=value in ("1", "true", "True"))
            else:
                try:
                    outs[key] = gr.update(value=float(value))
                except ValueError:
                    outs[key] = gr.update(value=value)  # the run refuses it by name
    if "ar" in q:
        outs["ar"] = gr.update(value=q["ar"] in ("1", "true", "True"))
    for side in ("left", "right"):
        if q.get(side) in racers():
            outs[side] = gr.update(value=q[side])
    wanted = None
    if "lane" in q or "it" in q:
        try:
            wanted = {"lane": q.get("lane"), "it": int(q.get("it", "1"))}
        except ValueError:
            wanted = {"lane": q.get("lane"), "it": 1}
    message = gr.skip()
    if "prompt" in q:
        it = f" and the panel opens at iteration {wanted['it']}" if wanted else ""
        message = message_html(
            f"Opened from a link: press Run to reproduce that run (same settings and seed){it}.", kind="info"
        )
    ordered = [outs[k] for k in ("prompt", "tau", "beams", "gamma", "max_new", "greedy", "temperature", "top_k")]
    ordered += [outs[k] for k in ("top_p", "seed", "ar", "left", "right", "m", "tau1", "tau2")]
    return pair_out, *ordered, wanted, message


def lane_choices(record: RunRecord | None = None) -> list[tuple[str, str]]:
    """The lanes the verification panel can inspect: the raced methods (AR drafts nothing)."""
    methods = [m for m in record.lanes if m != "ar"] if record else list(DEFAULT_RACE)
    return [(LABELS.get(m, m), m) for m in methods]
