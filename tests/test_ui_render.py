"""The app's pure rendering helpers: token spans, cards, figures, the verification panel, inputs."""

from __future__ import annotations

import math
import re
import threading

import pytest

from mtad.decoding import mtad_accept_length
from mtad.events import Step
from mtad.metrics import summarize
from mtad.models.presets import Preset
from mtad.ui import cards, figures, tokens, verify
from mtad.ui.inputs import example_prompts, parse_settings
from mtad.ui.record import LaneEnergy, LaneRecord, RunRecord
from mtad.ui.state import CancelRegistry

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


def test_a_card_s_acceptance_says_in_how_many_iterations_the_lane_drafted():
    """BiLD falling back most of the time: 100 % of its few drafted tokens kept must not read as every
    iteration's; the card says in how many iterations it drafted at all."""
    drafted = sd_step(0)
    drafted.method, drafted.accepted = "bild", 3
    fallback = [
        Step(i, "bild", appended_ids=[2], from_target=[True], target_logprobs=[-1.0], target_calls=1)
        for i in range(1, 5)
    ]
    lane = lane_of("bild", [drafted, *fallback])
    m = lane.metrics()
    assert m.acceptance == 1.0 and m.undrafted_iterations == 4 and m.iterations == 5
    html = cards.cards_html([lane])
    assert '>100.0%</div><div class="card-label">acceptance (drafted in 1 of 5 iterations)</div>' in html
    assert "(drafted in" not in cards.cards_html([lane_of("sd", [sd_step(0), sd_step(1)])])  # drafted in each


def test_cards_show_summarize_numbers_and_energy_na():
    lane = lane_of("mtad", [mtad_step(0), mtad_step(1)])
    m = summarize(lane.steps)
    assert lane.metrics() == m
    html = cards.cards_html([lane])
    assert f"{m.block_efficiency:.3g}" in html and f"{m.acceptance:.1%}" in html
    assert f"{m.tokens_per_second:.3g}" in html and f"{m.perplexity:.3g}" in html
    assert '<div class="card-value na">n/a</div><div class="card-label">J/token</div>' in html
    assert 'title="n/a: no GPU' in html  # why, on hover; the page's energy note says it in full once
    stopped_ar = lane_of("ar", [])
    stopped_ar.state = "stopped"
    assert cards.versus_ar(stopped_ar.metrics(), stopped_ar, None)[0] == "—"  # Stop before AR ran: no "1×"
    lane.energy = LaneEnergy(available=True, reason="", joules=2.5, note=None)
    m = lane.metrics()
    assert m.joules_per_token == pytest.approx(2.5 / m.new_tokens)
    assert f"{cards.fmt(m.joules_per_token)} J" in cards.cards_html([lane])


def looping_lane(method: str = "mtad", period: int = 4, seconds: float = 0.1) -> LaneRecord:
    """A lane whose 20 new tokens repeat a ``period``-token phrase (4 keeps no 4-gram fresh after the first)."""
    phrase = [1, 2, 3, 4, 6, 7][:period]
    ids = (phrase * 20)[:20]
    steps = [
        Step(i, method, appended_ids=ids[i * 4 : i * 4 + 4], from_target=[True] * 4, target_logprobs=[-0.1] * 4)
        for i in range(5)
    ]
    for st in steps:
        st.target_calls, st.target_seconds = 1, seconds
    return lane_of(method, steps)


def card_cells(html: str) -> dict[str, str]:
    """A card's cells as {label: value}, read from its markup."""
    values = re.findall(r'<div class="card-value[^"]*">([^<]*)</div><div class="card-label">([^<]*)</div>', html)
    return {label: value for value, label in values}


