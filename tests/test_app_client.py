"""The web app through its API: gradio_client against a locally launched app on the tiny pair."""

from __future__ import annotations

import contextlib
import html
import importlib
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

gradio_client = pytest.importorskip("gradio_client")

from mtad.decoding import decode, encode_prompt  # noqa: E402
from mtad.events import Step  # noqa: E402
from mtad.metrics import summarize  # noqa: E402
from mtad.settings import Settings  # noqa: E402
from mtad.tuning import AcceptanceTable, candidates, warp_of  # noqa: E402

PAIR = "tiny"
_SERVER: dict = {}

# The run endpoint's inputs in order: prompt, pair, tau, beams, gamma, max_new, greedy, temperature,
# top_k, top_p, seed, with_ar, left, right, num_drafts, tau1, tau2.
BASE = dict(
    prompt="abc def abc",
    pair=PAIR,
    tau=0.1,
    beams=4,
    gamma=3,
    max_new=24,
    greedy=False,
    temperature=1.0,
    top_k=20,
    top_p=0.9,
    seed=7,
    with_ar=False,
    left="sd",
    right="mtad",
    num_drafts=4,
    tau1=0.9,
    tau2=2.0,
)


def args(**changes: object) -> list:
    d = {**BASE, **changes}
    return list(d.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_app(tiny_dirs: tuple[str, str], root: Path) -> dict:
    """Launch app.py once per test session on a presets file that names the tiny pair.

    The app reads ``MTAD_PAIRS`` at every request: use it inside :func:`app_env`.
    """
    if _SERVER:
        return _SERVER
    draft, target = tiny_dirs
    presets = root / "pairs.toml"
    presets.write_text(
        f'[pairs.{PAIR}]\ndescription = "tiny random test pair"\ndraft = "{draft}"\ntarget = "{target}"\n'
        f'prompts = "prompts.jsonl"\nacceptance = "acceptance.json"\n\n'
        '[pairs.hubonly]\ndescription = "a pair that needs the Hub"\ndraft = "nobody/draft-x"\n'
        'target = "nobody/target-x"\n'
    )
    (root / "prompts.jsonl").write_text(
        '{"id": "a", "category": "letters", "prompt": "abc abc"}\nnot json\n{"id": "b", "prompt": "bad cafe"}\n'
    )
    tiny_acceptance_table().save(root / "acceptance.json")
    _SERVER["env"] = {"MTAD_PAIRS": str(presets), "MTAD_PAIR": PAIR, "MTAD_CACHE": str(root / "cache")}
    with app_env():
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        app = importlib.import_module("app")
        port = free_port()
        app.main(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    _SERVER.update(url=f"http://127.0.0.1:{port}/", app=app)
    return _SERVER


def tiny_acceptance_table() -> AcceptanceTable:
    """A made-up acceptance table for the tiny pair under the page's default warp (the page's "Fastest" times
    the candidates for real; only their tokens per target call are made up here)."""
    rows = [
        {"method": c.method, "gamma": c.gamma, "beams": c.beams, "new_tokens": 0, "target_calls": 0}
        | {"block_efficiency": 1 + (0.5 if c.method == "mtad" else 0.3) * c.gamma}
        for c in candidates()
    ]
    table = AcceptanceTable(PAIR, "made up", 16, [0], "float32", "2026-11-28", None)
    table.warps.append({"warp": warp_of(Settings()), "rows": rows})
    return table


@contextlib.contextmanager
def app_env():
    """Point the app at the tiny presets for a while, then restore the environment for other tests."""
    saved = {k: os.environ.get(k) for k in _SERVER["env"]}
    os.environ.update(_SERVER["env"])
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def app_server(tiny_dirs, tmp_path_factory) -> dict:
    server = launch_app(tiny_dirs, tmp_path_factory.mktemp("app"))
    with app_env():
        yield server


@pytest.fixture(scope="module")
def client(app_server):
    return gradio_client.Client(app_server["url"], verbose=False)


def steps_from_json(items: list[dict]) -> list[Step]:
    """Steps back from the app's JSON (None stands for -inf; 'seconds' is derived)."""
    out = []
    for d in items:
        d = {k: v for k, v in d.items() if k != "seconds"}
        for key in ("log_p", "log_q", "target_logprobs"):
            d[key] = [-math.inf if v is None else v for v in d[key]]
        out.append(Step(**d))
    return out


def test_run_streams_both_lanes_and_summaries_match_metrics(client):
    from mtad.ui.state import PAGE

    job = client.submit(*args(), api_name="/run")
    outputs = list(job)
    final = job.result()
    assert len(outputs) >= 3
    # streaming: some partial output shows SD generating before MTAD has started, then MTAD filling
    sd_partial = [o for o in outputs if 'data-method="sd"' in o[2] and 'data-state="running"' in o[2]]
    mtad_partial = [o for o in outputs if 'data-method="mtad"' in o[3] and 'data-state="done"' not in o[3]]
    assert sd_partial or any('data-state="done"' in o[2] and 'data-method="mtad"' not in o[3] for o in outputs)
    assert mtad_partial
    data = final[-1]
    assert set(data["lanes"]) == {"sd", "mtad"}
    settings = Settings(tau=0.1, beams=4, gamma=3, max_new_tokens=24, seed=7)
    pair = PAGE.pairs.get(PAIR)  # the app's own pair (same device, same generator as the run)
    ids = encode_prompt(pair, BASE["prompt"], settings)
    for method, lane in data["lanes"].items():
        assert lane["state"] == "done"
        steps = steps_from_json(lane["steps"])
        # the card numbers are summarize() of exactly the recorded steps
        assert lane["metrics"] == summarize(steps).to_dict()
        # and the same run through the engine gives the same tokens and figures
        fresh = list(decode(pair, ids, settings.with_(method=method)))
        m_fresh, m_app = summarize(fresh), lane["metrics"]
        assert lane["new_ids"] == [t for s in fresh for t in s.appended_ids]
        for key in ("new_tokens", "target_calls", "block_efficiency", "acceptance", "iterations"):
            assert m_app[key] == getattr(m_fresh, key), key
        assert m_app["perplexity"] == pytest.approx(m_fresh.perplexity, rel=1e-6)
        if not lane["energy"]["available"]:  # a CPU: energy is n/a, never a number
            assert m_app["joules"] is None and m_app["joules_per_token"] is None
    # the cards show summarize's numbers, and energy as n/a on this CPU machine
    cards = final[5]
    m = data["lanes"]["mtad"]["metrics"]
    assert f"{m['block_efficiency']:.3g}" in cards
    assert "J/token" in cards
    if not data["lanes"]["mtad"]["energy"]["available"]:
        assert '<div class="card-value na">n/a</div>' in cards and 'title="n/a: ' in cards


def test_ar_lane_is_optional(client):
    final = client.predict(*args(with_ar=True, max_new=8), api_name="/run")
    assert set(final[-1]["lanes"]) == {"sd", "mtad", "ar"}
    assert final[-1]["lanes"]["ar"]["metrics"]["block_efficiency"] == 1.0
    assert 'data-method="ar"' in final[4]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(prompt="   "), "the prompt is empty"),
        (dict(beams=17), "beams W must be an integer from 1 to 16; got 17"),
        (dict(beams=0), "beams W must be an integer from 1 to 16; got 0"),
        (dict(beams=None), "beams W is empty: give an integer from 1 to 16"),
        (dict(gamma=0), "draft length γ must be an integer from 1 to 12; got 0"),
        (dict(tau=1.5), "τ (MTAD threshold) must be a number from 0 to 1; got 1.5"),
        (dict(tau=-0.3), "τ (MTAD threshold) must be a number from 0 to 1; got -0.3"),
        (dict(beams=2.5), "beams W must be an integer from 1 to 16"),
        (dict(top_k=3.5), "top-k must be an integer"),
        (dict(seed=-5), "seed must be an integer from 0 to 2147483647; got -5"),
        (dict(max_new=250), "exceeds the model's context length"),
        (dict(pair="../../etc"), "model pair '../../etc' is not offered here"),
        (dict(pair="hubonly"), "Hugging Face Hub"),
        (dict(temperature=-1), "temperature must be a number from 0 to 2; got -1"),
        (dict(greedy="yes"), "greedy must be true or false"),
        (dict(left="medusa"), "the left lane must be one of"),
        (dict(left="mtad"), "both lanes are MTAD: pick two different decoders"),
        (dict(num_drafts=9), "drafts m must be an integer from 1 to 8; got 9"),
        (dict(tau1=1.5), "τ1 (BiLD fallback) must be a number from 0 to 1; got 1.5"),
        (dict(tau2=-1), "τ2 (BiLD rollback, nats) must be a number from 0 to 10; got -1"),
    ],
)
def test_bad_inputs_return_the_message(client, changes, message):
    """Out-of-range values are refused by name with what is allowed (never clamped into range)."""
    with pytest.raises(gradio_client.exceptions.AppError) as err:
        client.predict(*args(**changes), api_name="/run")
    assert message in str(err.value)


