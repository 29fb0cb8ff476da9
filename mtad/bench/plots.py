"""Plotly figures of the bench's sweeps: speed and perplexity against τ, W or γ on two y-axes (paper Fig. 3, Table 7),
and MTJD's perplexity and repetition against its block length K (paper Fig. 1)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mtad.bench.run import SWEPT
from mtad.decoding.mtjd import SPEC as MTJD

SWEEPS = {
    "tau": ("tau_sweep", "acceptance threshold τ"),
    "beams": ("beam_sweep", "number of beams W"),
    "gamma": ("gamma_sweep", "draft length γ"),
}


def swept_values(aggregates: Sequence[dict], param: str) -> list:
    """The distinct values ``param`` takes over the rows that use it."""
    return sorted({r[param] for r in aggregates if r.get(param) is not None})


def sweep_series(aggregates: Sequence[dict], param: str) -> dict[str, list[dict]]:
    """Rows that use ``param``, grouped by method and the other settings (one line per group), sorted by it."""
    groups: dict[str, list[dict]] = {}
    for r in aggregates:
        if r.get(param) is None:
            continue
        others = [f"{k}={r[k]:g}" for k in SWEPT if k != param and r.get(k) is not None and _varies(aggregates, k)]
        key = " ".join([r["method"], *others])
        groups.setdefault(key, []).append(r)
    return {k: sorted(v, key=lambda r: r[param]) for k, v in groups.items()}


def _varies(aggregates: Sequence[dict], param: str) -> bool:
    return len(swept_values(aggregates, param)) > 1


def sweep_figure(aggregates: Sequence[dict], param: str, subtitle: str = "") -> go.Figure | None:
    """Pooled speed (left axis, solid) and perplexity (right axis, dashed) against ``param``, error bars the
    per-run standard deviation; None if not swept.

    AR's speed and perplexity, when AR was run, are drawn as dotted reference lines.
    """
    if len(swept_values(aggregates, param)) < 2:
        return None
    name, title = SWEEPS[param]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for label, rows in sweep_series(aggregates, param).items():
        x = [r[param] for r in rows]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[r["tokens_per_second"] for r in rows],
                name=f"{label}: speed",
                mode="lines+markers",
                error_y=_errors(rows, "tokens_per_second"),
            ),
            secondary_y=False,
        )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[r["perplexity"] for r in rows],
                name=f"{label}: perplexity",
                mode="lines+markers",
                line={"dash": "dash"},
                error_y=_errors(rows, "perplexity"),
            ),
            secondary_y=True,
        )
    for r in aggregates:
        if r["method"] == "ar" and r.get("tokens_per_second") is not None:
            fig.add_hline(y=r["tokens_per_second"], line_dash="dot", annotation_text="AR speed", secondary_y=False)
            if r.get("perplexity") is not None:
                fig.add_hline(
                    y=r["perplexity"],
                    line_dash="dot",
                    line_color="gray",
                    annotation_text="AR perplexity",
                    secondary_y=True,
                )
            break
    fig.update_layout(
        title=f"Effect of the {title} on speed and perplexity" + (f"<br><sub>{subtitle}</sub>" if subtitle else ""),
        template="plotly_white",
        legend={"orientation": "h", "y": -0.2},
    )
    fig.update_xaxes(title_text=title)
    fig.update_yaxes(title_text="speed (tokens/s)", secondary_y=False)
    fig.update_yaxes(title_text="perplexity", secondary_y=True)
    fig.layout.meta = {"figure": name}
    return fig


FIGURE1 = "figure1_mtjd"


def figure1_series(aggregates: Sequence[dict]) -> dict[str, list[dict]]:
    """MTJD rows grouped by beam width and search (one line each), sorted by K; only groups with 2+ K's."""
    groups: dict[str, list[dict]] = {}
    for r in aggregates:
        if r["method"] == MTJD.name and r.get("gamma") is not None and not r.get("error"):
            groups.setdefault(f"W={r['beams']:g} {r['draft_mode']}", []).append(r)
    return {k: sorted(v, key=lambda r: r["gamma"]) for k, v in groups.items() if len({r["gamma"] for r in v}) > 1}