def test_a_looping_card_says_so_next_to_its_perplexity_and_a_fresh_one_does_not():
    loop = looping_lane()  # 17 four-grams, the last 13 repeat the first four: 13/17 = 76 %
    html = cards.card_html(loop)
    assert card_cells(html)["repeated 4-grams"] == "76%"
    assert card_cells(html)["perplexity"] == f"{math.exp(0.1):.3g}"  # low: the loop is easy to predict
    assert 'class="card-note card-loop">This text repeats itself (76% of its 4-grams)' in html
    assert "its low perplexity rewards the loop, not better text" in html
    perplexity_cell = html.split('<div class="card-label">perplexity</div>')[1].split('<div class="card-cell"')[0]
    assert perplexity_cell.startswith('<div class="card-loop-tag">the text loops (see below)</div>')
    seven = [1, 2, 3, 4, 5, 6, 7]  # 4 four-grams, none repeated
    fresh = lane_of("mtad", [Step(0, "mtad", appended_ids=seven, from_target=[True] * 7, target_logprobs=[-1.0] * 7)])
    fresh_html = cards.card_html(fresh)
    assert card_cells(fresh_html)["repeated 4-grams"] == "0%" and "card-loop" not in fresh_html
    again = [1, 2, 3, 4, 5, 1, 2, 3, 4]  # 6 four-grams, the 6th repeats the 1st: 17 %
    some = lane_of("mtad", [Step(0, "mtad", appended_ids=again, from_target=[True] * 9, target_logprobs=[-1.0] * 9)])
    assert card_cells(cards.card_html(some))["repeated 4-grams"] == "17%" and "card-loop" in cards.card_html(some)
    under = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]  # 8 four-grams, 1 repeated: 12.5 %, under the threshold
    few = lane_of("mtad", [Step(0, "mtad", appended_ids=under, from_target=[True] * 11, target_logprobs=[-1.0] * 11)])
    assert card_cells(cards.card_html(few))["repeated 4-grams"] == "12%" and "card-loop" not in cards.card_html(few)
    # a text too short for one 4-gram has no figure and no warning
    short = lane_of("mtad", [Step(0, "mtad", appended_ids=[1, 2], from_target=[True] * 2, target_logprobs=[-1.0] * 2)])
    assert card_cells(cards.card_html(short))["repeated 4-grams"] == "—" and "card-loop" not in cards.card_html(short)


def test_each_card_gives_its_speed_over_the_same_run_s_ar_lane():
    fast, slow = looping_lane("mtad", seconds=0.1), looping_lane("ar", seconds=0.4)  # 20 tokens in 0.5 s vs 2 s
    html = cards.cards_html([fast, slow])
    mtad_card, ar_card = html.split('<div class="mtad-card"')[1:]
    assert card_cells(mtad_card)["× AR"] == "4.00×" and card_cells(ar_card)["× AR"] == "1×"
    assert card_cells(cards.cards_html([fast]))["× AR"] == "—"  # no AR lane: no borrowed figure
    slow.state = "running"
    assert card_cells(cards.cards_html([fast, slow]).split('<div class="mtad-card"')[1])["× AR"] == "—"


def test_each_card_gives_a_target_call_and_its_ratio_to_the_same_run_s_ar_lane():
    """A target call's time is the lane's target seconds over its target calls after the first step (whose
    forward also reads the prompt); beside the AR lane's one-token forward, the ratio says what a verification
    costs on this device. No AR lane (or an unfinished one): the time alone."""
    mtad_lane, ar_lane = looping_lane("mtad", seconds=0.06), looping_lane("ar", seconds=0.02)  # AR: 20 ms a call
    for st in mtad_lane.steps:
        st.target_calls = 2  # 60 ms a step over two calls: 30 ms a call
    mtad_lane.steps[0].target_seconds = 1.0  # the first step's forward also reads the prompt: left out
    mtad_card, ar_card = cards.cards_html([mtad_lane, ar_lane]).split('<div class="mtad-card"')[1:]
    assert card_cells(mtad_card)["per target call"] == "30 ms (1.50×)"
    assert card_cells(ar_card)["per target call"] == "20 ms"
    assert card_cells(cards.cards_html([mtad_lane]))["per target call"] == "30 ms"
    ar_lane.state = "running"
    assert card_cells(cards.cards_html([mtad_lane, ar_lane]).split('<div class="mtad-card"')[1])["per target call"] == (
        "30 ms"
    )
    idle = lane_of("sd", [Step(0, "sd", appended_ids=[1], from_target=[True], target_logprobs=[-1.0])])
    assert card_cells(cards.card_html(idle))["per target call"] == "—"  # no target call timed


