"""Token spans: a lane's text as HTML, each token coloured by who produced it, all text escaped."""

from __future__ import annotations

import math
import re
from html import escape

from mtad.decoding.spec import registry
from mtad.events import Step
from mtad.ui.record import LABELS, LaneRecord

STATE_BADGES = {
    "waiting": "waiting",
    "queued": "waiting for the device",
    "compiling": "compiling for this device (first use, not timed)…",
    "line": "in the queue",
    "running": "generating…",
    "done": "done",
    "stopped": "stopped",
    "error": "error",
}


def prob(logp: float) -> str:
    """A probability from its log, compactly (log 0 = -inf shows as 0)."""
    if not math.isfinite(logp):
        return "0"
    return f"{math.exp(logp):.3g}"


def visible(piece: str) -> str:
    """Show layout characters of a thrown-away token (it is not part of the text): newlines, tabs, and
    runs of spaces as a short count (an indentation token would otherwise be a long empty bar)."""
    out = piece.replace("\n", "↵").replace("\t", "→")
    return re.sub(r" {3,}", lambda m: f"␣×{len(m.group())}", out) or "∅"


def target_kind(step: Step) -> str:
    """What the target's own token is in this step, in words."""
    spec = registry().get(step.method)
    panel = spec.panel if spec else ""
    if panel == "target-beams" and step.beams:
        return f"target's token, from its best of {len(step.beams)} beams ({spec.short})"
    if panel == "none" or not step.draft_ids:
        return "target token (autoregressive)"
    if panel == "sd":
        return "bonus token (all drafts accepted)" if step.accepted == len(step.draft_ids) else "resampled token"
    return f"target's token at position {step.accepted + 1}"


def _span(cls: str, text: str, title: str) -> str:
    return f'<span class="tok {cls}" title="{escape(title, quote=True)}">{escape(text, quote=True)}</span>'


def _draft_title(step: Step, i: int, verdict: str) -> str:
    p, q = step.token_log_p[i], step.token_log_q[i]
    parts = [f"{verdict} draft token {i + 1}", f"p {prob(p)}", f"q {prob(q)}"]
    if step.uniforms is not None and i < len(step.uniforms):
        parts.append(f"u {step.uniforms[i]:.3f}")
    parts.append(f"iteration {step.index + 1}")
    return " · ".join(parts)


def step_html(step: Step, appended: list[str], rejected: list[str]) -> str:
    """One iteration: accepted drafts, rejected drafts (struck through), then the target's token."""
    out = []
    kept_drafts = [k for k, t in enumerate(step.from_target) if not t]
    for k in kept_drafts:
        out.append(_span("tok-acc", appended[k], _draft_title(step, k, "accepted")))
    for k, piece in enumerate(rejected):
        out.append(_span("tok-rej", visible(piece), _draft_title(step, step.accepted + k, "rejected")))
    for k, from_target in enumerate(step.from_target):
        if not from_target:
            continue
        lp = step.target_logprobs[k] if k < len(step.target_logprobs) else float("nan")
        title = f"{target_kind(step)} · p {prob(lp)} (target, T=1) · q — (not drafted) · iteration {step.index + 1}"
        text = appended[k]
        if step.eos and k == len(step.appended_ids) - 1 and not text:
            text = "⟨eos⟩"
        out.append(_span("tok-tgt", text, title))
    parity = "odd" if step.index % 2 else "even"
    return f'<span class="it it-{parity}" data-it="{step.index}">{"".join(out)}</span>'


def lane_html(
    lane: LaneRecord | None, prompt: str, upto: int | None = None, note: str = "", tail: int | None = None
) -> str:
    """A lane box: its title, state, counts, the prompt (muted) and its first ``upto`` steps.

    With ``tail``, only the last ``tail`` of those steps are drawn (a live lane: the browser re-draws
    it at every update, so its cost must not grow with the length of the run); the rest is counted.
    """
    if lane is None:
        return placeholder_html(None, "Press Run to generate.")
    n = len(lane.steps) if upto is None else min(upto, len(lane.steps))
    tokens = sum(len(s.appended_ids) for s in lane.steps[:n])
    state = lane.state if upto is None or n == len(lane.steps) else "running"
    badge = STATE_BADGES.get(state, state)
    first = max(0, n - tail) if tail is not None else 0
    body = "".join(step_html(lane.steps[i], lane.appended_pieces[i], lane.rejected_pieces[i]) for i in range(first, n))
    if first:
        hidden = sum(len(s.appended_ids) for s in lane.steps[:first])
        body = (
            f'<span class="lane-elided">… {hidden} earlier tokens ({first} iterations), shown in full when the '
            f"lane ends …</span>{body}"
        )
        prompt = ""
    error = f'<div class="lane-error">{escape(lane.error)}</div>' if lane.error else ""
    extra = f'<span class="lane-note">{escape(note)}</span>' if note else ""
    return (
        f'<div class="mtad-lane" data-method="{escape(lane.method)}" data-state="{escape(state)}">'
        f'<div class="lane-head"><span class="lane-title">{escape(lane.label)}</span>'
        f'<span class="lane-badge lane-{escape(state)}">{escape(badge)}</span>{extra}'
        f'<span class="lane-count">{tokens} tokens · {n} iterations</span></div>'
        f'<div class="lane-scroll"><div class="lane-body"><span class="tok-prompt">{escape(prompt)}</span>{body}</div></div>'
        f"{error}</div>"
    )


def placeholder_html(method: str | None, text: str, state: str = "", note: str = "") -> str:
    """A lane box before its run has steps: the lane's title (when known) and a line of text."""
    head = ""
    if method:
        badge = f'<span class="lane-badge lane-{escape(state)}">{escape(STATE_BADGES.get(state, state))}</span>'
        extra = f'<span class="lane-note">{escape(note)}</span>' if note else ""
        head = (
            f'<div class="lane-head"><span class="lane-title">{escape(LABELS.get(method, method))}</span>'
            f"{badge if state else ''}{extra}</div>"
        )
    data = f' data-method="{escape(method)}" data-state="{escape(state or "empty")}"' if method else ""
    return f'<div class="mtad-lane mtad-lane-empty"{data}>{head}<div class="lane-body">{escape(text)}</div></div>'


def legend_html() -> str:
    """The key to the token colours."""
    return (
        '<div class="mtad-legend">'
        '<span><span class="tok tok-acc">accepted draft</span> drafted by the small model, accepted by the target</span>'
        '<span><span class="tok tok-tgt">target token</span> the target\'s own token (bonus / resample)</span>'
        '<span><span class="tok tok-rej">rejected</span> drafted, thrown away</span>'
        '<span class="legend-hint">Hover a drafted token for “p · q”: the probability the target (p) and the draft '
        "(q) gave it at that position, under the run's warped distributions (after temperature, top-k, top-p), so “p 1 · q 1” "
        "means both were certain and “p 0” that the target's top-k / top-p ruled it out. Rejected drafts stay "
        "visible, struck through, to show what was tried (a strict rule rejects many): tick a lane's “reply only” "
        "to read the reply alone. Faint borders separate iterations.</span>"
        "</div>"
    )