def test_api_races_the_picked_decoders(client):
    """The API takes the racers and their settings by name, like the page's pickers."""
    final = client.predict(*args(left="spectr", right="bild", num_drafts=2, max_new=8), api_name="/run")
    data = final[-1]
    assert list(data["lanes"]) == ["spectr", "bild"] and data["settings"]["num_drafts"] == 2
    assert 'data-method="spectr"' in final[2] and 'data-method="bild"' in final[3]


def test_refusal_stays_on_the_page_in_the_message_area(client):
    """Before failing, the run event writes the message into the page's message area and a fresh status."""
    job = client.submit(*args(tau=1.5), api_name="/run")
    with pytest.raises(gradio_client.exceptions.AppError):
        job.result()
    [shown] = job.outputs()
    assert 'class="mtad-message mtad-message-error"' in shown[0] and "τ (MTAD threshold)" in shown[0]
    assert shown[1].startswith("Not run: τ (MTAD threshold) must be a number from 0 to 1")


def test_a_prompt_over_the_operator_s_cap_is_refused_by_name(client, monkeypatch):
    from mtad.ui.state import PAGE

    prompt = "abc def " * 20
    n = len(encode_prompt(PAGE.pairs.get(PAIR), prompt, Settings()))  # counted independently of the app
    monkeypatch.setenv("MTAD_MAX_PROMPT_TOKENS", str(n - 1))
    with pytest.raises(gradio_client.exceptions.AppError) as err:
        client.predict(*args(prompt=prompt), api_name="/run")
    assert f"the prompt is {n:,} tokens long; this server takes at most {n - 1:,} prompt tokens" in str(err.value)
    monkeypatch.setenv("MTAD_MAX_PROMPT_TOKENS", str(n))  # exactly at the cap: runs
    assert client.predict(*args(prompt=prompt, max_new=4), api_name="/run")[-1]["lanes"]["sd"]["state"] == "done"
    monkeypatch.setenv("MTAD_MAX_PROMPT_TOKENS", "0")  # 0: no cap
    assert (
        client.predict(*args(prompt=prompt + "abc", max_new=4), api_name="/run")[-1]["lanes"]["sd"]["state"] == "done"
    )