def ar_row(aggregates: Sequence[dict]) -> dict | None:
    """AR's row, when it ran and did not fail: the target's own decoding, for reference."""
    return next((r for r in aggregates if r["method"] == "ar" and not r.get("error")), None)


def figure1(aggregates: Sequence[dict], subtitle: str = "") -> go.Figure | None:
    """The paper's Figure 1: MTJD's pooled perplexity (left axis, solid) and share of repeated 4-grams (right
    axis, dashed) against K, one pair of lines per beam width and search, error bars the per-run std; AR's
    two figures as dotted lines. None when no MTJD row was swept over K."""
    groups = figure1_series(aggregates)
    if not groups:
        return None
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    palette = plotly.colors.qualitative.Plotly
    for g, (label, rows) in enumerate(groups.items()):
        x = [r["gamma"] for r in rows]
        colour = palette[g % len(palette)]  # a group's two lines share its colour
        for metric, name, dash, right in (
            ("perplexity", "perplexity", None, False),
            ("repetition", "repeated 4-grams", "dash", True),
        ):
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=[r.get(metric) for r in rows],
                    name=f"MTJD {label}: {name}",
                    mode="lines+markers",
                    line={"color": colour, "dash": dash or "solid"},
                    error_y=_errors(rows, metric),
                ),
                secondary_y=right,
            )
    ar = ar_row(aggregates)
    if ar is not None:
        for metric, text, right in (("perplexity", "AR perplexity", False), ("repetition", "AR repetition", True)):
            if ar.get(metric) is not None:
                fig.add_hline(
                    y=ar[metric],
                    line_dash="dot",
                    line_color="gray" if right else None,
                    annotation_text=text,
                    secondary_y=right,
                )
    fig.update_layout(
        title="MTJD: perplexity and repetition against the block length K (the paper's Figure 1)"
        + (f"<br><sub>{subtitle}</sub>" if subtitle else ""),
        template="plotly_white",
        legend={"orientation": "h", "y": -0.2},
    )
    fig.update_xaxes(title_text="tokens decoded jointly, K", dtick=1)
    fig.update_yaxes(title_text="perplexity (target, T = 1)", secondary_y=False)
    fig.update_yaxes(title_text="share of repeated 4-grams", range=[0, 1], secondary_y=True)
    fig.layout.meta = {"figure": FIGURE1}
    return fig


def _errors(rows: Sequence[dict], metric: str) -> dict | None:
    std = [r.get(f"{metric}_std") for r in rows]
    if all(s is None for s in std):
        return None
    return {"type": "data", "array": [0 if s is None else s for s in std], "visible": True}


def kaleido_available() -> bool:
    """Whether plotly can write PNGs here (kaleido importable); the bench never installs it."""
    return importlib.util.find_spec("kaleido") is not None


def figure_names() -> list[str]:
    """Every figure :func:`save_sweep_figures` can write, without its extension."""
    return [name for name, _ in SWEEPS.values()] + [FIGURE1]


def save_sweep_figures(
    aggregates: Sequence[dict], out: Path, subtitle: str = "", plotlyjs: str = "inline"
) -> list[Path]:
    """Write ``tau_sweep``/``beam_sweep``/``gamma_sweep`` as HTML (and PNG with kaleido) for each swept setting,
    and ``figure1_mtjd`` when MTJD was swept over K."""
    paths = []
    figs = [(name, sweep_figure(aggregates, param, subtitle)) for param, (name, _) in SWEEPS.items()]
    for name, fig in [*figs, (FIGURE1, figure1(aggregates, subtitle))]:
        if fig is None:
            continue
        html = out / f"{name}.html"
        fig.write_html(html, include_plotlyjs=True if plotlyjs == "inline" else "cdn")
        paths.append(html)
        if kaleido_available():
            try:
                fig.write_image(out / f"{name}.png", width=900, height=520, scale=2)
                paths.append(out / f"{name}.png")
            except Exception:  # kaleido present but without a browser: HTML is enough
                pass
    return paths
