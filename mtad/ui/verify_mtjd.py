"""The verification panel of an MTJD lane: the target's own beams at one iteration and their joint log p.

MTJD drafts nothing and verifies nothing: each iteration is a beam search of width W over K tokens with the
target, and the best beam's tokens are written. So the panel shows the beams, best first, with the joint
log-probability each was ranked by (the run's distribution: warped when sampling, the T = 1 softmax when greedy), and
the kept block's tokens with their log p under that distribution and under the target at T = 1 (what perplexity reads).
"""

from __future__ import annotations

import math
from html import escape

import plotly.graph_objects as go

from mtad.events import Step
from mtad.text import token_pieces
from mtad.ui.figures import style
from mtad.ui.record import LaneRecord
from mtad.ui.tokens import prob, visible

KEPT, OTHER = "#4d7c0f", "#9ca3af"


def _num(x: float | None) -> str:
    return f"{x:.3f}" if x is not None and math.isfinite(x) else "−∞"


def _pieces(lane: LaneRecord, index: int, tokenizer: object | None, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [f"#{t}" for t in ids]
    context = list(lane.prompt_ids) + [t for s in lane.steps[:index] for t in s.appended_ids]
    return token_pieces(tokenizer, context, ids)


def _order(step: Step) -> list[int]:
    scores = step.beam_scores or []
    return sorted(range(len(step.beams or [])), key=lambda b: -(scores[b] if scores[b] is not None else -math.inf))


def panel_html(lane: LaneRecord, index: int, tokenizer: object | None = None) -> str:
    """The panel text for iteration ``index`` of an MTJD lane."""
    index = max(0, min(int(index), len(lane.steps) - 1))
    step = lane.steps[index]
    head = f'<div class="v-head">{escape(lane.label)} · iteration {index + 1} of {len(lane.steps)}'
    if not step.beams:
        return (
            f'<div class="mtad-verify">{head}</div><p>A one-token block (K = 1, or one token of the budget '
            "left): the target drew it itself, exactly as autoregressive decoding does. Nothing was searched "
            "or verified.</p></div>"
        )
    k = max(len(b) for b in step.beams)
    head += f" · {k} token(s) jointly, W = {len(step.beams)} beams over the target, {step.target_calls} target forwards</div>"
    rows = []
    for b in _order(step):
        pieces = _pieces(lane, index, tokenizer, step.beams[b])
        toks = "".join(f'<span class="vtok">{escape(visible(p))}</span>' for p in pieces)
        chosen = b == step.best_beam
        rows.append(
            f'<tr class="{"beam-chosen" if chosen else ""}"><td>{"★ " if chosen else ""}beam {b + 1}</td>'
            f"<td>{toks}</td><td>{_num(step.beam_scores[b])}</td></tr>"
        )
    beams = (
        '<div class="v-sub">The target\'s beams (best by joint log p first; ★ = the one written)</div>'
        '<table class="v-table"><tr><th>beam</th><th>tokens</th><th>joint log p</th></tr>' + "".join(rows) + "</table>"
    )
    kept = _pieces(lane, index, tokenizer, step.appended_ids)
    joint, prev, lines = step.log_p, 0.0, []
    for i, piece in enumerate(kept):
        lp = joint[i] - prev if i < len(joint) and joint[i] is not None and math.isfinite(prev) else None
        prev = joint[i] if i < len(joint) and joint[i] is not None else -math.inf
        t1 = step.target_logprobs[i] if i < len(step.target_logprobs) else None
        lines.append(
            f'<tr class="row-acc"><td>{i + 1}</td><td><span class="vtok">{escape(visible(piece))}</span></td>'
            f"<td>{_num(lp)}</td><td>{_num(joint[i] if i < len(joint) else None)}</td>"
            f"<td>{prob(t1) if t1 is not None else '—'}</td></tr>"
        )
    block = (
        '<div class="v-sub">The written block</div><table class="v-table"><tr><th>i</th><th>x_i</th>'
        "<th>log p_i(x_i)</th><th>joint log p, prefix i</th><th>p at T = 1</th></tr>" + "".join(lines) + "</table>"
    )
    verdict = (
        '<div class="v-verdict"><p>MTJD writes the <b>best beam\'s</b> tokens: a beam search over the target '
        "approximates the most likely next K tokens under its joint distribution. There is no draft and no acceptance "
        "rule, so τ plays no part; MTAD approximates this choice with a small draft model and one target "
        "forward. Each of the K beam steps is one target forward over W rows, which is why this lane is "
        "slow.</p></div>"
    )
    return f'<div class="mtad-verify">{head}{beams}{block}{verdict}</div>'


def panel_figure(lane: LaneRecord, index: int) -> go.Figure:
    """Each beam's joint log p, best first, the written one highlighted."""
    fig = go.Figure()
    index = max(0, min(int(index), len(lane.steps) - 1))
    step = lane.steps[index]
    if not step.beams:
        return style(fig, "A one-token block: the target's own draw, no beams", "", "", height=280)
    order = _order(step)
    scores = [step.beam_scores[b] for b in order]
    finite = [s for s in scores if s is not None and math.isfinite(s)]
    floor = (min(finite) if finite else 0.0) - 2.0
    fig.add_trace(
        go.Bar(
            x=[f"beam {b + 1}" for b in order],
            y=[s if s is not None and math.isfinite(s) else floor for s in scores],
            marker={"color": [KEPT if b == step.best_beam else OTHER for b in order]},
            text=[_num(s) for s in scores],
            textposition="auto",
            cliponaxis=False,
            hovertemplate="%{x}: joint log p %{text}<extra></extra>",
        )
    )
    style(fig, "MTJD: the target's beams by joint log p (green: written)", "beam", "joint log p", height=300)
    fig.update_layout(showlegend=False, hovermode="closest")
    return fig