def test_api_lists_only_run_and_replay_with_named_parameters(client):
    info = client.view_api(print_info=False, return_format="dict")
    assert set(info["named_endpoints"]) == {"/run", "/replay"} and not info["unnamed_endpoints"]
    run = info["named_endpoints"]["/run"]
    names = [p["parameter_name"] for p in run["parameters"]]
    assert names == ["prompt", "pair_name", "tau", "beams", "gamma", "max_new_tokens", "greedy"] + [
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "with_ar",
        "left",
        "right",
        "num_drafts",
        "tau1",
        "tau2",
    ]
    labels = [r["label"] for r in run["returns"]]
    assert labels[:3] == ["message", "status", "lane_1"] and labels[-1] == "run_data"
    assert not any(label.startswith("value_") for label in labels)


def endless_decode(pair, prompt_ids, settings):
    """A decoder that never reaches EOS (one token per 20 ms), so only a cancel can end it."""
    i = 0
    while True:
        time.sleep(0.02)
        yield Step(index=i, method=settings.method, appended_ids=[1], from_target=[True], target_logprobs=[-1.0])
        i += 1


def test_cancelled_job_stops_and_frees_the_device(client, app_server, monkeypatch):
    from mtad.ui import runner

    monkeypatch.setattr(runner, "decode", endless_decode)
    runner.HISTORY.clear()
    job = client.submit(*args(max_new=200), api_name="/run")
    deadline = time.time() + 60
    while time.time() < deadline and not any(w.is_alive() for w in list(runner.ACTIVE)):
        time.sleep(0.05)
    assert runner.ACTIVE, "the run never started"
    time.sleep(0.3)
    job.cancel()
    deadline = time.time() + 30
    while time.time() < deadline and any(w.is_alive() for w in list(runner.ACTIVE)):
        time.sleep(0.05)
    assert not any(w.is_alive() for w in list(runner.ACTIVE)), "the worker kept decoding after the cancel"
    assert not runner.DEVICE_LOCK.locked()
    [(method, state, steps)] = list(runner.HISTORY)  # the SD lane stopped; the MTAD lane never started
    assert (method, state) == ("sd", "stopped") and 0 < steps < 200
    monkeypatch.undo()
    # the app keeps serving
    final = client.predict(*args(max_new=6), api_name="/run")
    assert final[-1]["lanes"]["mtad"]["state"] == "done"


