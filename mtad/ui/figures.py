"""Plotly figures of a run: tokens vs seconds, accepted tokens per iteration, power and joules."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mtad.decoding.spec import SpecField, uses_draft
from mtad.energy import trapezoid_joules
from mtad.ui.record import LaneRecord

COLOURS = SpecField("colour")
"""Each method's colour in every figure and the race, from its spec (``mtad.decoding.spec``)."""
GRID = "rgba(128,128,128,0.25)"


def style(fig: go.Figure, title: str, x: str, y: str, height: int = 300) -> go.Figure:
    """Transparent, theme-neutral styling so a figure reads in light and dark mode."""
    fig.update_layout(
        title={"text": title, "x": 0.02, "font": {"size": 14}},
        height=height,
        margin={"l": 55, "r": 15, "t": 40, "b": 45},
        paper_bgcolor="rgba(0,0,0,0)",
        plot_bgcolor="rgba(0,0,0,0)",
        font={"color": "#8a8f98", "size": 12},
        legend={"orientation": "h", "y": -0.25, "x": 0},
        hovermode="x unified",
    )
    fig.update_xaxes(title_text=x, gridcolor=GRID, zeroline=False)
    fig.update_yaxes(title_text=y, gridcolor=GRID, zeroline=False)
    return fig


def tokens_vs_seconds(lanes: list[LaneRecord]) -> go.Figure:
    """Cumulative new tokens against each lane's own seconds: the slope is the speed."""
    fig = go.Figure()
    for lane in lanes:
        if not lane.steps:
            continue
        fig.add_trace(
            go.Scatter(
                x=[0.0, *lane.own_seconds()],
                y=[0, *lane.token_counts()],
                mode="lines+markers",
                name=lane.label,
                line={"color": COLOURS.get(lane.method), "shape": "hv"},
                marker={"size": 4},
            )
        )
    return style(fig, "Tokens vs seconds (slope = speed)", "seconds (each lane's own clock)", "new tokens")


def accepted_per_iteration(lanes: list[LaneRecord]) -> go.Figure:
    """Draft tokens the target accepted at each iteration (AR and MTJD draft nothing, so they are left out)."""
    fig = go.Figure()
    for lane in lanes:
        if not lane.steps or not uses_draft(lane.method):
            continue
        fig.add_trace(
            go.Bar(
                x=[s.index + 1 for s in lane.steps],
                y=[s.accepted for s in lane.steps],
                name=lane.label,
                marker={"color": COLOURS.get(lane.method)},
                customdata=[len(s.draft_ids) for s in lane.steps],
                hovertemplate="%{y} of %{customdata} drafted",
            )
        )
    fig.update_layout(barmode="group", bargap=0.2)
    return style(fig, "Accepted draft tokens per iteration", "iteration", "accepted")


def cumulative_joules(lane: LaneRecord) -> list[float]:
    """Joules at the end of each step: ``mtad.energy.trapezoid_joules`` over the power samples up to it."""
    samples = sorted(lane.energy.samples)
    return [trapezoid_joules([s for s in samples if s[0] <= end]) or 0.0 for end in lane.wall_ends]


def energy_figure(lanes: list[LaneRecord]) -> go.Figure | None:
    """Power vs seconds and cumulative joules vs tokens, or None when no lane has a meter."""
    metered = [lane for lane in lanes if lane.energy.available and lane.energy.samples]
    if not metered:
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=("Power (W) vs seconds", "Joules vs tokens (slope = J/token)"))
    for lane in metered:
        colour = COLOURS.get(lane.method)
        ts, ws = zip(*lane.energy.samples, strict=True)
        fig.add_trace(go.Scatter(x=ts, y=ws, name=f"{lane.label} W", line={"color": colour}), row=1, col=1)
        fig.add_trace(
            go.Scatter(
                x=[0, *lane.token_counts()],
                y=[0.0, *cumulative_joules(lane)],
                name=f"{lane.label} J",
                line={"color": colour, "dash": "dot"},
            ),
            row=1,
            col=2,
        )
    style(fig, "", "", "", height=300)
    fig.update_xaxes(title_text="seconds (lane's wall clock)", row=1, col=1)
    fig.update_xaxes(title_text="new tokens", row=1, col=2)
    fig.update_yaxes(title_text="W", row=1, col=1)
    fig.update_yaxes(title_text="J", row=1, col=2)
    return fig
