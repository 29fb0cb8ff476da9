"""The page races any two decoders (default SD vs MTAD) and its verification panel shows every candidate."""

from __future__ import annotations

import pytest
from test_app_client import BASE, app_server, client  # noqa: F401  (the launched app and its client)

from mtad.decoding import decode, encode_prompt
from mtad.metrics import summarize
from mtad.settings import Settings
from mtad.ui import handlers, verify
from mtad.ui.record import LaneRecord, RunRecord

gradio_client = pytest.importorskip("gradio_client")
PAIR = BASE["pair"]


def args(**changes: object) -> list:
    extra = {"left": "sd", "right": "mtad", "num_drafts": 4, "tau1": 0.9, "tau2": 2.0}
    return list({**BASE, **extra, **changes}.values())


def test_visitor_picks_the_two_racing_decoders(client) -> None:  # noqa: ANN001, F811
    from mtad.ui.runner import PAIRS

    final = client.predict(*args(left="spectr", right="bild", num_drafts=3, tau1=0.2, max_new=12), api_name="/run")
    data = final[-1]
    assert list(data["lanes"]) == ["spectr", "bild"]
    assert 'data-method="spectr"' in final[1] and 'data-method="bild"' in final[2]
    settings = Settings(tau=0.1, beams=4, gamma=3, max_new_tokens=12, seed=7, num_drafts=3, tau1=0.2)
    pair = PAIRS.get(PAIR)
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
        (dict(right="medusa"), "not in the list of choices"),
        (dict(num_drafts=0), "less than minimum value 1"),
        (dict(tau1=1.5), "greater than maximum value 1"),
    ],
)
def test_bad_racer_settings_are_messages(client, changes: dict, message: str) -> None:  # noqa: F811
    with pytest.raises(gradio_client.exceptions.AppError) as err:
        client.predict(*args(**changes), api_name="/run")
    assert message in str(err.value)


def test_pick_racers_messages() -> None:
    assert handlers.pick_racers("spectr", "mtad-tree") == ["spectr", "mtad-tree"]
    with pytest.raises(ValueError, match="the left lane must be one of"):
        handlers.pick_racers("ar", "mtad")
    with pytest.raises(ValueError, match="both lanes are SpecInfer"):
        handlers.pick_racers("specinfer", "specinfer")


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
    assert handlers.lane_choices(record) == [(lane.label, method), ("Speculative decoding", "sd")]