def test_out_of_memory_is_a_message_and_the_app_keeps_serving(client, monkeypatch):
    import torch

    from mtad.ui import runner

    def oom_decode(pair, prompt_ids, settings):
        yield Step(index=0, method=settings.method, appended_ids=[1], from_target=[True], target_logprobs=[-1.0])
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(runner, "decode", oom_decode)
    with pytest.raises(gradio_client.exceptions.AppError, match="ran out of memory"):
        client.predict(*args(max_new=8), api_name="/run")
    monkeypatch.undo()
    final = client.predict(*args(max_new=6), api_name="/run")
    assert final[-1]["lanes"]["sd"]["state"] == "done"


def test_stop_flag_ends_the_run_at_the_next_iteration(app_server, tiny_pair):
    """Stop (the session flag) ends a running lane after its current step; later lanes are skipped."""
    from mtad.ui import runner
    from mtad.ui.record import LaneRecord, RunRecord

    settings = Settings(max_new_tokens=200, gamma=1, beams=2, tau=1.0)
    ids = tiny_pair.encode("ab")
    rec = RunRecord("tiny", "cpu", "ab", settings.to_dict(), {m: LaneRecord(m, ids) for m in ("sd", "mtad")})
    cancel = threading.Event()
    for r in runner.run_lanes(tiny_pair, rec, settings, cancel, interval=0.02):
        if len(r.lanes["sd"].steps) >= 2:
            cancel.set()
    assert rec.lanes["sd"].state == "stopped"
    assert 2 <= len(rec.lanes["sd"].steps) < 200
    assert rec.lanes["mtad"].state == "stopped" and not rec.lanes["mtad"].steps


