"""Summary cards: each lane's numbers exactly as ``mtad.metrics.summarize`` computed them."""

from __future__ import annotations

import math
from html import escape

from mtad.metrics import Metrics, speed_equation, speedup, target_call_ratio
from mtad.ui.record import LaneRecord


def fmt(x: float | None, digits: int = 3) -> str:
    """A number for a card; None or NaN shows as a dash."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}g}" if abs(x) < 10**digits else f"{x:.0f}"


def energy_text(m: Metrics, lane: LaneRecord) -> tuple[str, str]:
    """(value, tooltip) of the J/token cell: the figure, or "n/a" with why in the tooltip (never a made-up
    zero; the page's energy note says it once in full)."""
    tip = "joules from the energy meter / new tokens"
    if m.joules_per_token is not None:
        return f"{fmt(m.joules_per_token)} J", tip
    if lane.state in ("waiting", "queued", "compiling"):
        return "—", tip
    if lane.energy.available and not lane.finished:
        return "measuring…", tip
    if not lane.energy.available:
        return "n/a", f"n/a: {lane.energy.reason}"
    return "n/a", "n/a: " + (m.energy_note or "no reading")


def versus_ar(m: Metrics, lane: LaneRecord, ar: Metrics | None) -> tuple[str, str]:
    """(value, tooltip) of the card's "× AR" cell: this lane's speed over the AR lane's in the same run."""
    if lane.method == "ar":
        if not lane.steps:
            return "—", "the baseline had not run"
        return "1×", "the baseline: the target alone, one token per forward pass"
    if ar is None:
        return "—", "needs the AR lane of this same run (tick the AR baseline lane); shown once it has finished"
    ratio = speedup(m, ar)
    if ratio is None:
        return "—", "the AR lane produced no speed to compare with"
    return f"{ratio:.2f}×", "this lane's tokens/s ÷ the AR lane's tokens/s, same run, same device"


def target_call(m: Metrics, lane: LaneRecord, ar: Metrics | None) -> tuple[str, str]:
    """(value, tooltip) of the card's "per target call" cell: the seconds of one target forward, and over the
    same run's AR lane's (a one-token forward), what this lane's verification costs on this device."""
    mine = m.target_call_seconds
    tip = f"the target's forward seconds / its {m.later_target_calls} forward passes after the first step's"
    tip += " (which also reads the prompt)"
    if mine is None:
        return "—", tip
    value = f"{fmt(mine * 1e3)} ms"
    ratio = target_call_ratio(m, ar) if ar is not None and lane.method != "ar" else None
    if ratio is None:
        return value, tip
    tip += "; in brackets, over the AR lane's one-token forward: what one verification costs here"
    return f"{value} ({ratio:.2f}×)", tip


def acceptance_cell(m: Metrics) -> tuple[str, str, str]:
    """(label, value, tooltip) of the acceptance cell: accepted over drafted tokens and, where some iterations
    drafted nothing (BiLD falling back to the target, a budget's last token), in how many it drafted, so a
    100 % over a few drafting iterations does not read as every iteration's."""
    tip = "accepted / drafted tokens"
    if m.acceptance is None:
        return "acceptance", "—", tip
    label = "acceptance"
    if m.undrafted_iterations:
        label += f" (drafted in {m.iterations - m.undrafted_iterations} of {m.iterations} iterations)"
        tip += "; the other iterations drafted nothing and the target wrote their token alone"
    return label, f"{m.acceptance:.1%}", tip


EQUATION_TIP = (
    "this lane's × AR taken apart, from its own steps and the AR lane's: new tokens per target call ÷ what each "
    "call costs, in units of AR's seconds per token: one verification (the target's forwards, the prompt's read "
    "included) + the drafting + the rest (bookkeeping). The largest term is what holds this decoder back here."
)


def equation_html(m: Metrics, lane: LaneRecord, ar: Metrics | None) -> str:
    """The card's speed equation (``mtad.metrics.speed_equation``) once the lane and the AR lane have run."""
    equation = speed_equation(m, ar) if ar is not None and lane.steps else None
    if equation is None:
        return ""
    return (
        f'<div class="card-equation" title="{escape(EQUATION_TIP, quote=True)}">'
        f'× AR = {escape(equation.text())} <span class="card-equation-terms">(tokens a call ÷ (verification + '
        "drafting + rest), in AR's seconds a token)</span></div>"
    )


def card_html(lane: LaneRecord, ar: Metrics | None = None) -> str:
    """One lane's card: speed (and its ratio to the same run's AR lane, ``ar``), energy, block efficiency,
    acceptance, perplexity and repetition (with a warning when the text loops), the seconds of a target call
    (and their ratio to the AR lane's), and the speed equation that gives its × AR."""
    m = lane.metrics()
    times, tip = versus_ar(m, lane, ar)
    rows = [
        ("× AR", times, tip),
        ("tokens/s", fmt(m.tokens_per_second), "new tokens / seconds of this lane's own work"),
        ("J/token", *energy_text(m, lane)),
        ("block efficiency", fmt(m.block_efficiency), "new tokens per target forward pass (AR = 1)"),
        acceptance_cell(m),
        ("perplexity", fmt(m.perplexity), "under the target, unwarped, T = 1"),
        (
            "repeated 4-grams",
            "—" if m.repetition is None else f"{m.repetition:.0%}",
            "share of this text's 4-token sequences that already appeared in it",
        ),
        ("per target call", *target_call(m, lane, ar)),
    ]
    loop_tag = '<div class="card-loop-tag">the text loops (see below)</div>' if m.loops else ""
    cells = "".join(
        f'<div class="card-cell" title="{escape(tip, quote=True)}">'
        f'<div class="card-value{" na" if v.startswith("n/a") else ""}">{escape(v)}</div>'
        f'<div class="card-label">{escape(k)}</div>{loop_tag if k == "perplexity" else ""}</div>'
        for k, v, tip in rows
    )
    split = (
        f"{m.new_tokens} tokens in {m.seconds:.2f} s · draft {m.draft_seconds:.2f} s · "
        f"target {m.target_seconds:.2f} s · other {m.other_seconds:.2f} s"
    )
    note = f'<div class="card-note">{escape(m.energy_note)}</div>' if m.energy_note else ""
    if m.loops:
        note += (
            f'<div class="card-note card-loop">This text repeats itself ({m.repetition:.0%} of its 4-grams): '
            "its low perplexity rewards the loop, not better text.</div>"
        )
    return (
        f'<div class="mtad-card" data-method="{escape(lane.method)}">'
        f'<div class="card-title">{escape(lane.label)} <span class="card-state">{escape(lane.state)}</span></div>'
        f'<div class="card-grid">{cells}</div><div class="card-split">{escape(split)}</div>'
        f"{equation_html(m, lane, ar)}{note}</div>"
    )


def cards_html(lanes: list[LaneRecord]) -> str:
    """All lanes' cards side by side."""
    if not lanes:
        return '<div class="mtad-cards mtad-cards-empty">Summaries appear here as the lanes run.</div>'
    ar = next((lane for lane in lanes if lane.method == "ar" and lane.finished and lane.steps), None)
    ar_metrics = ar.metrics() if ar is not None else None
    return '<div class="mtad-cards">' + "".join(card_html(lane, ar_metrics) for lane in lanes) + "</div>"
