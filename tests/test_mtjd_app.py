"""The page's MTJD lane: selectable like the other decoders, labelled as the slow reference, its card from
the same Steps, and a verification panel that shows the target's beams and their joint log p."""

from __future__ import annotations

import math
from types import SimpleNamespace

import gradio as gr
import pytest
from test_verify_panel import Tables, texts

from mtad.decoding import decode, encode_prompt
from mtad.metrics import summarize
from mtad.settings import Settings
from mtad.ui import figures, outputs, panel, pickers, verify
from mtad.ui import run as runs
from mtad.ui.record import LABELS, LaneRecord, RunRecord
from mtad.ui.state import PAGE
from mtad.ui.verify_mtjd import KEPT, OTHER

VALUES = dict(
    prompt="abc def abc",
    pair="tiny",
    tau=0.1,
    beams=3,
    gamma=3,
    max_new=12,
    greedy=False,
    temperature=1.0,
    top_k=20,
    top_p=0.9,
    seed=7,
    with_ar=True,
    left="mtad",
    right="mtjd",
    num_drafts=4,
    tau1=0.9,
    tau2=2.0,
)


def run_page(**changes: object) -> tuple:
    values = {**VALUES, **changes}
    PAGE.cancels.arm("mtjd-test")
    *_, last = runs.run(*values.values(), SimpleNamespace(session_hash="mtjd-test"))
    return last


def mtjd_lane(tiny_pair, **changes: object) -> LaneRecord:  # noqa: ANN001
    settings = Settings(method="mtjd", gamma=3, beams=3, max_new_tokens=10, seed=1).with_(**changes)
    ids = tiny_pair.encode("abc de")
    lane = LaneRecord(method="mtjd", prompt_ids=ids)
    for step in decode(tiny_pair, ids, settings):
        lane.add(step, tiny_pair.tokenizer)
    return lane


def test_mtjd_is_a_lane_like_the_others(tiny_presets) -> None:  # noqa: ANN001
    from mtad.ui.state import PAGE

    assert "mtjd" in pickers.RACERS and LABELS["mtjd"] == "MTJD (reference, slow)"
    final = run_page()
    data = final[-1]
    assert list(data["lanes"]) == ["mtad", "mtjd", "ar"]
    assert 'data-method="mtjd"' in final[3] and "MTJD (reference, slow)" in final[3] and "K = 3, W = 3" in final[3]
    settings = Settings(beams=3, gamma=3, max_new_tokens=12, seed=7)
    pair = PAGE.pairs.get("tiny")
    ids = encode_prompt(pair, VALUES["prompt"], settings)
    fresh = list(decode(pair, ids, settings.with_(method="mtjd")))
    lane = data["lanes"]["mtjd"]
    assert lane["new_ids"] == [t for s in fresh for t in s.appended_ids]
    assert lane["metrics"]["target_calls"] == summarize(fresh).target_calls > len(fresh)
    assert lane["metrics"]["acceptance"] is None and lane["label"] == "MTJD (reference, slow)"
    choices = panel.lane_choices(final[-2])
    assert ("MTJD (reference, slow)", "mtjd") in choices


def test_mtjd_settings_are_checked_like_every_lanes(tiny_presets) -> None:  # noqa: ANN001
    with pytest.raises(gr.Error, match="draft length γ must be an integer from 1 to 12"):
        run_page(gamma=13)
    with pytest.raises(gr.Error, match="both lanes are MTJD"):
        run_page(left="mtjd")


def test_the_panel_shows_the_targets_beams_and_their_joint_log_p(tiny_pair) -> None:  # noqa: ANN001
    lane = mtjd_lane(tiny_pair)
    step = lane.steps[0]
    html = verify.verify_html(lane, 0, 0.1, 0.1, tiny_pair.tokenizer)
    assert "The target's beams" in html and "3 target forwards" in html and "τ plays no part" in html
    beams, block = Tables(html).tables
    body = beams[1:]
    assert len(body) == 3 and [texts(r)[0] for r in body].count(f"★ beam {step.best_beam + 1}") == 1
    scores = [float(texts(r)[2]) for r in body]
    assert scores == sorted(scores, reverse=True) and scores[0] == pytest.approx(max(step.beam_scores), abs=1e-3)
    assert body[0][0] == "beam-chosen"  # the best beam is the one written
    assert len(block) == 1 + len(step.appended_ids)
    assert [float(texts(r)[3]) for r in block[1:]] == pytest.approx(step.log_p, abs=1e-3)
    fig = verify.verify_figure(lane, 0, 0.1)
    bar = fig.data[0]
    assert list(bar.y) == pytest.approx(sorted(step.beam_scores, reverse=True), abs=1e-9)
    assert list(bar.marker.color) == [KEPT, OTHER, OTHER]


def test_a_one_token_block_says_it_is_the_targets_own_draw(tiny_pair) -> None:  # noqa: ANN001
    lane = mtjd_lane(tiny_pair, max_new_tokens=1)
    assert lane.steps[0].beams is None
    assert "the target drew it itself" in verify.verify_html(lane, 0, 0.1, 0.1, tiny_pair.tokenizer)
    assert verify.verify_figure(lane, 0, 0.1).data == ()


def test_mtjd_draws_no_accepted_bars_and_its_tokens_say_where_they_came_from(tiny_pair) -> None:  # noqa: ANN001
    lane = mtjd_lane(tiny_pair)
    assert figures.accepted_per_iteration([lane]).data == ()
    record = RunRecord(pair="tiny", device="cpu", prompt="abc de", settings={"gamma": 3, "beams": 3}, lanes={})
    record.lanes["mtjd"] = lane
    html = outputs.lane_box(record, "mtjd")
    assert "best of 3 beams (MTJD)" in html and "tok-acc" not in html and "tok-rej" not in html
    assert not math.isnan(lane.metrics().perplexity)
