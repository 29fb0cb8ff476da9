"""The mtad web app: speculative decoding and MTAD side by side, the verification rule made visible.

``python app.py`` serves it (``GRADIO_SERVER_NAME`` / ``GRADIO_SERVER_PORT`` respected; ``MTAD_PAIR``
picks the default pair from the operator's presets). This file only lays out widgets and wires
them to ``mtad.ui``; every piece of logic lives there.
"""

from __future__ import annotations

import os
from pathlib import Path

import gradio as gr

from mtad.settings import PARAMS
from mtad.ui import (
    availability,
    fastest,
    form,
    line,
    link,
    opening,
    outputs,
    panel,
    pickers,
    replay,
    session_config,
    waiting,
)
from mtad.ui import race as race_view
from mtad.ui import run as runs
from mtad.ui.explain import EXPLAIN, INTRO
from mtad.ui.inputs import (
    DEFAULTS,
    MAX_NEW_RANGE,
    SEED_RANGE,
    TEMPERATURE_RANGE,
    TOP_K_RANGE,
)
from mtad.ui.state import PAGE
from mtad.ui.tokens import legend_html

CSS = (Path(__file__).resolve().parent / "assets" / "app.css").read_text()
THEME = gr.themes.Soft(primary_hue="blue", neutral_hue="slate")
QUEUE_SIZE = int(os.environ.get("MTAD_QUEUE_SIZE", "16"))
REPLAYS = 16  # replays animated at once: they only redraw a finished run, on the CPU, and never wait for the device
SESSIONS = int(os.environ.get("MTAD_MAX_SESSIONS", "256"))  # sessions whose last run the server keeps (gr.State)
RECORD_TTL = 3600  # seconds a session's last run is kept after it last changed


