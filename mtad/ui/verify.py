"""The verification panel: one recorded iteration, judged again at any tau without the models."""

from __future__ import annotations

import math
from html import escape

import plotly.graph_objects as go

from mtad.decoding.rules import log_ratios, log_tau, mtad_accept_length, mtad_passes
from mtad.decoding.spec import SpecField, registry
from mtad.events import Step
from mtad.metrics import excluded_by_position
from mtad.text import token_pieces
from mtad.ui.figures import style
from mtad.ui.record import LaneRecord
from mtad.ui.tokens import prob, visible
from mtad.ui.verify_mtjd import panel_figure, panel_html

PASS, FAIL = "#16a34a", "#dc2626"
ZERO_STUB = 0.03  # the height a zero acceptance probability is drawn at, hatched, so its bar stays visible


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


RULES = SpecField("rule")
"""Each method's sentence on how it verifies (its spec's ``rule``; empty where the panel explains it)."""


def panel_of(lane: LaneRecord) -> str:
    """Which panel explains the lane's iterations (its spec's ``panel``; SD's for a method not registered)."""
    spec = registry().get(lane.method)
    return spec.panel if spec is not None else "sd"


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


def piece_of(lane: LaneRecord, index: int, tokenizer: object | None, token: int) -> str:
    """The text of one token drawn or listed at iteration ``index`` (decoded after that iteration's context)."""
    return visible(draft_pieces(lane, index, tokenizer, [token])[0])


def vtok(text: str) -> str:
    return f'<span class="vtok">{escape(text)}</span>'


def residual_text(lane: LaneRecord, index: int, tokenizer: object | None, top: list) -> str:
    """A residual distribution's likeliest tokens, e.g. ``'a' 0.41 · 'b' 0.20``."""
    return " · ".join(f"{vtok(piece_of(lane, index, tokenizer, t))} {pr:.3g}" for t, pr in top)


def multidraft_table(lane: LaneRecord, step: Step, tokenizer: object | None) -> str:
    """Spectr's and SpecInfer's walk, position by position: each candidate token tried in order with p(x),
    q(x), the acceptance probability and the uniform draw (Spectr: with its rho); the residual after a
    rejection (SpecInfer: after each, since the next try is judged against it; Spectr: once, when none
    passed) and the token drawn from it. Greedy: the candidates against the target's argmax."""
    spectr = panel_of(lane) == "kseq"
    greedy = all(t.get("u") is None for t in step.walk)
    head = ["position", "try", "x", "p(x)" if spectr or greedy else "p_k(x)", "q(x)"]
    if not greedy:
        head += (["ρ", "min(1, p/(ρq))"] if spectr else ["min(1, p_k/q)"]) + ["u"]
    head.append("verdict")
    rows = []
    for i, t in enumerate(step.walk):
        pos = i + 1
        for k, x in enumerate(t["tokens"][: len(t["p"])]):
            p, q = t["p"][k], t["q"][k]
            ok = t["accepted"] == k
            cells = [str(pos), str(k + 1), vtok(piece_of(lane, step.index, tokenizer, x)), f"{p:.3g}", f"{q:.3g}"]
            if greedy:
                verdict = "the target's argmax: kept" if ok else "not the target's argmax"
            else:
                rho = t["rho"] or 1.0
                ratio = min(1.0, p / (rho * q)) if q > 0 else 1.0
                cells += ([f"{rho:.3f}"] if spectr else []) + [f"{ratio:.3f}", f"{t['u'][k]:.3f}"]
                verdict = "u below it: accepted" if ok else "u above it: rejected"
            cls = "v-pass" if ok else "v-fail"
            rows.append(
                f'<tr class="{"row-acc" if ok else ""}">'
                + "".join(f"<td>{c}</td>" for c in cells)
                + f'<td class="{cls}">{verdict}</td></tr>'
            )
            if not ok and not greedy and (not spectr or k == len(t["p"]) - 1) and t["residuals"]:
                top = t["residuals"][min(k, len(t["residuals"]) - 1) if not spectr else 0]
                what = "residual norm(max(0, p_k − q)) now" if not spectr else "K-SEQ's residual"
                rows.append(
                    f'<tr class="v-residual"><td>{pos}</td><td></td><td colspan="{len(head) - 3}">{what}: '
                    f"{residual_text(lane, step.index, tokenizer, top)}</td><td></td></tr>"
                )
        if t["draw"] is not None:
            drawn = vtok(piece_of(lane, step.index, tokenizer, t["draw"]))
            source = "the target's argmax" if greedy else "drawn from the residual"
            rows.append(
                f'<tr class="v-residual"><td>{pos}</td><td></td><td colspan="{len(head) - 3}">no candidate passed: '
                f'{drawn}, {source}, ends the iteration</td><td class="v-fail">replaced</td></tr>'
            )
    return (
        '<table class="v-table v-walk"><tr>'
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )


