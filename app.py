"""The mtad web app: speculative decoding and MTAD side by side, the verification rule made visible.

``python app.py`` serves it (``GRADIO_SERVER_NAME`` / ``GRADIO_SERVER_PORT`` respected; ``MTAD_PAIR``
picks the default pair from the operator's presets). This file only lays out widgets and wires
them to ``mtad.ui``; every piece of logic lives there.
"""

from __future__ import annotations

import os
from pathlib import Path

import gradio as gr

from mtad.ui import handlers as h
from mtad.ui.explain import EXPLAIN, INTRO
from mtad.ui.inputs import BEAMS_RANGE, DEFAULTS, DRAFTS_RANGE, GAMMA_RANGE, MAX_NEW_RANGE, TOP_K_RANGE, example_prompts
from mtad.ui.record import LABELS
from mtad.ui.tokens import lane_html, legend_html

CSS = (Path(__file__).resolve().parent / "assets" / "app.css").read_text()
THEME = gr.themes.Soft(primary_hue="blue", neutral_hue="slate")
QUEUE_SIZE = int(os.environ.get("MTAD_QUEUE_SIZE", "16"))


def build() -> gr.Blocks:
    """The page: inputs, two (or three) lanes, summary cards, plots, the verification panel."""
    default_pair = h.default_pair()
    first_examples = example_prompts(h.presets().get(default_pair))
    first_prompt = first_examples[0][1] if first_examples else ""
    with gr.Blocks(title="MTAD vs speculative decoding") as demo:
        record = gr.State(None)
        gr.Markdown(INTRO)
        gr.Markdown(f"This server decodes on: **{h.server_device()}**", elem_classes="device-line")
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
                    pair = gr.Dropdown(h.pair_choices(), value=default_pair, label="Model pair", scale=1)
                    examples = gr.Dropdown(first_examples, value=first_prompt or None, label="Example prompts", scale=2)
                pair_info = gr.Markdown(h.pair_info(default_pair))
                with gr.Row():
                    run_btn = gr.Button("Run", variant="primary", elem_id="run-btn")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn")
                    replay_btn = gr.Button("Replay", elem_id="replay-btn")
                with gr.Row():
                    racers = [(LABELS[m], m) for m in h.RACERS]
                    left = gr.Dropdown(racers, value="sd", label="Left lane", elem_id="left-method")
                    right = gr.Dropdown(racers, value="mtad", label="Right lane", elem_id="right-method")
                with_ar = gr.Checkbox(False, label="Add an autoregressive (AR) baseline lane")
            with gr.Column(scale=2):
                tau = gr.Slider(0, 1, value=DEFAULTS.tau, step=0.01, label="τ (MTAD threshold)")
                beams = gr.Slider(*BEAMS_RANGE, value=DEFAULTS.beams, step=1, label="beams W (MTAD)")
                gamma = gr.Slider(*GAMMA_RANGE, value=DEFAULTS.gamma, step=1, label="draft length γ", elem_id="gamma")
                max_new = gr.Slider(
                    *MAX_NEW_RANGE, value=DEFAULTS.max_new_tokens, step=1, label="max new tokens", elem_id="max-new"
                )
                with gr.Accordion("Other decoders (Spectr, SpecInfer, BiLD)", open=False):
                    num_drafts = gr.Slider(*DRAFTS_RANGE, value=DEFAULTS.num_drafts, step=1, label="drafts m")
                    tau1 = gr.Slider(0, 1, value=DEFAULTS.tau1, step=0.01, label="τ1 (BiLD fallback)")
                    tau2 = gr.Slider(0, 10, value=DEFAULTS.tau2, step=0.1, label="τ2 (BiLD rollback, nats)")
                with gr.Accordion("Sampling", open=False):
                    greedy = gr.Checkbox(DEFAULTS.greedy, label="greedy (argmax everywhere)")
                    temperature = gr.Slider(0, 2, value=DEFAULTS.temperature, step=0.05, label="temperature")
                    top_k = gr.Slider(*TOP_K_RANGE, value=DEFAULTS.top_k, step=1, label="top-k (0 = off)")
                    top_p = gr.Slider(0.01, 1, value=DEFAULTS.top_p, step=0.01, label="top-p")
                    seed = gr.Number(DEFAULTS.seed, precision=0, label="seed", minimum=0)
        status = gr.Markdown("", elem_id="status")
        gr.HTML(legend_html())
        with gr.Row(equal_height=True):
            lane_sd = gr.HTML(lane_html(None, ""), elem_id="lane-sd")
            lane_mtad = gr.HTML(lane_html(None, ""), elem_id="lane-mtad")
        lane_ar = gr.HTML(lane_html(None, ""), elem_id="lane-ar", visible=False)
        cards = gr.HTML(elem_id="cards")
        with gr.Row():
            tokens_plot = gr.Plot(label="Tokens vs seconds", elem_id="plot-tokens")
            accept_plot = gr.Plot(label="Accepted per iteration", elem_id="plot-accepted")
        energy_plot = gr.Plot(label="Power and energy", visible=False, elem_id="plot-energy")
        energy_note = gr.HTML(elem_id="energy-note")
        gr.Markdown("## Verification panel\nPick an iteration of either lane; move τ to re-judge its recorded draft.")
        with gr.Row():
            v_lane = gr.Radio(h.lane_choices(), value="mtad", label="Lane", scale=1)
            v_iter = gr.Slider(1, 2, value=1, step=1, label="Iteration", scale=2, elem_id="v-iter")
            v_tau = gr.Slider(0, 1, value=DEFAULTS.tau, step=0.01, label="τ to judge with", scale=2, elem_id="v-tau")
        with gr.Row():
            v_html = gr.HTML(h.verify_view(None, "mtad", 1, DEFAULTS.tau)[0], elem_id="v-panel")
            v_plot = gr.Plot(label="Verification", elem_id="v-plot")
        gr.Markdown(EXPLAIN)
        with gr.Accordion("Run data (JSON: settings, metrics, every step)", open=False):
            run_json = gr.JSON()

        pair.change(h.on_pair_change, pair, [pair_info, examples], queue=False)
        examples.change(h.on_example, examples, prompt, queue=False)
        with_ar.change(h.toggle_ar, with_ar, lane_ar, queue=False)
        run_inputs = [prompt, pair, tau, beams, gamma, max_new, greedy, temperature, top_k, top_p, seed, with_ar]
        run_inputs += [left, right, num_drafts, tau1, tau2]
        run_outputs = [status, lane_sd, lane_mtad, lane_ar, cards, tokens_plot, accept_plot, energy_plot]
        run_outputs += [energy_note, record, run_json]
        go = run_btn.click(h.arm, None, None, queue=False, api_name=False)
        go = go.then(
            h.run,
            run_inputs,
            run_outputs,
            api_name="run",
            concurrency_limit=1,
            concurrency_id="device",
            show_progress_on=[status],
        )
        go.then(
            h.verify_reset_lanes, [record, v_lane], [v_lane, v_iter, v_tau, v_html, v_plot], queue=False, api_name=False
        )
        stop_btn.click(h.stop, None, None, queue=False, api_name=False)
        replay_btn.click(
            h.replay, record, [status, lane_sd, lane_mtad, lane_ar], api_name="replay", concurrency_limit=4
        )
        v_lane.change(h.verify_lane, [record, v_lane, v_tau], [v_iter, v_html, v_plot], queue=False, api_name=False)
        for widget in (v_iter, v_tau):
            widget.change(h.verify_view, [record, v_lane, v_iter, v_tau], [v_html, v_plot], queue=False, api_name=False)
        demo.unload(h.unload)
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=1)
    return demo


demo = build()


def main(**launch_kwargs: object) -> None:
    """Serve the page (tests pass ``prevent_thread_lock=True`` and a port)."""
    demo.launch(css=CSS, theme=THEME, **launch_kwargs)


if __name__ == "__main__":
    main()
