"""The verification panel: one recorded iteration, judged again at any tau without the models."""

from __future__ import annotations

import math
from html import escape

import plotly.graph_objects as go

from mtad.decoding.rules import log_ratios, log_tau, mtad_accept_length, mtad_passes
from mtad.events import Step
from mtad.text import token_pieces
from mtad.ui.figures import style
from mtad.ui.record import LaneRecord
from mtad.ui.tokens import prob, visible
from mtad.ui.verify_mtjd import panel_figure, panel_html

PASS, FAIL = "#16a34a", "#dc2626"


def log_tau_text(tau: float) -> str:
    return num(log_tau(tau))


def num(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "−∞"


def context_before(lane: LaneRecord, index: int) -> list[int]:
    """The token ids the models saw before iteration ``index``."""
    ids = list(lane.prompt_ids)
    for s in lane.steps[:index]:
        ids.extend(s.appended_ids)
    return ids


def draft_pieces(lane: LaneRecord, index: int, tokenizer: object | None, ids: list[int]) -> list[str]:
    """Texts of drafted tokens ``ids`` after the iteration's context (token ids if no tokenizer)."""
    if tokenizer is None:
        return [f"#{t}" for t in ids]
    return token_pieces(tokenizer, context_before(lane, index), ids)


def beams_html(lane: LaneRecord, step: Step, tokenizer: object | None) -> str:
    """MTAD's W beams, best first by joint log q, the chosen one marked."""
    if not step.beams:
        return ""
    scores = step.beam_scores  # without scores (never from this library's decoders): drafting order, "—"
    order = sorted(range(len(step.beams)), key=lambda b: -scores[b]) if scores else range(len(step.beams))
    rows = []
    for b in order:
        pieces = draft_pieces(lane, step.index, tokenizer, step.beams[b])
        toks = "".join(f'<span class="vtok">{escape(visible(p))}</span>' for p in pieces)
        chosen = b == step.best_beam
        rows.append(
            f'<tr class="{"beam-chosen" if chosen else ""}"><td>{"★ " if chosen else ""}beam {b + 1}</td>'
            f"<td>{toks}</td><td>{num(scores[b]) if scores else '—'}</td></tr>"
        )
    return (
        f'<div class="v-sub">The draft model\'s {len(step.beams)} beams (best by joint log q first; '
        "★ = the one sent to the target)</div>"
        '<table class="v-table"><tr><th>beam</th><th>tokens</th><th>joint log q</th></tr>' + "".join(rows) + "</table>"
    )


def candidates_html(lane: LaneRecord, step: Step, tokenizer: object | None) -> str:
    """Every candidate the target verified this iteration, the kept part of each marked, ★ the followed one."""
    if not step.candidates:
        return ""
    kept = step.candidate_kept or [0] * len(step.candidates)
    rows = []
    for c, cand in enumerate(step.candidates):
        pieces = draft_pieces(lane, step.index, tokenizer, cand)
        toks = "".join(
            f'<span class="vtok{" vtok-kept" if i < kept[c] else ""}">{escape(visible(p))}</span>'
            for i, p in enumerate(pieces)
        )
        chosen = c == step.chosen
        rows.append(
            f'<tr class="{"beam-chosen" if chosen else ""}"><td>{"★ " if chosen else ""}{c + 1}</td>'
            f"<td>{toks}</td><td>{kept[c]} of {len(cand)}</td></tr>"
        )
    return (
        f'<div class="v-sub">All {len(step.candidates)} candidates, verified in one target forward '
        "(★ = the one whose prefix was kept)</div>"
        '<table class="v-table"><tr><th>candidate</th><th>tokens</th><th>kept</th></tr>' + "".join(rows) + "</table>"
    )


RULES = {
    "bild": "BiLD keeps draft tokens until the first whose negative log-likelihood under the target exceeds τ2, "
    "then the target writes that position (not exact: kept tokens are the draft's)",
    "spectr": "Spectr's K-SEQ tries the candidates' tokens in turn at each position (accept x with "
    "min(1, p/(ρq))), follows the candidates carrying the accepted token, and resamples from its residual "
    "when none passes (exact)",
    "specinfer": "SpecInfer's MSS walks the token tree: children are tried in turn against p, then against "
    "norm(max(0, p − q)) after each rejection; the last residual gives the token when all fail (exact)",
}


def mtad_table(step: Step, pieces: list[str], tau: float) -> str:
    """Per prefix j: log q_j, log p_j, their difference, and whether min(1, p_j/q_j) > tau."""
    passed = mtad_passes(step.log_p, step.log_q, tau)
    eta = mtad_accept_length(step.log_p, step.log_q, tau)
    rows = []
    diffs = log_ratios(step.log_p, step.log_q)
    for j, (lp, lq, d, ok) in enumerate(zip(step.log_p, step.log_q, diffs, passed, strict=True)):
        ratio = min(1.0, math.exp(d)) if math.isfinite(d) else 0.0
        cls = "row-acc" if j < eta else ""
        if ok:
            verdict = '<td class="v-pass">passes</td>'
        elif j < eta:
            verdict = f'<td class="v-fail v-kept">fails, kept: inside the passing prefix {eta}</td>'
        else:
            verdict = '<td class="v-fail">fails</td>'
        rows.append(
            f'<tr class="{cls}"><td>{j + 1}</td><td><span class="vtok">{escape(visible(pieces[j]))}</span></td>'
            f"<td>{num(lq)}</td><td>{num(lp)}</td><td>{num(d)}</td><td>{ratio:.3f}</td>{verdict}</tr>"
        )
    kept_failing = [str(j + 1) for j, ok in enumerate(passed) if j < eta and not ok]
    note = ""
    if kept_failing:
        which = ", ".join(kept_failing)
        several = len(kept_failing) > 1
        note = (
            f'<p class="v-kept-note">Prefix{"es" if several else ""} {which} fail{"" if several else "s"} on '
            f"{'their' if several else 'its'} own, yet {'their' if several else 'its'} tokens are kept: they lie "
            f"inside prefix {eta}, which passes. MTAD keeps the <b>longest</b> passing prefix, not the prefix "
            "before the first failure — a joint ratio can dip and recover, because a later token the target "
            "likes more than the draft did raises p/q for the whole prefix.</p>"
        )
    return (
        '<table class="v-table"><tr><th>prefix j</th><th>x_j</th><th>log q_j</th><th>log p_j</th>'
        "<th>log p_j − log q_j</th><th>min(1, p_j/q_j)</th><th>&gt; τ ?</th></tr>" + "".join(rows) + "</table>" + note
    )


def sd_table(step: Step, pieces: list[str]) -> str:
    """Per token i: p_i(x_i), q_i(x_i), the ratio, the uniform draw and the verdict."""
    rows = []
    tp, tq = step.token_log_p, step.token_log_q
    for i, piece in enumerate(pieces):
        ratio = math.exp(tp[i] - tq[i]) if math.isfinite(tp[i]) else 0.0
        u = f"{step.uniforms[i]:.3f}" if step.uniforms is not None else "— (greedy)"
        if i < step.accepted:
            verdict, cls = "accepted", "v-pass"
        elif i == step.accepted:
            verdict, cls = "rejected", "v-fail"
        else:
            verdict, cls = "not judged (after a rejection)", "v-skip"
        rows.append(
            f'<tr class="{"row-acc" if i < step.accepted else ""}"><td>{i + 1}</td>'
            f'<td><span class="vtok">{escape(visible(piece))}</span></td><td>{prob(tp[i])}</td><td>{prob(tq[i])}</td>'
            f'<td>{ratio:.3f}</td><td>{u}</td><td class="{cls}">{verdict}</td></tr>'
        )
    return (
        '<table class="v-table"><tr><th>i</th><th>x_i</th><th>p_i(x_i)</th><th>q_i(x_i)</th><th>p/q</th>'
        "<th>uniform u_i</th><th>verdict</th></tr>" + "".join(rows) + "</table>"
    )


def verdict_html(lane: LaneRecord, step: Step, tau: float, run_tau: float) -> str:
    """Why this prefix was accepted, in words, and what the rule says at the panel's tau."""
    g = len(step.draft_ids)
    eta = mtad_accept_length(step.log_p, step.log_q, tau)
    passing = [str(j + 1) for j, ok in enumerate(mtad_passes(step.log_p, step.log_q, tau)) if ok]
    rule = f"τ = {tau:.3f} (log τ = {log_tau_text(tau)})"
    if lane.method in RULES:
        lines = [
            f'{RULES[lane.method]}. It kept <b class="v-eta">{step.accepted}</b> of {g} draft tokens of the followed '
            "candidate, then added the target's token.",
            f"For comparison, MTAD's joint rule at {rule} would accept {eta} of this draft.",
        ]
    elif lane.method in ("mtad", "mtad-tree"):
        which = ", ".join(passing) if passing else "none"
        lines = [
            f"At {rule} the passing prefixes are: {which}. MTAD keeps the <b>longest</b> passing prefix, "
            f'so it accepts <b class="v-eta">{eta}</b> of {g} draft tokens, then takes one token from the '
            f"target at position {eta + 1}.",
            f"The run used τ = {run_tau:.3f} and accepted {step.accepted}.",
        ]
        if eta != step.accepted:
            lines.append(
                "At this τ the prefix kept would differ; the tokens after it would differ too, because the "
                "target's token would come from another position (nothing is re-run here)."
            )
        if tau >= 1:
            lines.append("τ = 1 rejects every draft: min(1, p/q) never exceeds 1, so MTAD becomes AR.")
        elif tau <= 0:
            lines.append("τ = 0 accepts every prefix the target gives a non-zero probability.")
    else:
        how = (
            "greedy SD accepts while each draft token is also the target's argmax"
            if step.uniforms is None
            else "SD accepts x_i when u_i < p_i/q_i and stops at the first rejection"
        )
        tail = "a bonus token from the target" if step.accepted == g else "a token resampled from norm(max(0, p − q))"
        lines = [
            f'{how}: it accepted <b class="v-eta">{step.accepted}</b> of {g}, then added {tail}. '
            "This is what keeps SD's output distributed exactly like the target's; τ plays no part.",
            f"For comparison, MTAD's joint rule at {rule} would accept {eta} of this draft.",
        ]
    return '<div class="v-verdict">' + "".join(f"<p>{line}</p>" for line in lines) + "</div>"


def verify_html(
    lane: LaneRecord | None, index: int, tau: float, run_tau: float, tokenizer: object | None = None
) -> str:
    """The whole panel text for iteration ``index`` of ``lane`` judged at ``tau``."""
    if lane is None or not lane.steps:
        return '<div class="mtad-verify v-empty">Run a prompt, then pick an iteration of either lane to inspect.</div>'
    if lane.method == "ar":
        return (
            '<div class="mtad-verify v-empty">The autoregressive lane drafts nothing: there is nothing to verify.</div>'
        )
    if lane.method == "mtjd":  # the target's own beams: nothing drafted, nothing verified
        return panel_html(lane, index, tokenizer)
    index = max(0, min(int(index), len(lane.steps) - 1))
    step = lane.steps[index]
    head = (
        f'<div class="v-head">{escape(lane.label)} · iteration {index + 1} of {len(lane.steps)} · '
        f"drafted {len(step.draft_ids)} token(s)"
        + (f" with W = {len(step.beams)} beams" if step.beams else "")
        + "</div>"
    )
    if not step.draft_ids:
        return (
            f'<div class="mtad-verify">{head}<p>No draft this iteration: only one token of the budget was left, '
            "so the target generated it alone.</p></div>"
        )
    pieces = draft_pieces(lane, index, tokenizer, step.draft_ids)
    parts = [head]
    parts.append(candidates_html(lane, step, tokenizer))
    if lane.method in ("mtad", "mtad-tree"):
        parts += [beams_html(lane, step, tokenizer) if not step.candidates else "", mtad_table(step, pieces, tau)]
    else:
        parts += [sd_table(step, pieces)]
    parts.append(verdict_html(lane, step, tau, run_tau))
    return '<div class="mtad-verify">' + "".join(parts) + "</div>"


def _floor(values: list[float], extra: float) -> float:
    finite = [v for v in values if math.isfinite(v)] + ([extra] if math.isfinite(extra) else [])
    return (min(finite) if finite else 0.0) - 2.0


def verify_figure(lane: LaneRecord | None, index: int, tau: float) -> go.Figure:
    """MTAD: log p_j − log q_j per prefix with the log τ line; SD: per-token log p/q against log u."""
    fig = go.Figure()
    if lane is None or not lane.steps or lane.method == "ar":
        return style(fig, "Pick an iteration", "", "", height=280)
    if lane.method == "mtjd":
        return panel_figure(lane, index)
    index = max(0, min(int(index), len(lane.steps) - 1))
    step = lane.steps[index]
    js = list(range(1, len(step.draft_ids) + 1))
    threshold = log_tau(tau)
    if lane.method in ("mtad", "mtad-tree"):
        d = log_ratios(step.log_p, step.log_q)
        floor = _floor(d, threshold)
        ok = mtad_passes(step.log_p, step.log_q, tau)
        eta = mtad_accept_length(step.log_p, step.log_q, tau)
        fig.add_trace(
            go.Bar(
                x=js,
                y=[v if math.isfinite(v) else floor for v in d],
                marker={
                    "color": [PASS if o else FAIL for o in ok],
                    "pattern": {"shape": ["" if math.isfinite(v) else "/" for v in d]},
                },
                text=[num(v) for v in d],
                textposition="auto",
                cliponaxis=False,  # a short bar's label sits above it, past the top of the axis
                name="log p_j − log q_j",
                hovertemplate="prefix %{x}: %{text}<extra></extra>",
            )
        )
        if eta:
            fig.add_vrect(x0=0.5, x1=eta + 0.5, fillcolor=PASS, opacity=0.08, line_width=0)
        if math.isfinite(threshold):
            fig.add_hline(
                y=threshold,
                line_dash="dash",
                line_color="#a855f7",
                annotation_text=f"log τ = {threshold:.2f}",
                annotation_bgcolor="rgba(255, 255, 255, 0.85)",  # readable over a hatched bar
            )
        title = f"Prefix j passes when its bar is above log τ: accepted η = {eta}"
        style(fig, title, "prefix length j", "log p_j − log q_j", height=300)
    else:
        d = log_ratios(step.token_log_p, step.token_log_q)
        logs_u = [math.log(u) if u > 0 else -math.inf for u in step.uniforms] if step.uniforms else []
        floor = _floor(d + logs_u, 0.0)
        fig.add_trace(
            go.Bar(
                x=js,
                y=[v if math.isfinite(v) else floor for v in d],
                marker={
                    "color": [PASS if i < step.accepted else FAIL for i in range(len(js))],
                    "pattern": {"shape": ["" if math.isfinite(v) else "/" for v in d]},
                },
                name="log p_i − log q_i",
                text=[num(v) for v in d],
                textposition="auto",
                cliponaxis=False,  # a short bar's label sits above it, past the top of the axis
            )
        )
        if logs_u:
            fig.add_trace(
                go.Scatter(
                    x=js,
                    y=[v if math.isfinite(v) else floor for v in logs_u],
                    mode="markers",
                    marker={"symbol": "diamond", "size": 11, "color": "#a855f7"},
                    name="log u_i (accept when the bar is above it)",
                )
            )
        if step.accepted:
            fig.add_vrect(x0=0.5, x1=step.accepted + 0.5, fillcolor=PASS, opacity=0.08, line_width=0)
        style(fig, f"SD: per-token log p/q against the uniform draw: accepted {step.accepted}", "draft token i", "log")
    fig.update_layout(showlegend=lane.method == "sd", hovermode="closest")
    fig.update_xaxes(dtick=1)
    return fig