def test_a_lane_compiles_its_decoder_before_its_clock_starts(close_pair):
    """On the compiled engine a decoder's first run with new shapes compiles them first, untimed, with the
    lane marked "compiling" (the page says so); a second run of the same shapes starts at once. On the
    eager engine nothing is compiled."""
    import dataclasses

    import torch

    from mtad.decoding.precompile import WARMED, warm_up_pair
    from mtad.ui import runner
    from mtad.ui.record import LaneRecord, RunRecord

    settings = Settings(method="specinfer", gamma=3, num_drafts=3, max_new_tokens=6, seed=1)
    compiled = dataclasses.replace(close_pair, engine="compiled")
    torch._dynamo.reset()
    WARMED.pop(compiled.target, None)
    warm_up_pair(compiled, settings.gamma + 1)  # as the page does when it loads a pair
    ids = close_pair.encode("abc def")

    def states(pair) -> list[str]:  # noqa: ANN001
        rec = RunRecord("close", "cpu", "abc def", settings.to_dict(), {"specinfer": LaneRecord("specinfer", ids)})
        seen = []
        for r in runner.run_lanes(pair, rec, settings, threading.Event(), interval=0.001):
            seen.append(r.lanes["specinfer"].state)
        assert rec.lanes["specinfer"].state == "done" and rec.lanes["specinfer"].steps
        return [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]

    assert "compiling" in states(compiled)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert "compiling" not in states(compiled)
    assert "compiling" not in states(close_pair)


def test_fastest_sets_mtads_gamma_and_beams_or_says_why_not(app_server, monkeypatch):
    import gradio as gr

    from mtad.tuning.table import BEAMS, GAMMAS
    from mtad.ui import fastest
    from mtad.ui.fastest import fastest_page as streamed
    from mtad.ui.state import PAGE

    def fastest_page(*form):  # the button's last update; those before it say what is being timed
        *timing, last = list(streamed(*form))
        assert all("Timing this device" in m and g == w == n == gr.skip() for g, w, m, n in timing), timing
        return last[:3]

    with app_env():
        gamma, beams, message = fastest_page(PAIR, 0.1, False, 1.0, 20, 0.9)
        assert "Fastest on this device" in message and f"MTAD with γ {gamma} and W {beams} (" in message
        assert gamma in GAMMAS and beams in BEAMS and "× AR" in message
        for form, why in [
            ((PAIR, 0.1, True, 1.0, 20, 0.9), "no figures for greedy, τ 0.1, beam; it has T 1, top-k 20"),
            ((PAIR, 1.5, False, 1.0, 20, 0.9), "τ (MTAD threshold) must be"),
            (("nowhere", 0.1, False, 1.0, 20, 0.9), "model pair 'nowhere' is not offered here"),
        ]:
            gamma, beams, message = fastest_page(*form)
            assert gamma == beams == gr.skip() and "refused" in message
            assert why in html.unescape(message) and "No fastest settings" in message and "Not run" not in message
        # a pair whose preset names no table is told so in a visitor's words, before anything loads
        presets = Path(os.environ["MTAD_PAIRS"])
        tiny = presets.read_text().split("[pairs.hubonly]")[0]
        plain = tiny.replace(f"[pairs.{PAIR}]", "[pairs.plain]").replace('acceptance = "acceptance.json"\n', "")
        both = presets.with_name("with-plain.toml")
        both.write_text(presets.read_text() + "\n" + plain)
        with monkeypatch.context() as m:
            m.setenv("MTAD_PAIRS", str(both))
            gamma, beams, message = fastest_page("plain", 0.1, False, 1.0, 20, 0.9)
        assert gamma == beams == gr.skip() and "mtad-message-info" in message and "python -m" not in message
        assert "The pair 'plain' has no measured acceptance table" in html.unescape(message)
        assert f"; {PAIR} has one." in message and not PAGE.pairs.loaded("plain")
        monkeypatch.setattr(fastest, "fastest", lambda *a, **k: 1 / 0)  # whatever the timing raises
        gamma, beams, message = fastest_page(PAIR, 0.1, False, 1.0, 20, 0.9)
        assert gamma == gr.skip() and "No fastest settings: timing failed (ZeroDivisionError)" in message


def test_the_fastest_button_says_what_it_is_timing(tiny_pair):
    from mtad.ui.fastest import Timing

    timing = Timing(tiny_pair, Settings())
    assert "Timing this device's candidates" in timing.progress_text()
    timing.hear(4, 16, Settings(method="mtad", gamma=3, beams=4))
    assert timing.progress_text().endswith(": MTAD γ 3, W 4: 5 of 16…")
    timing.hear(0, 16, Settings(method="ar"))
    assert timing.progress_text().endswith(": AR: 1 of 16…")
    timing.hear(15, 16, Settings(method="sd", gamma=2))
    assert timing.progress_text().endswith(": SD γ 2: 16 of 16…")


