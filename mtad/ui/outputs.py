"""What the run and replay events put on the page, in app.py's order of their outputs: the message, the
three lane boxes, the cards, the plots and the run's record; and the refusal that ends an event."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from html import escape

import gradio as gr

from mtad.decoding.spec import spec_of
from mtad.ui import cards, figures, tokens
from mtad.ui.pickers import DEFAULT_RACE
from mtad.ui.record import LaneRecord, RunRecord

LIVE_TAIL = 60  # iterations a live lane draws; the whole lane is drawn once it ends


MARKS = frozenset("\\`*_[]!#|~:.$")
"""Characters that can start a Markdown construct (a link, an image, emphasis, a heading, a table, LaTeX,
an autolinked ``https://`` or ``www.``); backslashed, each renders as itself."""


def markdown_text(text: str) -> str:
    """``text`` for a ``gr.Markdown`` (the status line) that renders as exactly these characters, on one line:
    refusals quote what a visitor typed, which must never become a link, an image or markup."""
    out = []
    for c in " ".join(str(text).splitlines()):
        out.append(escape(c, quote=False) if c in "&<>" else f"\\{c}" if c in MARKS else c)
    return "".join(out)


def message_html(text: str = "", kind: str = "error") -> str:
    """The message area under Run: stays until the next Run (empty when there is nothing to say). ``error``: a
    run that did not start; ``refused``: another request refused (the same look, no "Not run")."""
    if not text:
        return '<div class="mtad-message mtad-message-empty"></div>'
    role = ' role="alert"' if kind in ("error", "refused") else ""
    title = {"error": "Not run: ", "refused": "", "stop": "", "info": ""}.get(kind, "")
    return f'<div class="mtad-message mtad-message-{escape(kind)}"{role}><b>{title}</b>{escape(text)}</div>'


def lane_note(method: str, settings: dict) -> str:
    """The settings that matter for a lane, for its title bar: the ones its spec uses, by their symbols."""
    return spec_of(method).note(settings)


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


def energy_note(lanes: list[LaneRecord]) -> str:
    """Why no energy is plotted (no lane had a meter), or nothing when one was measured."""
    if any(lane.energy.available for lane in lanes):
        return ""
    reason = next((lane.energy.reason for lane in lanes if lane.energy.reason), "no GPU")
    return (
        f'<div class="energy-na">Energy: <b>n/a — {escape(reason)}</b>. On a GPU the page plots power (W) and '
        "joules per token from NVML's energy counter.</div>"
    )


class Stream:
    """Turns a filling run into page updates: only lanes that changed, each drawn from its last
    iterations, and the plots only when a lane ends (or every ``plot_every`` seconds, when given).

    Re-sending whole lanes at every refresh, and plotly redrawing thousand-bar charts while a run filled,
    blocked the browser, so a click on Stop was slow to go out.
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


RUN_OUTPUTS = 12
"""A run event's outputs: message, status, three lanes, cards, four plots and notes, the record, its JSON."""


def blank_outputs(message: str, status: str, race: tuple[str, str] = DEFAULT_RACE) -> tuple:
    """Outputs for a run that did not start: the message, a fresh status, empty lanes titled ``race``."""
    htmls = [lane_box(None, m) for m in lane_slots(None, race)]
    empty = cards.cards_html([])
    return (message, status, *htmls, empty, gr.skip(), gr.skip(), gr.skip(), gr.skip(), None, {})


class Refused(Exception):
    """A run that did not start or failed, with the message the page already shows."""


def refuse(message: str) -> Iterator[tuple]:
    """Show why a run did not start (it stays on the page, the old status replaced), then end the event. The
    last run's lanes, cards, plots and record stay as they were (Replay and the panel still read them): a
    value typed wrong costs no results."""
    yield (message_html(message), f"Not run: {markdown_text(message)}", *(gr.skip(),) * (RUN_OUTPUTS - 2))
    raise Refused(message)


def api_error(exc: Refused) -> gr.Error:
    """The API's form of a refusal: the same words, as an error the client raises."""
    return gr.Error(str(exc), print_exception=False)
