"""What the page shows on opening (``mtad.ui.opening``): γ and W from this device's timings where it has them
(here a fake timing file stands for a machine's), else the paper's; the pair's state in the status line; this
device's latest race, else the recorded one contrasted with this device."""

from __future__ import annotations

import json
import threading
from html import unescape as html_text
from types import SimpleNamespace

import pytest
from test_app_client import tiny_acceptance_table
from test_ui_render import lane_of, looping_lane, sd_step

from mtad.models.presets import presets
from mtad.tuning import known_fastest
from mtad.tuning.choose import timed_runs
from mtad.tuning.table import METHODS
from mtad.tuning.timing import cache_file, machine_key
from mtad.ui import opening, race
from mtad.ui.inputs import DEFAULTS, example_prompts
from mtad.ui.record import RunRecord
from mtad.ui.state import PAGE

PAIR = "tinypage"


@pytest.fixture(scope="module")
def loaded(tiny_dirs, tmp_path_factory):
    """A tiny pair with an acceptance table, offered by the operator's presets and loaded in the page's
    cache, as after start-up."""
    root = tmp_path_factory.mktemp("opening")
    draft, target = tiny_dirs
    (root / "pairs.toml").write_text(
        f'[pairs.{PAIR}]\ndescription = "tiny test pair"\ndraft = "{draft}"\ntarget = "{target}"\n'
        'prompts = "prompts.jsonl"\nacceptance = "acceptance.json"\n'
    )
    (root / "prompts.jsonl").write_text('{"id": "a", "category": "letters", "prompt": "abc abc fed cab"}\n')
    tiny_acceptance_table().save(root / "acceptance.json")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MTAD_PAIRS", str(root / "pairs.toml"))
        yield PAGE.pairs.get(PAIR)


def fake_timings(pair, fastest_gamma: int, fastest_beams: int) -> None:
    """A timing file as this machine would have written, in which MTAD at (γ, W) is by far the fastest."""
    _, _, runs = timed_runs(pair, opening.paper_settings(), None, METHODS)
    seconds = {}
    for name, s in runs.items():
        best = s.method == "mtad" and (s.gamma, s.beams) == (fastest_gamma, fastest_beams)
        seconds[name] = 0.001 if best else 0.05
    path = cache_file(machine_key(pair))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": machine_key(pair), "seconds": seconds}))


def test_the_page_opens_with_this_device_s_fastest_settings_when_it_timed_them(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("MTAD_CACHE", str(tmp_path))
    gamma, beams, note, *_ = opening.on_load(PAIR, None)
    assert (gamma, beams) == (opening.gr.skip(), opening.gr.skip())  # nothing timed here: the paper's stay
    assert f"γ {DEFAULTS.gamma}, W {DEFAULTS.beams}: the paper's settings" in note and "not timed yet" in note
    fake_timings(loaded, 2, 1)
    gamma, beams, note, *_ = opening.on_load(PAIR, None)
    assert (gamma, beams) == (2, 1)
    assert note.startswith("γ 2, W 1: **this device's fastest** for MTAD (predicted ")
    assert f"The paper's settings are γ {DEFAULTS.gamma}, W {DEFAULTS.beams}." in note
    fake_timings(loaded, 3, 4)  # another machine's timings would give other settings
    assert opening.on_load(PAIR, None)[:2] == (3, 4)
    # a link that sets γ or W keeps them; the button goes back to the paper's
    link = SimpleNamespace(query_params={"gamma": "3"})
    assert opening.on_load(PAIR, link)[:2] == (opening.gr.skip(), opening.gr.skip())
    gamma, beams, note = opening.back_to_paper(PAIR)
    assert (gamma, beams) == (DEFAULTS.gamma, DEFAULTS.beams) and "fastest for MTAD are γ 3, W 4" in note


def test_the_background_timing_times_once_and_the_page_then_knows(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("MTAD_CACHE", str(tmp_path))
    monkeypatch.setattr(opening, "paper_settings", lambda: DEFAULTS.with_(max_new_tokens=8))
    calls = []
    real = opening.fastest
    monkeypatch.setattr(opening, "fastest", lambda pair, s, **k: calls.append(s) or real(pair, s, **k))
    assert known_fastest(loaded, opening.paper_settings()) is None
    done = threading.Thread()
    done.start()
    done.join()
    opening.time_candidates(PAIR, done)  # as start-up does once the pair is loaded
    assert len(calls) == 1 and opening.TIMING[PAIR] == "done"
    tuning = known_fastest(loaded, opening.paper_settings())
    assert tuning is not None and tuning.from_disk
    assert opening.on_load(PAIR, None)[:2] == (tuning.best("mtad").candidate.gamma, tuning.best("mtad").candidate.beams)


def test_the_status_line_says_whether_the_pair_is_loaded(loaded, monkeypatch):
    assert f"Pair `{PAIR}` loaded on **" in opening.status_text(PAIR) and "press **Run**" in opening.status_text(PAIR)
    assert "draft " in opening.status_text(PAIR)  # the pair's facts
    waiting = threading.Event()
    loading = threading.Thread(target=waiting.wait)
    loading.start()
    monkeypatch.setitem(PAGE.preloaded, "smollm2", loading)
    try:
        assert "Starting up: loading the pair `smollm2` and compiling it" in opening.status_text("smollm2")
        status, timer = opening.on_refresh("smollm2")
        assert status.startswith("Starting up") and timer["active"] is True
        refused = "Not run: the prompt is empty: type some text to continue"
        assert opening.on_refresh("smollm2", refused)[0] == opening.gr.skip()  # a run's status stays
    finally:
        waiting.set()
        loading.join()
    assert opening.on_refresh(PAIR)[1]["active"] is False  # loaded: the timer stops
    assert "Loads once, on its first run" in opening.on_load(PAIR, None)[-1]
    monkeypatch.setitem(PAGE.preloaded, PAIR, loading)  # loaded at start-up: the pair's note says so
    assert "Loads once, when the server starts, then stays in memory." in opening.on_load(PAIR, None)[-1]
    assert "the pair loads on its first run" in opening.status_text("nowhere")


def finished_run(prompt: str) -> RunRecord:
    lanes = {"sd": lane_of("sd", [sd_step(0), sd_step(1)]), "ar": looping_lane("ar", seconds=0.01)}
    return RunRecord(pair=PAIR, device="CPU", prompt=prompt, settings=DEFAULTS.to_dict(), lanes=lanes)


def test_the_first_visit_shows_this_device_s_latest_race_and_never_a_visitor_s_prompt(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("MTAD_CACHE", str(tmp_path))
    first = opening.opening_race(PAIR)
    assert "A race recorded elsewhere" in first and "This server decodes on" in first
    race.keep_latest_race(finished_run("my secret plans for Friday"), loaded)
    html = opening.opening_race(PAIR)
    assert "This device&#x27;s latest race" in html and "secret" not in html and "a visitor" in html
    assert html.count('class="race-row') == 2
    text = example_prompts(presets()[PAIR])[0][1]  # an example prompt is shown
    race.keep_latest_race(finished_run(text), loaded)
    assert text[:30] in html_text(opening.opening_race(PAIR))
    stopped = finished_run("another")
    stopped.lanes["ar"].state = "stopped"
    race.keep_latest_race(stopped, loaded)  # a stopped race is not kept: the last full one stays
    assert text[:30] in html_text(opening.opening_race(PAIR))