def build() -> gr.Blocks:
    """The page: inputs, two (or three) lanes, summary cards, plots, the verification panel."""
    availability.start_hub_probe()
    default_pair = pickers.default_pair()
    first_examples = pickers.pair_examples(default_pair)
    first_prompt = first_examples[0][1] if first_examples else ""
    # no Gradio timer flashing in the message box or the status line: every event says its own progress
    private = {"queue": False, "api_visibility": "private", "show_progress": "hidden"}
    with gr.Blocks(title="MTAD vs speculative decoding") as demo:
        record = gr.State(None, time_to_live=RECORD_TTL)
        wanted = gr.State(None)  # a link's lane and iteration, opened after the next run
        timer = gr.Timer(1.0, active=False)
        gr.Markdown(INTRO)
        gr.Markdown(f"This server decodes on: **{pickers.server_device()}**", elem_classes="device-line")
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(
                    first_prompt,
                    label="Prompt",
                    lines=5,
                    placeholder="Type a prompt, or pick an example below",
                    elem_id="prompt",
                )
                with gr.Row():
                    pair = gr.Dropdown(
                        pickers.pair_choices(), value=default_pair, label="Model pair", scale=1, elem_id="pair"
                    )
                    examples = gr.Dropdown(first_examples, value=first_prompt or None, label="Example prompts", scale=2)
                pair_info = gr.Markdown(pickers.pair_info(default_pair), elem_id="pair-info")
                with gr.Row():
                    run_btn = gr.Button("Run", variant="primary", elem_id="run-btn")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn")
                    replay_btn = gr.Button("Replay", elem_id="replay-btn")
                message = gr.HTML(outputs.message_html(), label="message", elem_id="message")
                with gr.Row():
                    racers = pickers.racer_choices()
                    first, second = pickers.DEFAULT_RACE
                    left = gr.Dropdown(racers, value=first, label="Left lane", elem_id="left-method")
                    right = gr.Dropdown(racers, value=second, label="Right lane", elem_id="right-method")
                with_ar = gr.Checkbox(
                    True,
                    label="Autoregressive (AR) baseline lane: each card's “× AR” compares with it",
                    elem_id="with-ar",
                )
            with gr.Column(scale=2):
                with gr.Row():
                    tau = setting("tau", "tau")
                    beams = setting("beams", "beams")
                with gr.Row():
                    gamma = setting("gamma", "gamma")
                    max_new = number(DEFAULTS.max_new_tokens, "max new tokens", MAX_NEW_RANGE, "max-new")
                with gr.Row():
                    fastest_btn = gr.Button("Fastest γ and W on this device", size="sm", elem_id="fastest-btn")
                    paper_btn = gr.Button("The paper's γ and W", size="sm", elem_id="paper-btn")
                defaults_note = gr.Markdown(opening.defaults_note(default_pair, None), elem_id="defaults-note")
                with gr.Accordion("Other decoders (Spectr, SpecInfer, BiLD)", open=False):
                    num_drafts = setting("num_drafts", "num-drafts")
                    with gr.Row():
                        tau1 = setting("tau1", "tau1")
                        tau2 = setting("tau2", "tau2")
                with gr.Accordion("Sampling", open=False):
                    greedy = gr.Checkbox(DEFAULTS.greedy, label="greedy (argmax everywhere)", elem_id="greedy")
                    with gr.Row():
                        temperature = number(DEFAULTS.temperature, "temperature", TEMPERATURE_RANGE, "temperature")
                        top_k = number(DEFAULTS.top_k, "top-k (0 = off)", TOP_K_RANGE, "top-k")
                    with gr.Row():
                        top_p = gr.Number(DEFAULTS.top_p, label="top-p", info="above 0, at most 1", elem_id="top-p")
                        seed = number(DEFAULTS.seed, "seed", SEED_RANGE, "seed")
        status = gr.Markdown(
            "Nothing run yet: pick or type a prompt and press **Run**.", label="status", elem_id="status"
        )
        race = gr.HTML(race_view.recorded_race_html(pickers.server_device()), label="race", elem_id="race")
        opening_timer = gr.Timer(2.0, active=True)  # the status line while the pair loads at start-up
        gr.HTML(legend_html())
        reply = "reply only (hide the prompt and rejected drafts)"
        with gr.Row(equal_height=True):
            with gr.Column(min_width=300):
                lane_1 = gr.HTML(outputs.lane_box(None, pickers.DEFAULT_RACE[0]), label="lane_1", elem_id="lane-left")
                gr.Checkbox(False, label=reply, elem_id="reply-left", container=False)
            with gr.Column(min_width=300):
                lane_2 = gr.HTML(outputs.lane_box(None, pickers.DEFAULT_RACE[1]), label="lane_2", elem_id="lane-right")
                gr.Checkbox(False, label=reply, elem_id="reply-right", container=False)
        with gr.Column() as ar_box:
            lane_ar = gr.HTML(outputs.lane_box(None, "ar"), label="lane_ar", elem_id="lane-ar")
            gr.Checkbox(False, label=reply, elem_id="reply-ar", container=False)
        cards = gr.HTML(label="cards", elem_id="cards")
        with gr.Row():
            tokens_plot = gr.Plot(label="Tokens vs seconds", elem_id="plot-tokens")
            accept_plot = gr.Plot(label="Accepted per iteration", elem_id="plot-accepted")
        energy_plot = gr.Plot(label="Power and energy", visible=False, elem_id="plot-energy")
        energy_note = gr.HTML(label="energy_note", elem_id="energy-note")
        gr.Markdown("## Verification panel\nPick an iteration of either lane; move τ to re-judge its recorded draft.")
        with gr.Row(elem_id="v-controls"):
            v_lane = gr.Radio(
                panel.lane_choices(), value=pickers.DEFAULT_RACE[-1], label="Lane", scale=1, elem_id="v-lane"
            )
            with gr.Column(scale=2, min_width=220):
                v_iter = gr.Slider(1, 2, value=1, step=1, label="Iteration", elem_id="v-iter")
                with gr.Row():
                    v_prev = gr.Button("◀ previous", size="sm", elem_id="v-prev", min_width=60)
                    v_next = gr.Button("next ▶", size="sm", elem_id="v-next", min_width=60)
            v_tau = gr.Slider(0, 1, value=DEFAULTS.tau, step=0.01, label="τ to judge with", scale=2, elem_id="v-tau")
        v_link = gr.HTML(elem_id="v-link")
        with gr.Row(elem_id="v-row"):
            v_html = gr.HTML(panel.verify_view(None, pickers.DEFAULT_RACE[-1], 1, DEFAULTS.tau)[0], elem_id="v-panel")
            v_plot = gr.Plot(label="Verification", elem_id="v-plot")
        gr.Markdown(EXPLAIN)
        with gr.Accordion("Run data (JSON: settings, metrics, every step)", open=False):
            run_json = gr.JSON(label="run_data")

        run_form = form.widgets(  # the run's inputs by name: the page's Run, the /run API and a link's fields
            prompt=prompt,
            pair_name=pair,
            tau=tau,
            beams=beams,
            gamma=gamma,
            max_new_tokens=max_new,
            greedy=greedy,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            with_ar=with_ar,
            left=left,
            right=right,
            num_drafts=num_drafts,
            tau1=tau1,
            tau2=tau2,
        )
        demo.load(link.from_query, pair, [*run_form.values(), wanted, message], **private)
        demo.load(opening.on_load, pair, [gamma, beams, defaults_note, status, race, pair_info], **private)
        opening_timer.tick(opening.on_refresh, [pair, status], [status, opening_timer], **private)
        paper_btn.click(opening.back_to_paper, pair, [gamma, beams, defaults_note], **private)
        pair.change(pickers.on_pair_change, [pair, prompt], [pair_info, examples, prompt], **private)
        examples.input(pickers.on_example, examples, prompt, **private)
        with_ar.change(runs.toggle_ar, with_ar, ar_box, **private)
        waiting_outputs = [message, status, lane_1, lane_2, lane_ar, timer]
        timer.tick(line.waiting_tick, [left, right], waiting_outputs, **private)
        for picker in (left, right):
            picker.change(line.on_race_change, [record, left, right], [lane_1, lane_2], **private)
        lanes = [lane_1, lane_2, lane_ar]
        run_outputs = [message, status, *lanes, cards, tokens_plot, accept_plot, energy_plot, energy_note]
        run_outputs += [record, run_json]
        run_opts = dict(concurrency_limit=1, concurrency_id="device", show_progress="hidden")
        run_opts["preprocess"] = False  # the handler checks every value itself, naming the field; nothing clamped
        go = run_btn.click(line.arm, [left, right], waiting_outputs, **private)
        go = go.then(runs.run_page, None, run_outputs, inputs_kwargs=run_form, api_visibility="private", **run_opts)
        reset_outputs = [v_lane, v_iter, v_tau, v_html, v_plot, wanted]
        shown = go.then(panel.verify_reset, [record, v_lane, wanted], reset_outputs, **private)
        shown.then(link.link_html, [record, v_lane, v_iter], v_link, **private)
        go.then(runs.race_after_run, record, race, **private)
        stop_btn.click(line.stop, [left, right], waiting_outputs, **private)
        sampling = [pair, tau, greedy, temperature, top_k, top_p]
        fastest_opts = dict(concurrency_limit=1, concurrency_id="device", api_visibility="private")
        fastest_outputs = [gamma, beams, message, defaults_note]
        fastest_btn.click(fastest.fastest_page, sampling, fastest_outputs, **fastest_opts, show_progress="hidden")
        replay_outputs = [message, status, *lanes, cards, tokens_plot, accept_plot]
        replay_opts = dict(concurrency_limit=REPLAYS, concurrency_id="replay")  # off the device's queue
        replay_btn.click(
            replay.replay_page, record, replay_outputs, api_visibility="private", show_progress="hidden", **replay_opts
        )
        # the public API: the same work, ending in an error (with the page's words) when refused
        api_run, api_replay = gr.Button(visible=False), gr.Button(visible=False)
        api_run.click(runs.run, None, run_outputs, inputs_kwargs=run_form, api_name="run", **run_opts)
        api_replay.click(replay.replay, record, replay_outputs, api_name="replay", **replay_opts)
        # .input, not .change: verify_reset sets the lane, iteration and view itself after a run (a link's
        # iteration among them), and a .change here would race it back to iteration 1
        # raw values: a number typed past a slider's end reaches the handlers, which take the nearest end,
        # instead of failing in Gradio's own check (an "Error" badge, a traceback in the log)
        raw = {**private, "preprocess": False}
        v_lane.input(panel.verify_lane, [record, v_lane, v_tau], [v_iter, v_html, v_plot], **raw)
        for widget in (v_iter, v_tau):
            widget.change(panel.verify_view, [record, v_lane, v_iter, v_tau], [v_html, v_plot], **raw)
        for widget in (v_lane, v_iter):
            widget.change(link.link_html, [record, v_lane, v_iter], v_link, **raw)
        v_prev.click(panel.previous_iteration, [record, v_lane, v_iter], v_iter, **raw)
        v_next.click(panel.next_iteration, [record, v_lane, v_iter], v_iter, **raw)
        demo.unload(line.unload)
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=1)
    PAGE.line.attach(demo)
    waiting.limit_per_client(demo)
    session_config.keep_component_ids()
    return demo


def number(value: float, label: str, bounds: tuple[float, float], elem_id: str) -> gr.Number:
    """A number box that states its range and never clamps: out-of-range values reach the handler,
    which refuses them by name (a slider silently pulls a typed 1.5 back to 1)."""
    lo, hi = bounds
    return gr.Number(
        value, label=label, info=f"{lo:g} to {hi:g}" if isinstance(lo, float) else f"{lo} to {hi}", elem_id=elem_id
    )


def setting(field: str, elem_id: str) -> gr.Number:
    """A method setting's box: its label and the page's range for it from ``mtad.settings.PARAMS``."""
    p = PARAMS[field]
    return number(getattr(DEFAULTS, field), p.page_name, p.widget_range, elem_id)


demo = build()


def main(**launch_kwargs: object) -> None:
    """Serve the page (tests pass ``prevent_thread_lock=True`` and a port); on the compiled engine the
    default pair loads and compiles in the background meanwhile, then its candidates are timed once."""
    if runs.compiled_engine():
        opening.start(pickers.default_pair_name())
    demo.launch(css=CSS, theme=THEME, state_session_capacity=SESSIONS, **launch_kwargs)


if __name__ == "__main__":
    main()