def test_each_card_writes_out_its_speed_equation_against_the_same_run_s_ar_lane():
    """MTAD: 4 tokens a call (0.1 s target, 0.05 s draft, 0.05 s rest a step); AR: 4 tokens a call too here, in
    0.1 s a step, so AR's seconds a token are 0.025 and a step of MTAD costs 4 + 2 + 2 of them: 4 ÷ 8 = 0.5×."""
    mtad_lane, ar_lane = looping_lane("mtad", seconds=0.1), looping_lane("ar", seconds=0.1)
    for st in mtad_lane.steps:
        st.draft_seconds, st.other_seconds = 0.05, 0.05
    mtad_card, ar_card = cards.cards_html([mtad_lane, ar_lane]).split('<div class="mtad-card"')[1:]
    assert "× AR = 4 tokens a call ÷ (4 + 2 + 2) = 0.50×, measured 0.50×" in mtad_card
    assert card_cells(mtad_card)["× AR"] == "0.50×"
    assert "× AR = 4 tokens a call ÷ (4 + 0 + 0) = 1.00×" in ar_card
    assert "card-equation" not in cards.cards_html([mtad_lane])  # no AR lane: no equation
    ar_lane.state = "running"
    assert "card-equation" not in cards.cards_html([mtad_lane, ar_lane]).split('<div class="mtad-card"')[1]


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
        (dict(tau=None), "τ (MTAD threshold) is empty: give a number from 0 to 1"),
        (dict(tau=2), "τ (MTAD threshold) must be a number from 0 to 1; got 2"),
        (dict(tau=-0.3), "τ (MTAD threshold) must be a number from 0 to 1; got -0.3"),
        (dict(top_p=0.0), "top-p must be a number above 0 and at most 1; got 0.0"),
        (dict(seed=-5), "seed must be an integer from 0 to 2147483647; got -5"),
        (dict(beams=""), "beams W is empty: give an integer from 1 to 16"),
        (dict(greedy="no"), "greedy must be true or false"),
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


def test_rejected_whitespace_is_short_and_visible():
    assert tokens.visible("        ") == "␣×8"
    assert tokens.visible("\n    x") == "↵␣×4x"
    assert tokens.visible(" a b") == " a b"  # single spaces between words stay as they are
    assert tokens.visible("") == "∅"


def test_live_lane_draws_only_its_last_iterations_and_titles_come_first():
    lane = lane_of("sd", [sd_step(i) for i in range(5)])
    full = tokens.lane_html(lane, "prompt")
    live = tokens.lane_html(lane, "prompt", tail=2)
    assert full.count('class="it ') == 5 and live.count('class="it ') == 2
    assert "… 6 earlier tokens (3 iterations)" in live and "10 tokens · 5 iterations" in live
    empty = tokens.placeholder_html("mtad", "Press Run to generate.")
    assert '<span class="lane-title">MTAD</span>' in empty and 'data-method="mtad"' in empty


def test_verify_table_explains_a_failing_prefix_kept_inside_a_longer_passing_one():
    # prefix 1: log p - log q = -3 < log 0.1 (fails); prefix 2: -1 > log 0.1 (passes): eta = 2
    lane = lane_of("mtad", [mtad_step(0, draft=(1, 2), log_p=(-4.0, -1.5), log_q=(-1.0, -0.5))])
    assert mtad_accept_length([-4.0, -1.5], [-1.0, -0.5], 0.1) == 2
    html = verify.verify_html(lane, 0, 0.1, 0.1, FakeTokenizer())
    assert html.count("fails, kept: inside the passing prefix 2") == 1
    assert "Prefix 1 fails on its own, yet its tokens are kept" in html and "<b>longest</b>" in html
    # at a tau where nothing passes, nothing is kept and there is nothing to explain
    strict = verify.verify_html(lane, 0, 0.9, 0.1, FakeTokenizer())
    assert "fails, kept" not in strict and "v-kept-note" not in strict


