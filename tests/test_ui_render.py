"""The app's pure rendering helpers: token spans, cards, figures, the verification panel, inputs."""

from __future__ import annotations

import math
import re
import threading

import pytest

from mtad.decoding import mtad_accept_length
from mtad.events import Step
from mtad.metrics import summarize
from mtad.pair import Preset
from mtad.ui import cards, figures, tokens, verify
from mtad.ui.inputs import example_prompts, parse_settings
from mtad.ui.record import LaneEnergy, LaneRecord, RunRecord
from mtad.ui.runner import CancelRegistry

VOCAB = ["", "a", "b", "<", ">", "\n", " ", "&"]  # id 0 is EOS (decodes to nothing)


class FakeTokenizer:
    """Decodes ids to characters; EOS (id 0) is special and skipped."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids)


def mtad_step(index=0, draft=(1, 3, 4, 2), log_p=(-0.5, -1.0, -4.0, -4.2), log_q=(-0.4, -0.9, -1.2, -3.0)):
    """An MTAD iteration drafted 4 tokens; at tau=0.1 the longest passing prefix is 4."""
    acc = mtad_accept_length(list(log_p), list(log_q), 0.1)
    appended = [*draft[:acc], 6]
    return Step(
        index=index,
        method="mtad",
        draft_ids=list(draft),
        log_p=list(log_p),
        log_q=list(log_q),
        accepted=acc,
        appended_ids=appended,
        from_target=[False] * acc + [True],
        target_logprobs=[-0.3] * len(appended),
        beams=[list(draft), [2, 2, 2, 2]],
        beam_scores=[log_q[-1], -5.0],
        best_beam=0,
        target_calls=1,
        draft_calls=4,
        draft_seconds=0.01,
        target_seconds=0.02,
        other_seconds=0.001,
    )


def sd_step(index=0):
    """An SD iteration: 3 drafts, the second rejected by its uniform draw, a resample appended."""
    return Step(
        index=index,
        method="sd",
        draft_ids=[3, 5, 1],
        log_p=[-0.1, -3.0, -3.5],
        log_q=[-0.2, -0.5, -1.0],
        accepted=1,
        appended_ids=[3, 2],
        from_target=[False, True],
        target_logprobs=[-0.1, -0.7],
        uniforms=[0.5, 0.9, 0.1],
        target_calls=1,
        draft_calls=3,
        draft_seconds=0.01,
        target_seconds=0.01,
    )


def lane_of(method, steps, prompt=(1, 2)):
    lane = LaneRecord(method=method, prompt_ids=list(prompt))
    for i, s in enumerate(steps):
        lane.add(s, FakeTokenizer(), wall_end=0.05 * (i + 1))
    lane.state = "done"
    return lane


def test_lane_html_colours_tokens_and_escapes_text():
    lane = lane_of("sd", [sd_step(0), sd_step(1)])
    html = tokens.lane_html(lane, "<script>alert(1)</script>")
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert html.count('class="tok tok-acc"') == 2
    assert html.count('class="tok tok-tgt"') == 2
    assert html.count('class="tok tok-rej"') == 4
    assert "↵" in html  # a rejected newline is shown, not laid out
    assert "&lt;" in html  # the accepted '<' token is escaped
    assert 'title="accepted draft token 1 · p 0.905 · q 0.819 · u 0.500 · iteration 1"' in html
    assert "resampled token" in html
    assert 'data-state="done"' in html and "4 tokens · 2 iterations" in html


def test_lane_html_upto_replays_a_prefix_and_marks_eos():
    step = Step(index=0, method="ar", appended_ids=[0], from_target=[True], target_logprobs=[-1.0], eos=True)
    lane = lane_of("ar", [step])
    assert "⟨eos⟩" in tokens.lane_html(lane, "x")
    two = lane_of("mtad", [mtad_step(0), mtad_step(1)])
    partial = tokens.lane_html(two, "x", upto=1)
    assert 'data-state="running"' in partial and partial.count('class="it ') == 1
    assert tokens.lane_html(None, "").count("Press Run") == 1


def test_cards_show_summarize_numbers_and_energy_na():
    lane = lane_of("mtad", [mtad_step(0), mtad_step(1)])
    m = summarize(lane.steps)
    assert lane.metrics() == m
    html = cards.cards_html([lane])
    assert f"{m.block_efficiency:.3g}" in html and f"{m.acceptance:.1%}" in html
    assert f"{m.tokens_per_second:.3g}" in html and f"{m.perplexity:.3g}" in html
    assert "n/a — no GPU" in html
    lane.energy = LaneEnergy(available=True, reason="", joules=2.5, note=None)
    m = lane.metrics()
    assert m.joules_per_token == pytest.approx(2.5 / m.new_tokens)
    assert f"{cards.fmt(m.joules_per_token)} J" in cards.cards_html([lane])


def test_figures_use_each_lanes_own_clock():
    sd = lane_of("sd", [sd_step(0), sd_step(1)])
    md = lane_of("mtad", [mtad_step(0)])
    fig = figures.tokens_vs_seconds([sd, md])
    xs = list(fig.data[0].x)
    assert xs == pytest.approx([0.0, 0.02, 0.04])
    assert list(fig.data[0].y) == [0, 2, 4]
    acc = figures.accepted_per_iteration([sd, md])
    assert [list(t.y) for t in acc.data] == [[1, 1], [md.steps[0].accepted]]
    assert figures.energy_figure([sd, md]) is None


def test_cumulative_joules_integrate_power_samples():
    lane = lane_of("sd", [sd_step(0), sd_step(1)])  # wall ends at 0.05 and 0.10 s
    lane.energy = LaneEnergy(available=True, reason="", samples=[(0.0, 100.0), (0.05, 100.0), (0.10, 200.0)])
    assert figures.cumulative_joules(lane) == pytest.approx([5.0, 12.5])
    assert figures.energy_figure([lane]) is not None


def test_verify_rejudges_at_any_tau_without_models():
    lane = lane_of("mtad", [mtad_step(0)])
    step = lane.steps[0]
    assert step.accepted == 4
    html_run = verify.verify_html(lane, 0, 0.1, 0.1, FakeTokenizer())
    assert 'class="v-eta">4<' in html_run and "★ beam 1" in html_run
    # a stricter tau: prefix 3's joint ratio exp(-4 + 1.2) is below 0.5, so only 2 pass
    html = verify.verify_html(lane, 0, 0.5, 0.1, FakeTokenizer())
    assert 'class="v-eta">2<' in html and "would differ" in html
    assert 'class="v-eta">0<' in verify.verify_html(lane, 0, 1.0, 0.1)
    assert "&lt;" in html and '<td><span class="vtok"><</span>' not in html
    fig = verify.verify_figure(lane, 0, 0.5)
    assert [s.y0 for s in fig.layout.shapes if s.type == "line"] == [pytest.approx(math.log(0.5))]
    assert not [s for s in verify.verify_figure(lane, 0, 0.0).layout.shapes if s.type == "line"]


def test_verify_handles_minus_infinity_and_sd_and_ar():
    lane = lane_of("mtad", [mtad_step(0, log_p=(-0.5, -math.inf, -math.inf, -math.inf))])
    html = verify.verify_html(lane, 0, 0.0, 0.1)
    assert "−∞" in html and 'class="v-eta">1<' in html
    verify.verify_figure(lane, 0, 0.1)  # -inf bars drawn at a floor, not an error
    sd = lane_of("sd", [sd_step(0)])
    html = verify.verify_html(sd, 0, 0.1, 0.1)
    assert "0.500" in html and "rejected" in html and "not judged" in html and "SD accepts" in html
    assert len(verify.verify_figure(sd, 0, 0.1).data) == 2  # bars and the uniform draws
    ar = lane_of("ar", [Step(index=0, method="ar", appended_ids=[1], from_target=[True], target_logprobs=[-1.0])])
    assert "nothing to verify" in verify.verify_html(ar, 0, 0.1, 0.1)
    assert "Run a prompt" in verify.verify_html(None, 0, 0.1, 0.1)


def test_run_record_json_has_metrics_and_steps():
    lane = lane_of("sd", [sd_step(0)])
    rec = RunRecord("tiny", "cpu", "ab", {"tau": 0.1}, {"sd": lane})
    d = rec.to_dict()
    assert d["lanes"]["sd"]["metrics"] == summarize(lane.steps).to_dict()
    assert d["lanes"]["sd"]["new_ids"] == [3, 2] and len(d["lanes"]["sd"]["steps"]) == 1
    assert "steps" not in rec.to_dict(with_steps=False)["lanes"]["sd"]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(beams=0), "beams W must be an integer from 1 to 16"),
        (dict(gamma=13), "draft length γ must be an integer from 1 to 12"),
        (dict(gamma=2.5), "draft length γ must be an integer"),
        (dict(tau=None), "τ is empty"),
        (dict(tau=2), "tau must be between 0 and 1"),
        (dict(top_p=0.0), "top-p must be in (0, 1]"),
        (dict(max_new_tokens="x"), "max new tokens must be an integer"),
        (dict(temperature=float("nan")), "temperature must be a finite number"),
    ],
)
def test_parse_settings_messages(changes, message):
    base = dict(
        tau=0.1, beams=8, gamma=4, max_new_tokens=64, greedy=False, temperature=1.0, top_k=20, top_p=0.9, seed=0
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_settings(**{**base, **changes})


def test_parse_settings_accepts_integral_floats():
    s = parse_settings(0.2, 4.0, 3.0, 10.0, True, 1.0, 20.0, 0.9, 5.0)
    assert (s.beams, s.gamma, s.max_new_tokens, s.top_k, s.seed, s.greedy) == (4, 3, 10, 20, 5, True)


def test_example_prompts_fall_back_gracefully(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1, "category": "code", "prompt": "def f():\\n    pass"}\nnot json\n{"prompt": ""}\n[1]\n')
    preset = Preset("x", "d", "t", "desc", prompts=str(f))
    assert example_prompts(preset) == [("[code] def f():", "def f():\n    pass")]
    assert example_prompts(Preset("x", "d", "t", "desc", prompts=str(tmp_path / "missing.jsonl"))) == []
    assert example_prompts(Preset("x", "d", "t", "desc")) == []


def test_cancel_registry_arms_takes_and_stops():
    reg = CancelRegistry()
    armed = reg.arm("s")
    assert reg.take("s") is armed  # the run picks up the flag armed by its click
    assert reg.stop("s") and armed.is_set()
    fresh = reg.take("s")  # an API call without a click gets a fresh flag
    assert fresh is not armed and not fresh.is_set()
    assert not reg.stop("other")
    assert isinstance(fresh, threading.Event)