def test_a_4_mb_prompt_is_refused_by_its_length_and_the_app_keeps_serving(client, monkeypatch):
    from mtad.ui import run as runs

    tokenized = []
    real = runs.encode_prompt
    monkeypatch.setattr(runs, "encode_prompt", lambda *a, **k: tokenized.append(len(a[1])) or real(*a, **k))
    with pytest.raises(gradio_client.exceptions.AppError, match="the prompt is 4,194,304 characters long"):
        client.predict(*args(prompt="a" * 4 * 2**20), api_name="/run")
    assert not tokenized
    final = client.predict(*args(max_new=6), api_name="/run")
    assert final[-1]["lanes"]["mtad"]["state"] == "done" and tokenized == [len(BASE["prompt"])]


def test_one_session_cannot_fill_the_queue(app_server, monkeypatch):
    import httpx

    from mtad.ui import runner

    monkeypatch.setattr(runner, "decode", endless_decode)
    monkeypatch.setenv("MTAD_JOBS_PER_SESSION", "1")
    greedy = gradio_client.Client(app_server["url"], verbose=False)
    first = greedy.submit(*args(max_new=200), api_name="/run")
    deadline = time.time() + 60
    while time.time() < deadline and not any(w.is_alive() for w in list(runner.ACTIVE)):
        time.sleep(0.05)
    assert runner.ACTIVE, "the first run never started"
    second = greedy.submit(*args(max_new=200), api_name="/run")
    with pytest.raises(gradio_client.utils.QueueError):
        second.result(timeout=30)
    fn_index = greedy._infer_fn_index("/run", None)
    body = {"data": args(max_new=200), "fn_index": fn_index, "session_hash": greedy.session_hash, "event_data": None}
    raw = httpx.post(app_server["url"] + "gradio_api/queue/join", json=body, timeout=30)
    assert raw.status_code == 503 and "this session already has 1 run queued or running" in raw.json()["detail"]
    other = gradio_client.Client(app_server["url"], verbose=False).submit(*args(max_new=6), api_name="/run")
    monkeypatch.undo()  # the running lane keeps its endless decoder; the next one decodes for real
    first.cancel()
    assert other.result(timeout=120)[-1]["lanes"]["mtad"]["state"] == "done"  # another client was queued and served


def test_the_state_kept_per_session_is_bounded(app_server):
    import gradio as gr

    demo = app_server["app"].demo
    assert demo.state_session_capacity == app_server["app"].SESSIONS == 256  # Gradio's own default keeps 10,000
    records = [b for b in demo.blocks.values() if isinstance(b, gr.State) and b.time_to_live != float("inf")]
    assert [b.time_to_live for b in records] == [3600]  # the run record; a session's last run goes after an hour


def test_a_session_keeps_one_copy_of_each_component_however_many_runs(app_server, client):
    """The run stream skips unchanged lanes and plots; a value after a skip must replace the session's copy of
    that component, not add one more (Gradio 6 gives each updated copy a fresh id) with its value."""
    demo = app_server["app"].demo
    for seed in (1, 2, 3):
        final = client.predict(*args(max_new=8, seed=seed), api_name="/run")
        assert final[-1]["lanes"]["mtad"]["state"] == "done"
    session = demo.state_holder.session_data[client.session_hash]
    assert set(session.blocks_config.blocks) == set(demo.blocks)
    assert set(session.config_values) <= set(demo.blocks)
    cards = next(k for k, b in demo.blocks.items() if getattr(b, "elem_id", None) == "cards")
    assert session.blocks_config.blocks[cards]._id == cards
    assert session.config_values[cards]["props"]["value"] == final[5]  # what a reconnecting page is sent