def test_lane_upto_is_the_lane_as_it_stood():
    lane = lane_of("mtad", [mtad_step(0), mtad_step(1), mtad_step(2)])
    part = lane.upto(2)
    assert part.state == "running" and len(part.steps) == 2
    assert part.metrics() == summarize(lane.steps[:2])
    assert part.new_ids() == [t for s in lane.steps[:2] for t in s.appended_ids]
    assert lane.upto(3) is lane and lane.upto(0).state == "waiting"


def test_replay_animates_cards_and_plots_with_the_lanes():
    from mtad.ui import replay

    sd, md = lane_of("sd", [sd_step(i) for i in range(4)]), lane_of("mtad", [mtad_step(i) for i in range(3)])
    rec = RunRecord("tiny", "cpu", "ab", {"tau": 0.1, "gamma": 3, "beams": 2}, {"sd": sd, "mtad": md})
    frames = list(replay._replay(rec, max_seconds=0.3))
    first, last = frames[0], frames[-1]
    assert len(first) == 8  # message, status, three lanes, cards, two plots
    assert 'class="card-state">done' not in first[5]  # the cards start with the lanes, not at the end
    assert last[5].count('class="card-state">done') == 2
    assert last[1].startswith("Replayed on one time axis")
    counts = [len(f[6].data[0].x) for f in frames if not isinstance(f[6], dict) and f[6].data]
    assert counts[-1] == len(sd.steps) + 1 and counts[0] <= counts[-1]


def test_waiting_line_positions():
    from mtad.ui.waiting import WaitingLine, place_text

    line = WaitingLine()
    line.join("a")
    assert line.place("a").position == 1 and not line.must_wait("a")
    line.start("a")
    line.join("b")
    line.join("c")
    b, c = line.place("b"), line.place("c")
    assert (b.position, b.total, c.position) == (2, 3, 3) and b.running_for is not None
    assert "you are number 3 of 3 (2 runs ahead of you" in place_text(c)
    line.leave("b")  # stopped while waiting
    assert line.place("c").position == 2 and line.place("b") is None
    line.leave("a")
    line.start("c")
    assert line.place("c") is None


def test_positions_come_from_gradio_s_queue_api_jobs_included(monkeypatch):
    from mtad.ui import waiting
    from mtad.ui.waiting import Jobs, WaitingLine, place_text

    queue = {"jobs": Jobs(pending=["api-1", "b", "api-2", "c"], api=[True, False, True, False], active=["a"])}
    line = WaitingLine(lambda: queue["jobs"])
    line.start("a")
    for s in ("b", "c"):
        line.join(s)
    b, c = line.place("b"), line.place("c")
    assert (b.position, b.total, b.api, b.state) == (3, 5, 1, "waiting")
    assert (c.position, c.total, c.api) == (5, 5, 2)
    assert "you are number 5 of 5 (4 runs ahead of you, 2 of them from the API" in place_text(c)
    line.leave("b", stopped=True)  # Stop while waiting: its job stays in Gradio's queue but decodes nothing
    assert line.place("b") is None and (line.place("c").position, line.place("c").total) == (4, 4)
    line.join("d")  # pressed Run a moment ago, its job not in Gradio's queue yet
    d = line.place("d")
    assert d.state == "joining" and d.position == 5 and place_text(d).startswith("Joining the queue (4 runs ahead")
    monkeypatch.setattr(waiting, "GRACE", 0.0)  # ... and still not there after the grace: Gradio refused it
    queue["jobs"] = Jobs(pending=["api-1", "b", "api-2", "c"], api=[True, False, True, False], size=4, max_size=4)
    refused = line.place("d")
    assert refused.state == "refused" and place_text(refused).startswith(
        "The queue is full (4 runs waiting, the most this server keeps): your run was not queued"
    )
    assert "starts by itself" not in place_text(refused) and "number" not in place_text(refused)
    queue["jobs"] = Jobs(pending=["api-1"], api=[True], active=["d"])
    assert line.place("d") is None  # running: the run takes over the page
    assert Jobs(size=3, max_size=3).full and not Jobs(size=2, max_size=3).full and not Jobs(size=9).full


