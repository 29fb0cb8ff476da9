"""The page races any two decoders (default SD vs MTAD) and its verification panel shows every candidate.

The run handler is called as the page calls it (widget values in, the outputs' tuple out), on a
presets file naming the tiny test pair; the page's wiring of these inputs is in app.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr
import pytest

from mtad.decoding import decode, encode_prompt
from mtad.metrics import summarize
from mtad.settings import Settings
from mtad.ui import panel, pickers, verify
from mtad.ui import run as runs
from mtad.ui.record import LaneRecord, RunRecord
from mtad.ui.state import PAGE

BASE = dict(
    prompt="abc def abc",
    pair="tiny",
    tau=0.1,
    beams=4,
    gamma=3,
    max_new=12,
    greedy=False,
    temperature=1.0,
    top_k=20,
    top_p=0.9,
    seed=7,
    with_ar=False,
)
RACE = dict(left="sd", right="mtad", num_drafts=4, tau1=0.9, tau2=2.0)


def run_page(**changes: object) -> tuple:
    """The run handler's last output tuple for these widget values, in the page's input order."""
    values = {**BASE, **RACE, **changes}
    request = SimpleNamespace(session_hash="baselines-test")
    PAGE.cancels.arm("baselines-test")
    *_, last = runs.run(*values.values(), request)
    return last


def test_default_race_is_sd_vs_mtad(tiny_presets) -> None:  # noqa: ANN001
    final = run_page()
    assert list(final[-1]["lanes"]) == ["sd", "mtad"]
    assert 'data-method="sd"' in final[2] and 'data-method="mtad"' in final[3]


def test_visitor_picks_the_two_racing_decoders(tiny_presets) -> None:  # noqa: ANN001
    from mtad.ui.state import PAGE

    final = run_page(left="spectr", right="bild", num_drafts=3, tau1=0.2, with_ar=True)
    data = final[-1]
    assert list(data["lanes"]) == ["spectr", "bild", "ar"]
    assert 'data-method="spectr"' in final[2] and 'data-method="bild"' in final[3] and 'data-method="ar"' in final[4]
    settings = Settings(tau=0.1, beams=4, gamma=3, max_new_tokens=12, seed=7, num_drafts=3, tau1=0.2)
    pair = PAGE.pairs.get("tiny")
    ids = encode_prompt(pair, BASE["prompt"], settings)
    for method, lane in data["lanes"].items():
        fresh = list(decode(pair, ids, settings.with_(method=method)))
        assert lane["new_ids"] == [t for s in fresh for t in s.appended_ids]
        assert lane["metrics"]["target_calls"] == summarize(fresh).target_calls
    assert all(len(s["candidates"]) == 3 for s in data["lanes"]["spectr"]["steps"] if s["candidates"])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(left="mtad", right="mtad"), "pick two different decoders"),
        (dict(right="medusa"), "the right lane must be one of"),
        (dict(num_drafts=0), "drafts m must be an integer from 1 to 8"),
        (dict(tau1=1.5), "τ1 (BiLD fallback) must be a number from 0 to 1; got 1.5"),
        (dict(tau2=-1), "τ2 (BiLD rollback, nats) must be a number from 0 to 10; got -1"),
    ],
)
def test_bad_racer_settings_are_messages(tiny_presets, changes: dict, message: str) -> None:  # noqa: ANN001
    with pytest.raises(gr.Error) as err:
        run_page(**changes)
    assert message in str(err.value)


def test_pick_racers_messages() -> None:
    assert pickers.pick_racers("spectr", "mtad-tree") == ["spectr", "mtad-tree"]
    with pytest.raises(ValueError, match="the left lane must be one of"):
        pickers.pick_racers("ar", "mtad")
    with pytest.raises(ValueError, match="both lanes are SpecInfer"):
        pickers.pick_racers("specinfer", "specinfer")


@pytest.mark.parametrize("method", ["specinfer", "mtad-tree"])
def test_verify_panel_shows_every_candidate(tiny_pair, method: str) -> None:  # noqa: ANN001
    settings = Settings(method=method, gamma=3, beams=3, num_drafts=3, tau=0.3, max_new_tokens=12, seed=1)
    ids = tiny_pair.encode("abc de")
    lane = LaneRecord(method=method, prompt_ids=ids)
    for step in decode(tiny_pair, ids, settings):
        lane.add(step, tiny_pair.tokenizer)
    step = lane.steps[0]
    html = verify.verify_html(lane, 0, 0.3, 0.3, tiny_pair.tokenizer)
    assert "All 3 candidates" in html and html.count("<td>★ ") == 1
    for c, kept in enumerate(step.candidate_kept):
        assert f"<td>{kept} of {len(step.candidates[c])}</td>" in html
    record = RunRecord(pair="tiny", device="cpu", prompt="abc de", settings=settings.to_dict(), lanes={method: lane})
    record.lanes["sd"] = LaneRecord(method="sd", prompt_ids=ids)
    assert panel.lane_choices(record) == [(lane.label, method), ("Speculative decoding", "sd")]


def test_the_status_line_puts_the_ar_lane_against_the_weight_read_bound(tiny_presets) -> None:  # noqa: ANN001
    """AR's seconds a token over the target's weight bytes ÷ this machine's read bandwidth, once AR has run."""
    from mtad.models.bandwidth import read_bandwidth, weight_bytes

    final = run_page(with_ar=True)
    status, lane = final[1], final[-1]["lanes"]["ar"]
    pair = PAGE.pairs.get("tiny")
    seconds_a_token = sum(s["seconds"] for s in lane["steps"]) / len(lane["new_ids"])
    bound = weight_bytes(pair.target) / read_bandwidth(pair.device)
    assert f"AR at {seconds_a_token / bound:.1f}× the weight-read bound" in status
    assert "weight-read bound" not in run_page(with_ar=False)[1]  # no AR lane: nothing to put against it