def bild_table(lane: LaneRecord, step: Step, tokenizer: object | None, settings: dict) -> str:
    """BiLD per draft position: the little model's top probability against τ1 (drafting goes on while it is
    at least τ1) and each draft token's negative log-likelihood under the target against τ2 (kept while
    at most τ2); a last row when the little model fell back before γ tokens."""
    tau1, tau2 = settings.get("tau1"), settings.get("tau2")
    tops = step.draft_top_q or []
    pieces = draft_pieces(lane, step.index, tokenizer, step.draft_ids)
    nll = [max(0.0, -v) if not math.isnan(v) else v for v in step.token_log_p]  # −log p ≥ 0: no −0.000
    rows = []
    for i, piece in enumerate(pieces):
        top = f"{tops[i]:.3f} ≥ τ1" if i < len(tops) else "—"
        over = not nll[i] <= tau2 if tau2 is not None else False
        if i < step.accepted:
            verdict, cls = "kept", "v-pass"
        elif i == step.accepted:
            verdict, cls = "rolled back: NLL above τ2", "v-fail"
        else:
            verdict, cls = "dropped (after the rollback)", "v-skip"
        rows.append(
            f'<tr class="{"row-acc" if i < step.accepted else ""}"><td>{i + 1}</td><td>{vtok(visible(piece))}</td>'
            f"<td>{top}</td><td>{num(nll[i])}</td><td>{'&gt; τ2' if over else '≤ τ2'}</td>"
            f'<td class="{cls}">{verdict}</td></tr>'
        )
    if len(tops) > len(pieces):
        reached = step.accepted == len(pieces)
        verdict = "fallback: the big model writes this position" if reached else "fallback (the rollback came first)"
        rows.append(
            f'<tr class="v-residual"><td>{len(pieces) + 1}</td><td>—</td><td>{tops[len(pieces)]:.3f} &lt; τ1</td>'
            f'<td>—</td><td>—</td><td class="v-fail">{verdict}</td></tr>'
        )
    t1 = f"{tau1:g}" if tau1 is not None else "?"
    t2 = f"{tau2:g}" if tau2 is not None else "?"
    return (
        f'<div class="v-sub">τ1 = {t1} (fallback: the little model drafts while its top probability is at '
        f"least τ1) · τ2 = {t2} nats (rollback: a draft token stays while its NLL under the target is at most "
        "τ2)</div>"
        '<table class="v-table"><tr><th>i</th><th>x_i</th><th>little model\'s top q</th><th>NLL −log p_i(x_i)</th>'
        "<th>vs τ2</th><th>verdict</th></tr>" + "".join(rows) + "</table>"
    )


def distributions_html(step: Step, lane: LaneRecord | None = None) -> str:
    """What p and q are in this panel, why a prefix can be −∞, and how many of the lane's iterations had
    every prefix at −∞."""
    text = (
        "p and q are the <b>warped distributions</b>: the target's and the draft's next-token distributions after this "
        "run's temperature, top-k and top-p (greedy: plain softmax at T = 1) — the distributions the rule compares, not "
        "the raw models."
    )
    if any(not math.isfinite(v) for v in step.log_p):
        text += (
            " A <b>−∞</b> here is log 0: a drafted token lies outside the target's top-k / top-p, so the warped "
            "target gives it probability 0, and every prefix containing it has joint log p = −∞ and fails."
        )
    if lane is not None:
        text += disagreement_text(lane)
    return f'<p class="v-distributions">{text}</p>'


def disagreement_text(lane: LaneRecord) -> str:
    """How often, in this lane, the warped target gave the draft's token probability 0, per position (the
    draft's disagreement with the target's top-k / top-p; ``mtad.metrics.excluded_by_position``)."""
    reached, excluded = excluded_by_position(lane.steps)
    if not any(excluded):
        return ""
    shares = [
        f"at position {i + 1} in {e} of {r} ({e / r:.0%}{'; every prefix at −∞ there' if i == 0 else ''})"
        for i, (r, e) in enumerate(zip(reached, excluded, strict=True))
        if e
    ]
    return (
        f" <b>The draft's disagreement</b> in this lane: the warped target excluded the draft's token "
        f"{', '.join(shares)} of the iterations that reached that position with every earlier token allowed."
    )


def target_token_html(lane: LaneRecord, step: Step, tokenizer: object | None) -> str:
    """The token the target itself wrote this iteration after the accepted drafts (its bonus, recovered or
    fallback token), marked as the lanes mark it; empty when it wrote none (a stopped or ended text)."""
    k = next((k for k, mine in enumerate(step.from_target) if mine), None)
    if k is None or k >= len(step.appended_ids):
        return ""
    token = step.appended_ids[k]
    before = context_before(lane, step.index) + list(step.appended_ids[:k])
    text = visible(token_pieces(tokenizer, before, [token])[0]) if tokenizer is not None else f"#{token}"
    return f'<span class="vtok v-target-token">{escape(text)}</span>'