def test_gradio_jobs_reads_a_launched_page_s_queue_and_none_without_one():
    from mtad.ui.waiting import gradio_jobs

    assert gradio_jobs(object()) is None


@pytest.fixture
def two_presets(tmp_path, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "def f():\\n    return 1"}\n{"prompt": "def f():\\n    return 2"}\n{"prompt": "class A:"}\n'
    )
    (tmp_path / "d").mkdir()
    (tmp_path / "pairs.toml").write_text(
        '[pairs.local]\ndescription = "local"\ndraft = "./d"\ntarget = "./d"\nprompts = "p.jsonl"\n\n'
        '[pairs.big]\ndescription = "big"\ndraft = "org/small-125m"\ntarget = "org/huge-13b"\n'
        'prompts = "p.jsonl"\n'
    )
    monkeypatch.setenv("MTAD_PAIRS", str(tmp_path / "pairs.toml"))
    monkeypatch.setenv("MTAD_OFFLINE", "1")
    monkeypatch.delenv("MTAD_UNAVAILABLE_PAIRS", raising=False)


def test_examples_are_distinct_and_a_pair_change_keeps_a_typed_prompt(two_presets):
    from mtad.ui import pickers

    ex = pickers.pair_examples("local")
    assert [label for label, _ in ex] == ["def f():", "class A:"]
    import gradio as gr

    info, examples, prompt = pickers.on_pair_change("big", "my own prompt")
    assert prompt == gr.skip() and examples["value"] is None  # the typed prompt stays
    _, _, prompt = pickers.on_pair_change("big", "class A:")  # an example, not typed: it follows the pair
    assert prompt["value"] == "def f():\n    return 1"


