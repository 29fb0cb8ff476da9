"""Links to a run: the query string that reopens the page on a run's prompt, pair, settings, lanes and
iteration, and the page load that reads one back into the form."""

from __future__ import annotations

from html import escape
from urllib.parse import urlencode

import gradio as gr

from mtad.decoding.spec import racers
from mtad.ui.form import FIELDS
from mtad.ui.outputs import message_html
from mtad.ui.pickers import pair_choices
from mtad.ui.record import LABELS, RunRecord, nearest_iteration
from mtad.ui.run import max_prompt_chars

LINK_KEYS = {  # query parameter -> the run's settings key (also the run form's field)
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
    iteration = nearest_iteration(record.lane(method), iteration)
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
    them by name as it checks typed ones; a pair must be one of the operator's presets.

    Returns one update per run form field (in :data:`mtad.ui.form.FIELDS` order, app.py's outputs being the
    form's widgets), then the wanted lane and iteration, then the message."""
    q = dict(request.query_params) if request is not None else {}
    choices = pair_choices()
    names = [n for _, n in choices]
    pair = q.get("pair") if q.get("pair") in names else current_pair
    pair_out = gr.update(choices=choices, value=pair if pair in names else (names[0] if names else None))
    outs = {name: gr.skip() for name in FIELDS}
    outs["pair_name"] = pair_out
    too_long = "prompt" in q and len(q["prompt"]) > max_prompt_chars()
    if "prompt" in q and not too_long:
        outs["prompt"] = gr.update(value=q["prompt"])
    for key, name in LINK_KEYS.items():
        if key in q:
            value = q[key]
            if key == "greedy":
                outs[name] = gr.update(value=value in ("1", "true", "True"))
            else:
                try:
                    outs[name] = gr.update(value=float(value))
                except ValueError:
                    outs[name] = gr.update(value=value)  # the run refuses it by name
    if "ar" in q:
        outs["with_ar"] = gr.update(value=q["ar"] in ("1", "true", "True"))
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
    if too_long:
        message = message_html(
            f"the link's prompt is {len(q['prompt']):,} characters long; this server takes at most "
            f"{max_prompt_chars():,}, so it was not put in the prompt box",
            kind="refused",
        )
    elif "prompt" in q:
        it = f" and the panel opens at iteration {wanted['it']}" if wanted else ""
        message = message_html(
            f"Opened from a link: press Run to reproduce that run (same settings and seed){it}.", kind="info"
        )
    return *(outs[name] for name in FIELDS), wanted, message