def verdict_html(lane: LaneRecord, step: Step, tau: float, run_tau: float, tokenizer: object | None = None) -> str:
    """Why this prefix was accepted, in words, naming the target's own token, and what the rule says at the
    panel's tau."""
    g = len(step.draft_ids)
    written = target_token_html(lane, step, tokenizer)
    named = f" {written}" if written else ""
    eta = mtad_accept_length(step.log_p, step.log_q, tau)
    passing = [str(j + 1) for j, ok in enumerate(mtad_passes(step.log_p, step.log_q, tau)) if ok]
    rule = f"τ = {tau:.3f} (log τ = {log_tau_text(tau)})"
    panel, how = panel_of(lane), RULES.get(lane.method)
    if how:
        followed = " of the followed candidate" if panel in ("kseq", "mss") else ""
        lines = [
            f'{how}. It kept <b class="v-eta">{step.accepted}</b> of {g} draft tokens{followed}, '
            f"then added the target's token{named}.",
            f"For comparison, MTAD's joint rule at {rule} would accept {eta} of this draft.",
        ]
    elif panel == "mtad":
        which = ", ".join(passing) if passing else "none"
        lines = [
            f"At {rule} the passing prefixes are: {which}. MTAD keeps the <b>longest</b> passing prefix, "
            f'so it accepts <b class="v-eta">{eta}</b> of {g} draft tokens, then takes one token from the '
            f"target at position {eta + 1}.",
            f"The run used τ = {run_tau:.3f}: it accepted {step.accepted}, then the target wrote{named or ' nothing'}.",
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
            f'{how}: it accepted <b class="v-eta">{step.accepted}</b> of {g}, then added {tail}{named}. '
            "This is what keeps SD's output distributed exactly like the target's; τ plays no part.",
            f"For comparison, MTAD's joint rule at {rule} would accept {eta} of this draft.",
        ]
    return '<div class="v-verdict">' + "".join(f"<p>{line}</p>" for line in lines) + "</div>"


def verify_html(
    lane: LaneRecord | None,
    index: int,
    tau: float,
    run_tau: float,
    tokenizer: object | None = None,
    settings: dict | None = None,
) -> str:
    """The whole panel text for iteration ``index`` of ``lane`` judged at ``tau`` (``settings``: the run's,
    for BiLD's τ1 and τ2)."""
    if lane is None or not lane.steps:
        return '<div class="mtad-verify v-empty">Run a prompt, then pick an iteration of either lane to inspect.</div>'
    panel = panel_of(lane)
    if panel == "none":
        return (
            '<div class="mtad-verify v-empty">The autoregressive lane drafts nothing: there is nothing to verify.</div>'
        )
    if panel == "target-beams":  # the target's own beams: nothing drafted, nothing verified
        return panel_html(lane, index, tokenizer)
    index = max(0, min(int(index), len(lane.steps) - 1))
    step = lane.steps[index]
    head = (
        f'<div class="v-head">{escape(lane.label)} · iteration {index + 1} of {len(lane.steps)} · '
        f"drafted {len(step.draft_ids)} token(s)"
        + (f" with W = {len(step.beams)} beams" if step.beams else "")
        + "</div>"
    )
    fell_back = panel == "rollback" and bool(step.draft_top_q)
    if not step.draft_ids and not fell_back:
        return (
            f'<div class="mtad-verify">{head}<p>No draft this iteration: only one token of the budget was left, '
            "so the target generated it alone.</p></div>"
        )
    pieces = draft_pieces(lane, index, tokenizer, step.draft_ids)
    parts = [head, distributions_html(step, lane)]
    parts.append(candidates_html(lane, step, tokenizer))
    if panel == "mtad":
        parts += [beams_html(lane, step, tokenizer) if not step.candidates else "", mtad_table(step, pieces, tau)]
    elif panel in ("kseq", "mss") and step.walk:
        parts += [multidraft_table(lane, step, tokenizer)]
    elif panel == "rollback" and step.draft_top_q is not None:
        parts += [bild_table(lane, step, tokenizer, settings or {})]
    else:
        parts += [sd_table(step, pieces)]
    parts.append(verdict_html(lane, step, tau, run_tau, tokenizer))
    return '<div class="mtad-verify">' + "".join(parts) + "</div>"


def _floor(values: list[float], extra: float) -> float:
    finite = [v for v in values if math.isfinite(v)] + ([extra] if math.isfinite(extra) else [])
    return (min(finite) if finite else 0.0) - 2.0