def test_presets_that_cannot_run_here_are_marked_or_hidden(two_presets, monkeypatch):
    import torch

    from mtad.models.presets import presets
    from mtad.ui import availability, pickers
    from mtad.ui import run as runs

    big = presets()["big"]
    assert availability.target_billions(big) == 13.0
    reason = availability.unavailable_reason(big)
    assert "needs the internet" in reason and "MTAD_OFFLINE is set" in reason
    labels = dict((n, lab) for lab, n in pickers.pair_choices())
    assert labels == {"local": "local", "big": "big (needs the internet: not on this server)"}
    assert "Cannot run on this server" in pickers.pair_info("big")
    monkeypatch.setenv("MTAD_UNAVAILABLE_PAIRS", "hide")
    assert [n for _, n in pickers.pair_choices()] == ["local"]
    with pytest.raises(ValueError, match="cannot run on this server: it needs the internet"):
        runs.check_run("x", "big", False, {})
    monkeypatch.setenv("MTAD_OFFLINE", "0")
    monkeypatch.setattr(availability, "hub_unreachable", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (
        availability.unavailable_reason(big) == "needs a GPU: its target has 13 B parameters and this server has none"
    )


def test_pair_facts_are_read_from_the_loaded_models(tiny_pair):
    from mtad.ui import pickers

    d = sum(p.numel() for p in tiny_pair.draft.parameters())
    t = sum(p.numel() for p in tiny_pair.target.parameters())
    facts = pickers.pair_facts(tiny_pair)
    assert facts.startswith(f"draft {pickers.millions(d)}, target {pickers.millions(t)} parameters · float32 · ")
    assert "transformers " in facts and "attention" in facts
    assert [pickers.millions(n) for n in (11_812_345, 134_515_008, 1_340_000_000, 250_400)] == [
        "11.8 M",
        "135 M",
        "1.34 B",
        "250 k",
    ]


def test_no_preset_description_states_a_size_or_dtype_the_models_would_contradict():
    from mtad.models.presets import presets

    for name, p in presets().items():
        assert not re.search(r"\d+(\.\d+)?\s?[MBk]-parameter|bf16|bfloat16|float32|fp16", p.description), name


def test_the_race_plays_each_lane_s_own_curve_on_one_time_axis():
    from mtad.ui import race

    sd = lane_of("sd", [sd_step(0), sd_step(1)])  # 2 tokens at 0.02 s and 4 at 0.04 s of its own clock
    ar = looping_lane("ar", seconds=0.01)  # 20 tokens, 4 at 0.01, 0.02, ... 0.05 s
    html = race.run_race_html([sd, ar], "CPU (1 thread)")
    assert "This run&#x27;s race on one time axis (CPU (1 thread)):" in html
    # the race lasts 0.05 s (AR's end); SD's bar: half its tokens at 40 %, all at 80 %, and 4/20 as long as AR's
    # while it grows, then at rest as long as its speed against the fastest's (AR's): 100 against 400 tokens/s
    sd_row = html.split('data-method="sd"')[1].split('data-method="ar"')[0]
    assert "linear(0 0%, 0.5000 40.000%, 1.0000 80.000%, 1 100%)" in sd_row
    assert "--grown: 20.0%; --rest: 25.0%" in sd_row
    assert "4 tokens in 0.04 s (100.0 tok/s) · 0.25× AR · 25% of the fastest" in sd_row
    ar_row = html.split('data-method="ar"')[1]
    assert "--rest: 100.0%" in ar_row and "race-won" in ar_row and "race-won" not in sd_row
    assert "× AR" not in html.split('data-method="ar"')[1]
    assert "true time;" in html  # shorter than 15 s: played at its own speed
    slow = looping_lane("ar", seconds=6.0)  # 30 s: played at twice the speed
    assert "true time ×2.0" in race.run_race_html([slow], "x") and "animation-duration: 15.00s" in race.run_race_html(
        [slow], "x"
    )
    assert race.run_race_html([LaneRecord(method="sd", prompt_ids=[1])], "x") == ""


def test_a_long_lane_s_curve_is_thinned_but_keeps_its_end():
    from mtad.ui import race

    secs = [0.01 * (i + 1) for i in range(1000)]
    curve = race.easing(secs, list(range(1, 1001)), 10.0)
    stops = curve.removeprefix("linear(").removesuffix(")").split(", ")
    assert len(stops) == race.MAX_POINTS + 3 and stops[-2] == "1.0000 100.000%" and stops[0] == "0 0%"


def test_the_recorded_race_names_its_device_pair_and_settings():
    from mtad.ui import race

    data = race.recorded_race()
    html = race.recorded_race_html("CPU (2 threads), no GPU")
    assert data["device"] and f"pair {data['pair']} on {data['device']}" in html
    assert "This server decodes on CPU (2 threads), no GPU: its own speeds differ" in html
    assert [c["method"] for c in data["lanes"]] == ["sd", "mtad", "ar"] and html.count('class="race-row') == 3
    assert race.RACE_FILE.stat().st_size < 20_000  # small enough to ship


def link_record() -> RunRecord:
    settings = parse_settings(
        tau=0.2, beams=3, gamma=4, max_new_tokens=24, greedy=False, temperature=0.7, top_k=5, top_p=0.8, seed=11
    ).to_dict()
    lanes = {"spectr": lane_of("spectr", [sd_step(0), sd_step(1)]), "bild": lane_of("bild", [sd_step(0)])}
    lanes["ar"] = lane_of("ar", [Step(0, "ar", appended_ids=[1], from_target=[True], target_logprobs=[-1.0])])
    return RunRecord(pair="tiny", device="CPU", prompt="a & b = c?", settings=settings, lanes=lanes)


def test_a_link_carries_the_run_s_inputs_and_the_iteration():
    from urllib.parse import parse_qs

    from mtad.ui import link

    q = {k: v[0] for k, v in parse_qs(link.link_query(link_record(), "spectr", 2)).items()}
    assert q == {
        "prompt": "a & b = c?",
        "pair": "tiny",
        "tau": "0.2",
        "beams": "3",
        "gamma": "4",
        "max_new": "24",
        "greedy": "0",
        "temperature": "0.7",
        "top_k": "5",
        "top_p": "0.8",
        "seed": "11",
        "m": "4",
        "tau1": "0.9",
        "tau2": "2.0",
        "left": "spectr",
        "right": "bild",
        "ar": "1",
        "lane": "spectr",
        "it": "2",
    }
    assert link.link_html(None, "mtad", 1) == ""
    assert "a &amp; b" not in link.link_html(link_record(), "spectr", 2)  # url-encoded, not raw text
    assert 'href="?prompt=a+%26+b+%3D+c%3F&amp;pair=tiny' in link.link_html(link_record(), "spectr", 2)


def test_previous_and_next_stay_within_the_lane_s_iterations():
    from mtad.ui import link, panel

    rec = link_record()
    assert panel.next_iteration(rec, "spectr", 1)["value"] == 2
    assert panel.next_iteration(rec, "spectr", 2)["value"] == 2  # the last of 2
    assert panel.previous_iteration(rec, "spectr", 1)["value"] == 1
    assert panel.previous_iteration(rec, "spectr", 2)["value"] == 1
    assert panel.next_iteration(None, "spectr", 1)["value"] == 1
    # values typed past the slider's ends reach the handlers unchecked (preprocess off): the nearest end
    assert panel.next_iteration(rec, "spectr", 99)["value"] == 2
    assert panel.previous_iteration(rec, "spectr", -7)["value"] == 1
    assert panel.previous_iteration(rec, "spectr", None)["value"] == 1
    assert "at iteration 2 of Spectr" in link.link_html(rec, "spectr", 99)
    assert panel.verify_view(rec, "spectr", 99, 1.5) == panel.verify_view(rec, "spectr", 2, 1.0)


def test_a_link_s_iteration_opens_after_the_run_and_is_then_spent():
    from mtad.ui import panel

    rec = link_record()
    lane, slider, _, html, _, spent = panel.verify_reset(rec, "mtad", {"lane": "spectr", "it": 2})
    assert lane["value"] == "spectr" and slider["value"] == 2 and "iteration 2 of 2" in html and spent is None
    lane, slider, *_ = panel.verify_reset(rec, "bild", {"lane": "spectr", "it": 9})  # past the end: iteration 1
    assert lane["value"] == "spectr" and slider["value"] == 1
    *_, kept = panel.verify_reset(None, "mtad", {"lane": "spectr", "it": 2})  # no run yet: kept for the next
    assert kept == {"lane": "spectr", "it": 2}


def test_the_legend_explains_the_hover_p_and_q_and_the_struck_through_drafts():
    legend = tokens.legend_html()
    assert "“p 1 · q 1” means both were certain" in legend and "warped distributions" in legend
    assert "struck through, to show what was tried" in legend and "reply only" in legend


def test_the_status_line_names_each_forward_shape_that_ran_uncompiled(monkeypatch):
    from mtad.models import static_llama
    from mtad.ui import pickers

    monkeypatch.setattr(static_llama, "UNCOMPILED", {})
    assert pickers.uncompiled_text() == ""
    static_llama.UNCOMPILED["Llama, 1 row, 5 tokens (gemv form)"] = "past dynamo's limit of 8 graphs, or a <failed>"
    text = pickers.uncompiled_text()
    assert text.startswith(" · **uncompiled forwards** (slower than compiled): Llama, 1 row, 5 tokens (gemv form)")
    assert "&lt;failed&gt;" in text and "<failed>" not in text