def walk_figure(lane: LaneRecord, step: Step) -> go.Figure:
    """Spectr / SpecInfer (sampled): each try's acceptance probability as a bar, its uniform draw as a
    diamond; a try passes when its draw lies below its bar."""
    spectr = panel_of(lane) == "kseq"
    xs, bars, us, ok = [], [], [], []
    for i, t in enumerate(step.walk):
        rho = t["rho"] or 1.0
        for k in range(len(t["p"])):
            p, q = t["p"][k], t["q"][k]
            xs.append(f"{i + 1}.{k + 1}")
            bars.append(min(1.0, p / (rho * q)) if q > 0 else 1.0)
            us.append(t["u"][k])
            ok.append(t["accepted"] == k)
    fig = go.Figure()
    rule = "min(1, p/(ρq))" if spectr else "min(1, p_k/q)"
    # a try the target gives p = 0 has a bar of height 0: drawn as a thin hatched stub, so a rejected try keeps its bar
    fig.add_trace(
        go.Bar(
            x=xs,
            y=[max(b, ZERO_STUB) for b in bars],
            marker={
                "color": [PASS if o else FAIL for o in ok],
                "pattern": {"shape": ["/" if b == 0 else "" for b in bars]},
            },
            text=[f"{b:.2f}" if b > 0 else "0 (p = 0)" for b in bars],
            textposition="auto",
            cliponaxis=False,
            name=rule,
        )
    )
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=us,
            mode="markers",
            marker={"symbol": "diamond", "size": 11, "color": "#a855f7"},
            name="u (accept when below the bar)",
        )
    )
    title = f"{lane.label}: each try's acceptance {rule} against its draw u: accepted {step.accepted}"
    style(fig, title, "position.try", "probability", height=300)
    fig.update_layout(showlegend=True, hovermode="closest")
    fig.update_xaxes(type="category")
    fig.update_yaxes(range=[0, 1.1])
    return fig


def bild_figure(lane: LaneRecord, step: Step, settings: dict) -> go.Figure:
    """BiLD: each draft token's NLL under the target as a bar, with the τ2 line it must stay under."""
    nll = [max(0.0, -v) if not math.isnan(v) else v for v in step.token_log_p]  # −log p ≥ 0: no −0.000
    tau2 = settings.get("tau2")
    top = max([v for v in nll if math.isfinite(v)] + [tau2 or 0.0]) + 1.0
    fig = go.Figure(
        go.Bar(
            x=list(range(1, len(nll) + 1)),
            y=[v if math.isfinite(v) else top for v in nll],
            marker={
                "color": [PASS if i < step.accepted else FAIL for i in range(len(nll))],
                "pattern": {"shape": ["" if math.isfinite(v) else "/" for v in nll]},
            },
            text=[num(v) for v in nll],
            textposition="auto",
            cliponaxis=False,
            name="NLL −log p_i(x_i)",
        )
    )
    if tau2 is not None:
        fig.add_hline(
            y=tau2,
            line_dash="dash",
            line_color="#a855f7",
            annotation_text=f"τ2 = {tau2:g}",
            annotation_bgcolor="rgba(255, 255, 255, 0.85)",
        )
    title = f"BiLD: each draft token's NLL under the target against τ2: kept {step.accepted}"
    style(fig, title, "draft token i", "NLL (nats)", height=300)
    fig.update_layout(showlegend=False, hovermode="closest")
    fig.update_xaxes(dtick=1)
    return fig


def verify_figure(lane: LaneRecord | None, index: int, tau: float, settings: dict | None = None) -> go.Figure:
    """MTAD: log p_j − log q_j per prefix with the log τ line; SD: per-token log p/q against log u;
    Spectr / SpecInfer: each try's acceptance against its draw; BiLD: each token's NLL against τ2."""
    fig = go.Figure()
    if lane is None or not lane.steps or panel_of(lane) == "none":
        return style(fig, "Pick an iteration", "", "", height=280)
    panel = panel_of(lane)
    if panel == "target-beams":
        return panel_figure(lane, index)
    index = max(0, min(int(index), len(lane.steps) - 1))
    step = lane.steps[index]
    sampled_walk = step.walk and any(t.get("u") is not None for t in step.walk)
    if panel in ("kseq", "mss") and sampled_walk and step.draft_ids:
        return walk_figure(lane, step)
    if panel == "rollback" and step.draft_top_q:
        return bild_figure(lane, step, settings or {})
    js = list(range(1, len(step.draft_ids) + 1))
    threshold = log_tau(tau)
    if panel == "mtad":
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
        if lane.method == "sd":
            title = f"SD: per-token log p/q against the uniform draw: accepted {step.accepted}"
        else:
            title = f"{lane.label}: per-token log p/q of the followed draft: accepted {step.accepted}"
        style(fig, title, "draft token i", "log")
    fig.update_layout(showlegend=lane.method == "sd", hovermode="closest")
    fig.update_xaxes(dtick=1)
    return fig
