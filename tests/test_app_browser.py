"""The web app in a real browser: Debian's chromium driven by Playwright, against a local launch.

Screenshots go to ``test-output/`` (git-ignored) for a person to look at.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
gradio_client = pytest.importorskip("gradio_client")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("needs Debian's chromium for the browser tests (apt-get install chromium)", allow_module_level=True)

from test_app_client import app_env, endless_decode, launch_app  # noqa: E402  (one launch per test session, shared)

OUT = Path(__file__).resolve().parent.parent / "test-output"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DONE = '#lane-{} .mtad-lane[data-state="done"]'


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory) -> dict:
    srv = launch_app(tiny_dirs, tmp_path_factory.mktemp("app"))
    with app_env():
        yield srv


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    OUT.mkdir(exist_ok=True)
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = ctx.new_page()
    pg.goto(server["url"])
    pg.wait_for_selector("#run-btn", timeout=60_000)
    yield pg
    ctx.close()


def type_number(page, box, value: str, enter: bool = False) -> None:
    """Type ``value`` into a number box and blur it, again until it stays: within about a second of the
    page opening, Gradio was seen putting freshly typed boxes back to their defaults (a box's value
    is read back after 300 ms; a visitor cannot type that fast)."""
    for _ in range(10):
        box.fill(value)
        if enter:
            box.press("Enter")
        box.blur()
        page.wait_for_timeout(300)
        if box.input_value() == value:
            return
    raise AssertionError(f"the box kept {box.input_value()!r}, not {value!r}")


def set_number(page, elem_id: str, value: object) -> None:
    """Type a value into a slider's / number's box and commit it."""
    type_number(page, page.locator(f"#{elem_id} input[type=number]"), str(value), enter=True)


def run_prompt(page, prompt: str, timeout: float = 120_000) -> None:
    """Run ``prompt`` and wait for the whole run: both raced lanes and, when it is ticked, the AR lane,
    which runs last (until then Gradio's timer still shows in the page's outputs)."""
    page.locator("#prompt textarea").fill(prompt)
    page.locator("#run-btn").click()
    page.wait_for_selector(DONE.format("left"), timeout=timeout)
    page.wait_for_selector(DONE.format("right"), timeout=timeout)
    if page.locator("#with-ar input").is_checked():
        page.wait_for_selector(DONE.format("ar"), timeout=timeout)


def test_run_both_lanes_verify_and_replay(page):
    assert "decodes on" in page.content()
    page.get_by_text("Sampling").click()
    page.get_by_label("greedy (argmax everywhere)").check()
    set_number(page, "max-new", 40)
    run_prompt(page, "abc def abc bad")

    # coloured accepted / target tokens and struck-through rejected ones, with p and q on hover
    lanes = page.locator("#lane-left, #lane-right")
    for cls in ("tok-acc", "tok-tgt", "tok-rej"):
        assert lanes.locator(f".{cls}").count() > 0, cls
    styles = page.evaluate(
        """() => ['tok-acc', 'tok-tgt', 'tok-rej'].map(c => {
            const s = getComputedStyle(document.querySelector('#lane-right .' + c) || document.querySelector('.' + c));
            return [s.backgroundColor, s.textDecorationLine];
        })"""
    )
    assert len({bg for bg, _ in styles}) == 3, styles
    assert "line-through" in styles[2][1] and "line-through" not in styles[0][1]
    title = page.locator("#lane-right .tok-acc, #lane-left .tok-acc").first.get_attribute("title")
    assert re.search(r"p [\d.e-]+ · q [\d.e-]+", title), title

    # the plots are drawn
    for plot in ("plot-tokens", "plot-accepted"):
        page.wait_for_selector(f"#{plot} .js-plotly-plot .main-svg", timeout=30_000)
        assert page.locator(f"#{plot} .js-plotly-plot .trace").count() > 0
    assert "n/a" in page.locator("#cards").inner_text()
    # each card writes its × AR out as the speed equation; the status line puts AR against the weight-read bound
    equation = r"× AR = [\d.]+ tokens? a call ÷ \([\d.e+-]+ \+ [\d.e+-]+ \+ [\d.e+-]+\) = [\d.]+×, measured [\d.]+×"
    assert len(re.findall(equation, page.locator("#cards").inner_text())) == page.locator(".mtad-card").count() >= 3
    assert re.search(r"AR at [\d.]+× the weight-read bound", page.locator("#status").inner_text())
    page.screenshot(path=str(OUT / "app_run.png"), full_page=True)

    # the verification panel re-judges the recorded draft at another tau, without a run
    panel = page.locator("#v-panel")
    page.wait_for_selector("#v-panel .v-eta", timeout=30_000)
    set_number(page, "v-tau", 0)
    page.wait_for_function("document.querySelector('#v-panel').innerText.includes('τ = 0.000')", timeout=30_000)
    eta_at_0 = int(panel.locator(".v-eta").inner_text())
    set_number(page, "v-tau", 1)
    page.wait_for_function("document.querySelector('#v-panel').innerText.includes('τ = 1.000')", timeout=30_000)
    eta_at_1 = int(panel.locator(".v-eta").inner_text())
    assert eta_at_1 == 0 and eta_at_0 > 0  # greedy: p > 0 everywhere, so tau = 0 passes the whole draft
    assert "τ = 1 rejects every draft" in panel.inner_text()
    # numbers typed past the sliders' ends are taken at the nearest end: no "Error" badge, the panel drawn
    for elem_id, value in (("v-tau", "1.5"), ("v-iter", "99")):
        box = page.locator(f"#{elem_id} input[type=number]")
        box.fill(value)
        box.press("Enter")  # the box pulls the number back to its end, but sends it first
        page.wait_for_timeout(1500)
    assert page.get_by_text("Error", exact=True).count() == 0 and "τ = 1.000" in panel.inner_text()
    assert "Link to this run at iteration 99" not in page.locator("#v-link").inner_text()
    page.wait_for_selector("#v-plot .js-plotly-plot .trace", timeout=30_000)
    page.locator("#v-panel").scroll_into_view_if_needed()
    page.screenshot(path=str(OUT / "app_verify.png"), full_page=True)

    # the SD lane's iterations show p, q and the verdict
    page.get_by_label("Speculative decoding").check()
    page.wait_for_function("document.querySelector('#v-panel').innerText.includes('SD accepts')", timeout=30_000)

    # Replay re-animates both lanes on one time axis
    page.locator("#replay-btn").click()
    page.wait_for_function("document.querySelector('#status').innerText.includes('Replay on one time axis')")
    page.wait_for_selector(DONE.format("left"), timeout=60_000)
    page.wait_for_selector(DONE.format("right"), timeout=60_000)


def message_text(page) -> str:
    return page.locator("#message").inner_text()


def test_empty_prompt_error_stays_on_the_page(page):
    page.locator("#prompt textarea").fill("   ")
    page.locator("#run-btn").click()
    page.wait_for_function("document.querySelector('#message').innerText.includes('the prompt is empty')")
    page.wait_for_timeout(4000)  # a toast would be gone by now; the message stays
    assert page.locator("#message .mtad-message-error").is_visible()
    assert "the prompt is empty" in message_text(page)
    assert page.locator("#status").inner_text().startswith("Not run: the prompt is empty")
    assert page.locator('#lane-left .mtad-lane[data-state="running"]').count() == 0
    page.screenshot(path=str(OUT / "app_empty_prompt.png"))
    # the next Run clears it
    set_number(page, "max-new", 4)
    run_prompt(page, "abc")
    # the run's last update clears it (Gradio's timer shows there until the run has ended)
    page.wait_for_function("document.querySelector('#message').innerText.trim() === ''", timeout=30_000)
    assert message_text(page).strip() == ""
    # a refused run keeps the last run's lanes, cards and record: Replay still replays it
    lane = page.locator("#lane-left").inner_text()
    page.locator("#prompt textarea").fill("")
    page.locator("#run-btn").click()
    page.wait_for_function("document.querySelector('#status').innerText.startsWith('Not run: the prompt is empty')")
    page.wait_for_timeout(1000)
    assert page.locator("#lane-left").inner_text() == lane and page.locator(DONE.format("left")).count() == 1
    assert page.locator("#cards").inner_text().strip()
    page.locator("#replay-btn").click()
    page.wait_for_function("document.querySelector('#status').innerText.includes('Replayed')", timeout=30_000)
    page.screenshot(path=str(OUT / "app_refused_keeps_run.png"), full_page=True)


@pytest.mark.parametrize(
    "elem_id, value, message",
    [
        ("tau", "1.5", "τ (MTAD threshold) must be a number from 0 to 1; got 1.5"),
        ("beams", "0", "beams W must be an integer from 1 to 16; got 0"),
        ("beams", "", "beams W is empty: give an integer from 1 to 16"),
        ("seed", "-5", "seed must be an integer from 0 to 2147483647; got -5"),
        ("num-drafts", "9", "drafts m must be an integer from 1 to 8; got 9"),
        ("tau2", "-1", "τ2 (BiLD rollback, nats) must be a number from 0 to 10; got -1"),
    ],
)
def test_out_of_range_value_is_refused_by_name_not_clamped(page, elem_id, value, message):
    page.get_by_text("Sampling").click()
    page.get_by_text("Other decoders (Spectr, SpecInfer, BiLD)").click()
    box = page.locator(f"#{elem_id} input[type=number]")
    type_number(page, box, value)
    page.locator("#run-btn").click()
    page.wait_for_function(f"document.querySelector('#message').innerText.includes({message!r})", timeout=30_000)
    assert box.input_value() == value  # what the visitor typed is still there, not pulled into range
    assert page.locator("#status").inner_text().startswith("Not run:")
    assert page.locator("#lane-left .tok").count() == 0  # nothing ran
    if elem_id == "tau":
        page.screenshot(path=str(OUT / "app_out_of_range.png"))


def pick(page, elem_id: str, label: str) -> None:
    """Choose ``label`` in a dropdown, as a visitor does."""
    page.locator(f"#{elem_id} input").click()
    page.locator(f"#{elem_id}").get_by_role("option", name=label, exact=True).click()


def test_visitor_races_two_other_decoders(page):
    """Spectr against MTAD: titled lanes before the run, both lanes run, the panel lists Spectr's candidates."""
    pick(page, "left-method", "Spectr")
    page.wait_for_selector('#lane-left .mtad-lane[data-method="spectr"]', timeout=30_000)  # retitled before Run
    assert "Spectr" in page.locator("#lane-left .lane-title").inner_text()
    page.get_by_text("Other decoders (Spectr, SpecInfer, BiLD)").click()
    set_number(page, "num-drafts", 3)
    set_number(page, "max-new", 24)
    run_prompt(page, "abc def abc bad")
    assert page.locator('#lane-left .mtad-lane[data-method="spectr"]').count() == 1
    assert page.locator('#lane-right .mtad-lane[data-method="mtad"]').count() == 1
    assert "m = 3" in page.locator("#lane-left .lane-note").inner_text()
    page.get_by_label("Spectr", exact=True).check()  # the verification panel offers the raced decoders
    page.wait_for_function("document.querySelector('#v-panel').innerText.includes('All 3 candidates')")
    assert page.locator("#v-panel tr.beam-chosen").count() == 1
    page.locator("#v-panel").scroll_into_view_if_needed()
    page.screenshot(path=str(OUT / "app_spectr_race.png"), full_page=True)

    # the same decoder twice is refused by name, and the lanes keep their titles
    pick(page, "right-method", "Spectr")
    page.locator("#run-btn").click()
    page.wait_for_function(
        "document.querySelector('#message').innerText.includes('pick two different decoders')", timeout=30_000
    )
    assert page.locator("#status").inner_text().startswith("Not run:")


def test_script_prompt_shows_as_text(page):
    set_number(page, "max-new", 6)
    evil = "<script>window.__pwned = 1</script><b id='bold'>bad</b> abc"
    run_prompt(page, evil)
    lane = page.locator("#lane-left .lane-body")
    assert "<script>window.__pwned = 1</script>" in lane.inner_text()
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#lane-left #bold").count() == 0


def test_dark_mode_screenshot(browser, server):
    OUT.mkdir(exist_ok=True)
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000}, color_scheme="dark")
    pg = ctx.new_page()
    pg.goto(server["url"] + "?__theme=dark")
    set_number(pg, "max-new", 24)
    run_prompt(pg, "bad cafe")
    pg.wait_for_selector("#plot-tokens .js-plotly-plot .main-svg", timeout=30_000)
    pg.screenshot(path=str(OUT / "app_dark.png"), full_page=True)
    ctx.close()


def stop_recorder(monkeypatch):
    """Record when Stop sets a session's flag and when the (endless) decoder yields each step."""
    from mtad.ui import runner
    from mtad.ui.state import PAGE

    times: dict[str, list[float]] = {"stop": [], "steps": []}
    real_stop = PAGE.cancels.stop

    def stop(session):
        times["stop"].append(time.perf_counter())
        return real_stop(session)

    def decode(pair, prompt_ids, settings):
        for step in endless_decode(pair, prompt_ids, settings):
            times["steps"].append(time.perf_counter())
            yield step

    monkeypatch.setattr(PAGE.cancels, "stop", stop)
    monkeypatch.setattr(runner, "decode", decode)
    return times


def test_stop_during_a_long_run_ends_it_within_one_iteration_and_says_so(page, monkeypatch):
    from mtad.ui import runner

    times = stop_recorder(monkeypatch)  # one token per 20 ms, never EOS: only Stop ends it
    set_number(page, "max-new", 200)
    page.locator("#prompt textarea").fill("ab")
    page.locator("#run-btn").click()
    page.wait_for_function(  # a long lane, still growing, re-rendered while we click
        "parseInt(document.querySelector('#lane-left .lane-count')?.innerText) >= 300", timeout=120_000, polling=200
    )
    assert page.locator("#lane-left .lane-elided").count() == 1  # a live lane draws only its last iterations
    clicked = time.perf_counter()
    page.locator("#stop-btn").click()
    page.wait_for_function("document.querySelector('#message').innerText.includes('Stop pressed')", timeout=30_000)
    said = time.perf_counter() - clicked
    page.wait_for_selector('#lane-left .mtad-lane[data-state="stopped"]', timeout=60_000)
    page.wait_for_selector('#lane-right .mtad-lane[data-state="stopped"]', timeout=60_000)
    status = page.locator("#status").inner_text()
    assert "· stopped by Stop (Speculative decoding stopped after" in status
    assert "Stop pressed" in message_text(page)  # the run's last update left the message in place
    assert page.locator("#lane-right .tok").count() == 0  # the lane after a Stop never starts
    # the decoder yielded at most one more step after the flag was set: the one in progress
    [t_stop] = times["stop"]
    assert sum(t > t_stop for t in times["steps"]) <= 1, "the run went on for more than one iteration"
    assert said < 3.0, f"the page took {said:.1f} s to show that Stop was pressed"
    # once stopped, the whole lane is drawn
    page.wait_for_function("document.querySelectorAll('#lane-left .tok').length >= 300")
    assert page.locator("#lane-left .lane-elided").count() == 0
    # the verification panel shows the last lane that has steps, not the empty MTAD lane
    page.wait_for_function(
        "document.querySelector('#v-panel').innerText.includes('Speculative decoding · iteration 1')"
    )
    assert page.locator("#v-lane input[value=sd]").is_checked()
    for _ in range(100):  # the worker releases the device right after its last event
        if not runner.DEVICE_LOCK.locked():
            break
        page.wait_for_timeout(50)
    assert not runner.DEVICE_LOCK.locked()


def open_page(browser, server):
    """A second visitor's page, ready to press Run."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = ctx.new_page()
    pg.goto(server["url"])
    pg.wait_for_selector("#run-btn", timeout=60_000)
    return ctx, pg


def start_endless_run(page, monkeypatch) -> None:
    """The first visitor's run holds the device until Stop (its decoder never reaches EOS)."""
    from mtad.ui import runner

    monkeypatch.setattr(runner, "decode", endless_decode)
    set_number(page, "max-new", 200)
    page.locator("#prompt textarea").fill("ab")
    page.locator("#run-btn").click()
    page.wait_for_selector("#lane-left .tok", timeout=60_000)


def queue_api_job(server):
    """An API client's ``/run`` (8 tokens), queued behind the running one."""
    from test_app_client import args

    client = gradio_client.Client(server["url"], verbose=False)
    job = client.submit(*args(max_new=8), api_name="/run")
    queue = server["app"].demo._queue
    deadline = time.time() + 30
    while time.time() < deadline and not queue.event_queue_per_concurrency_id["device"].queue:
        time.sleep(0.05)
    assert queue.event_queue_per_concurrency_id["device"].queue, "the API job never reached the queue"
    return job


def test_a_waiting_visitor_sees_their_place_in_the_queue(browser, server, page, monkeypatch):
    """Positions count every queued job, an API client's too; Stop while waiting clears the place at once."""
    start_endless_run(page, monkeypatch)
    api_job = queue_api_job(server)  # number 2 in line, from the API

    ctx, second = open_page(browser, server)
    set_number(second, "max-new", 8)
    second.locator("#prompt textarea").fill("abc")
    second.locator("#run-btn").click()
    second.wait_for_function(
        "document.querySelector('#lane-left').innerText.includes('you are number 3')", timeout=30_000
    )
    lane, status = second.locator("#lane-left"), second.locator("#status")
    assert "you are number 3 of 3 (2 runs ahead of you, 1 of them from the API" in lane.inner_text()
    assert "you are number 3 of 3" in status.inner_text()
    assert "you are number 3 of 3" in second.locator("#lane-ar").inner_text()  # the AR lane waits too
    assert status.bounding_box()["height"] > 10 and status.is_visible()  # seen, not just in the DOM
    assert not re.search(r"\d/\d|ETA|estimat", status.inner_text())  # no made-up wait estimate
    before = status.inner_text()
    second.wait_for_function(f"document.querySelector('#status').innerText !== {before!r}", timeout=10_000)
    assert "has been going for" in status.inner_text()  # the ticker keeps it current
    second.screenshot(path=str(OUT / "app_queued.png"))

    # a third visitor counts the second one; once the second stops waiting, it no longer does
    ctx3, third = open_page(browser, server)
    set_number(third, "max-new", 8)
    third.locator("#prompt textarea").fill("abc")
    third.locator("#run-btn").click()
    third.wait_for_function("document.querySelector('#status').innerText.includes('number 4 of 4')", timeout=30_000)

    second.locator("#stop-btn").click()
    second.wait_for_function("document.querySelector('#status').innerText.includes('Stopped while waiting')")
    second.wait_for_timeout(2500)  # the ticker had time to put a stale position back, if it still ran
    assert "number" not in status.inner_text() and "number" not in lane.inner_text()
    assert second.locator('.mtad-lane[data-state="line"]').count() == 0
    assert "number" not in second.locator("#lane-ar").inner_text()
    assert "Stopped while waiting in the queue" in second.locator("#message").inner_text()
    second.screenshot(path=str(OUT / "app_stopped_waiting.png"))
    third.wait_for_function("document.querySelector('#status').innerText.includes('number 3 of 3')", timeout=10_000)

    # the first run ends (a background tab paints no frames, so Playwright's click would wait forever
    # for it to settle: send the click event itself); the API job, then the third run start by themselves
    monkeypatch.undo()  # the waiting runs decode for real (the running one keeps its endless decoder)
    page.locator("#stop-btn").dispatch_event("click")
    assert api_job.result(timeout=120)[-1]["lanes"]["mtad"]["state"] == "done"
    third.wait_for_selector(DONE.format("right"), timeout=120_000)
    assert "number" not in third.locator("#status").inner_text()
    assert third.locator('.mtad-lane[data-state="line"]').count() == 0
    assert second.locator("#lane-left .tok, #lane-right .tok").count() == 0  # stopped while waiting: never ran
    ctx.close()
    ctx3.close()


def test_a_full_queue_says_so_and_leaves_nothing_waiting(browser, server, page, monkeypatch):
    """Gradio refuses a job when its queue is full: the page says so, and no waiting notice stays behind."""
    queue = server["app"].demo._queue
    start_endless_run(page, monkeypatch)
    monkeypatch.setattr(queue, "max_size", 1)
    api_job = queue_api_job(server)  # the one place in line is taken

    ctx, second = open_page(browser, server)
    second.locator("#prompt textarea").fill("abc")
    second.locator("#run-btn").click()
    second.wait_for_function("document.querySelector('#message').innerText.includes('the queue is full')")
    second.wait_for_timeout(5000)  # past the grace a Run has to reach the queue, and past Gradio's toast
    status = second.locator("#status").inner_text()
    lanes = second.locator("#lane-left").inner_text() + second.locator("#lane-right").inner_text()
    assert "Not run: the queue is full (1 run waiting, the most this server keeps)" in status
    assert "nothing is waiting for you" in status
    for text in (status, lanes):
        assert "starts by itself" not in text and "number" not in text
    assert second.locator('.mtad-lane[data-state="line"]').count() == 0
    assert "the queue is full" in second.locator("#message").inner_text()  # stays, unlike a toast
    second.screenshot(path=str(OUT / "app_queue_full.png"), full_page=True)

    monkeypatch.undo()
    page.locator("#stop-btn").dispatch_event("click")
    assert api_job.result(timeout=120)[-1]["lanes"]["mtad"]["state"] == "done"
    # with room in the queue again, the refused visitor's next Run goes through
    set_number(second, "max-new", 8)
    second.locator("#run-btn").click()
    second.wait_for_selector(DONE.format("right"), timeout=120_000)
    assert "queue is full" not in second.locator("#status").inner_text()
    ctx.close()


def test_closing_the_tab_stops_the_run(browser, server, monkeypatch):
    from mtad.ui import runner

    monkeypatch.setattr(runner, "decode", endless_decode)
    monkeypatch.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.5")
    ctx = browser.new_context()
    pg = ctx.new_page()
    pg.goto(server["url"])
    pg.locator("#prompt textarea").fill("ab")
    pg.locator("#run-btn").click()
    pg.wait_for_selector("#lane-left .tok", timeout=60_000)
    runner.HISTORY.clear()
    ctx.close()
    deadline = time.time() + 30
    while time.time() < deadline and not (runner.HISTORY and not runner.DEVICE_LOCK.locked()):
        time.sleep(0.1)
    assert [(m, s) for m, s, _ in runner.HISTORY] == [("sd", "stopped")]
    assert not runner.DEVICE_LOCK.locked()


def test_first_visit_shows_a_recorded_race_and_the_ar_lane(page):
    """Before anyone presses Run: a race recorded on a named device, and the AR lane in the page (on)."""
    import json

    recorded = json.loads((Path(__file__).resolve().parent.parent / "assets" / "race.json").read_text())
    shutil.rmtree(Path(os.environ["MTAD_CACHE"]) / "races", ignore_errors=True)  # no race run on this device yet
    page.reload()
    race = page.locator("#race .mtad-race")
    race.wait_for(timeout=30_000)
    assert recorded["device"] in race.inner_text() and recorded["pair"] in race.inner_text()
    assert f"{recorded['dtype']}, {recorded['engine']} engine" in race.inner_text()
    rows = page.locator("#race .race-row")
    assert [rows.nth(i).get_attribute("data-method") for i in range(rows.count())] == ["sd", "mtad", "ar"]
    bar = page.evaluate(
        "() => { const s = getComputedStyle(document.querySelector('#race .race-bar'));"
        " return [s.animationName, s.animationDuration, s.animationTimingFunction]; }"
    )
    assert bar[0] == "mtad-race, mtad-rest" and bar[1].endswith("s") and bar[2].startswith("linear(")  # plays itself
    assert "This server decodes on CPU" in race.inner_text()  # the recorded device, contrasted with this one
    for lane in recorded["lanes"]:
        if lane["times_ar"] is not None:
            assert f"{lane['times_ar']:.2f}× AR" in race.inner_text()
    assert page.locator("#with-ar input").is_checked()
    ar = page.locator('#lane-ar .mtad-lane[data-method="ar"]')
    assert ar.is_visible() and "Autoregressive" in ar.inner_text()
    page.wait_for_timeout(1000)
    page.screenshot(path=str(OUT / "app_first_visit.png"))


def test_sampled_spectr_and_bild_panels_teacher_mode_link_and_reply_view(browser, server, page):
    """Spectr and BiLD raced with sampling: each panel shows its own rule's figures; previous / next walk the
    iterations; the link reopens the page with the run's inputs and opens the panel at its iteration."""
    pick(page, "left-method", "Spectr")
    pick(page, "right-method", "BiLD")
    page.get_by_text("Other decoders (Spectr, SpecInfer, BiLD)").click()
    set_number(page, "num-drafts", 3)
    set_number(page, "tau1", 0)  # the tiny pair's little model is never sure: with τ1 = 0 it drafts every time
    set_number(page, "max-new", 24)
    page.get_by_text("Sampling").click()
    set_number(page, "seed", 11)
    run_prompt(page, "abc def abc bad")
    page.wait_for_selector('#lane-ar .mtad-lane[data-state="done"]', timeout=120_000)

    # the cards and the race: each lane against the same run's AR lane
    cards = page.locator("#cards")
    page.wait_for_function("document.querySelector('#cards').innerText.includes('× AR')")
    assert re.search(r"\d\.\d\d×", cards.inner_text())
    page.wait_for_function("document.querySelector('#race').innerText.includes(\"This run's race\")")
    assert page.locator("#race .race-row").count() == 3

    panel = page.locator("#v-panel")
    page.get_by_label("Spectr", exact=True).check()
    page.wait_for_function("document.querySelector('#v-panel').innerText.includes('min(1, p/(ρq))')")
    text = panel.inner_text()
    assert "ρ" in text and "(greedy)" not in text and "u_i" not in text and "warped distributions" in text
    page.wait_for_function(
        "document.querySelector('#v-plot .gtitle')?.textContent.startsWith(\"Spectr: each try's acceptance\")",
        timeout=30_000,
    )
    panel.scroll_into_view_if_needed()
    page.screenshot(path=str(OUT / "app_spectr_panel.png"), full_page=True)

    # previous / next
    page.locator("#v-next").click()
    page.wait_for_function("document.querySelector('#v-panel').innerText.includes('Spectr · iteration 2 of')")
    page.locator("#v-next").click()
    page.wait_for_function("document.querySelector('#v-panel').innerText.includes('Spectr · iteration 3 of')")
    page.locator("#v-prev").click()
    page.wait_for_function("document.querySelector('#v-panel').innerText.includes('Spectr · iteration 2 of')")
    page.wait_for_function("document.querySelector('#v-link a')?.href.includes('it=2')")
    href = page.locator("#v-link a").get_attribute("href")
    for part in ("left=spectr", "right=bild", "m=3", "tau1=0.0", "max_new=24", "seed=11", "lane=spectr", "ar=1"):
        assert part in href, (part, href)

    page.get_by_label("BiLD", exact=True).check()
    page.wait_for_function("document.querySelector('#v-panel').innerText.includes('little model')")
    text = panel.inner_text()
    assert re.search(r"τ1 = 0 \(fallback", text) and re.search(r"τ2 = 2 nats \(rollback", text)
    assert re.search(r"\d\.\d\d\d ≥ τ1", text) and "(greedy)" not in text
    page.wait_for_function(
        "document.querySelector('#v-plot .gtitle')?.textContent.startsWith('BiLD: each draft token')",
        timeout=30_000,
    )
    panel.scroll_into_view_if_needed()
    page.screenshot(path=str(OUT / "app_bild_panel.png"), full_page=True)

    # reading view: the left lane's prompt and rejected drafts go, the right lane keeps its colours
    rejected = page.locator("#lane-left .tok-rej")
    assert rejected.count() > 0 and rejected.first.is_visible()
    page.locator("#reply-left input").check()
    assert not rejected.first.is_visible() and not page.locator("#lane-left .tok-prompt").is_visible()
    assert page.locator("#lane-right .tok-prompt").is_visible()
    kept = page.locator("#lane-left .tok-acc").first
    gap = kept.evaluate("e => [getComputedStyle(e).paddingLeft, getComputedStyle(e).paddingRight]")
    assert gap == ["0px", "0px"]  # no gap inside a word cut into tokens ("set Up")
    body = page.locator("#lane-left .lane-body")
    assert body.evaluate("e => getComputedStyle(e).fontFamily") == page.locator("#lane-right .lane-body").evaluate(
        "e => getComputedStyle(e).fontFamily"
    )  # the lane's monospace: code stays code
    page.locator("#lane-left").scroll_into_view_if_needed()
    page.screenshot(path=str(OUT / "app_reply_only.png"))

    # the link: a new page with the run's inputs; Run there opens the panel at iteration 2 of Spectr
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    linked = ctx.new_page()
    linked.goto(server["url"] + href)
    linked.wait_for_selector("#run-btn", timeout=60_000)
    linked.wait_for_function("document.querySelector('#message').innerText.includes('Opened from a link')")
    assert linked.locator("#prompt textarea").input_value() == "abc def abc bad"
    assert linked.locator("#left-method input").input_value() == "Spectr"
    assert linked.locator("#right-method input").input_value() == "BiLD"
    assert linked.locator("#max-new input[type=number]").input_value() == "24"
    linked.get_by_text("Sampling").click()
    linked.get_by_text("Other decoders (Spectr, SpecInfer, BiLD)").click()
    assert linked.locator("#seed input[type=number]").input_value() == "11"
    assert linked.locator("#num-drafts input[type=number]").input_value() == "3"
    assert linked.locator("#tau1 input[type=number]").input_value() == "0"
    linked.locator("#run-btn").click()
    linked.wait_for_selector('#lane-ar .mtad-lane[data-state="done"]', timeout=120_000)
    linked.wait_for_function("document.querySelector('#v-panel').innerText.includes('Spectr · iteration 2 of')")
    same = [page.locator(f"#lane-{s} .lane-body").inner_text() for s in ("right",)]
    assert [linked.locator("#lane-right .lane-body").inner_text()] == same  # same seed, same tokens
    ctx.close()


def test_the_page_reads_at_400_px(browser, server):
    """A phone-width page: the panel's table and chart do not overlap, nothing runs off the right edge."""
    ctx = browser.new_context(viewport={"width": 400, "height": 900})
    pg = ctx.new_page()
    pg.goto(server["url"])
    pg.wait_for_selector("#run-btn", timeout=60_000)
    pg.get_by_text("Sampling").click()
    pg.get_by_label("greedy (argmax everywhere)").check()
    set_number(pg, "max-new", 16)
    run_prompt(pg, "abc def abc bad")
    pg.wait_for_selector("#v-panel .v-eta", timeout=60_000)
    pg.wait_for_selector("#v-plot .js-plotly-plot .main-svg", timeout=30_000)
    table, plot = pg.locator("#v-panel").bounding_box(), pg.locator("#v-plot").bounding_box()
    assert table["y"] + table["height"] <= plot["y"] + 1, (table, plot)  # the chart sits below the table
    assert table["x"] + table["width"] <= 400 + 1 and plot["x"] + plot["width"] <= 400 + 1
    assert pg.evaluate("document.documentElement.scrollWidth") <= 400  # no sideways scrolling of the page
    for box in ("#cards", "#race", "#lane-left", "#lane-right"):
        b = pg.locator(box).bounding_box()
        assert b["x"] >= 0 and b["x"] + b["width"] <= 400 + 1, (box, b)
    pg.locator("#v-panel").scroll_into_view_if_needed()
    pg.screenshot(path=str(OUT / "app_400px_panel.png"))
    pg.screenshot(path=str(OUT / "app_400px.png"), full_page=True)
    ctx.close()


def test_a_looping_lane_s_card_warns_next_to_its_perplexity(page, monkeypatch):
    """A decoder that repeats a four-token phrase: its card says the text loops, beside a low perplexity."""
    from mtad.events import Step
    from mtad.ui import runner

    def looping(pair, prompt_ids, settings):
        for i in range(20):
            yield Step(
                index=i,
                method=settings.method,
                appended_ids=[[5, 6, 7, 8][i % 4]],
                from_target=[True],
                target_logprobs=[-0.05],
                target_calls=1,
                target_seconds=0.001,
            )

    monkeypatch.setattr(runner, "decode", looping)
    run_prompt(page, "abc")
    page.wait_for_selector('#lane-ar .mtad-lane[data-state="done"]', timeout=60_000)
    card = page.locator('#cards .mtad-card[data-method="mtad"]')
    card.locator(".card-loop").wait_for(timeout=30_000)
    # 20 tokens, 17 four-grams, the last 13 repeat the first four: 76 %
    assert "This text repeats itself (76% of its 4-grams)" in card.locator(".card-loop").inner_text()
    assert card.locator(".card-loop").is_visible()
    cells = card.locator(".card-cell")
    values = {
        cells.nth(i).locator(".card-label").inner_text(): cells.nth(i).locator(".card-value").inner_text()
        for i in range(cells.count())
    }
    assert values["repeated 4-grams"] == "76%" and values["perplexity"] == "1.05"  # exp(0.05)
    assert page.locator("#cards .card-loop").count() == 3  # every lane looped, every card says so
    assert card.locator(".card-loop-tag").inner_text() == "the text loops (see below)"
    card.scroll_into_view_if_needed()
    page.screenshot(path=str(OUT / "app_loop_warning.png"))


def test_fastest_button_sets_gamma_and_beams_it_names(page):
    page.locator("#fastest-btn").click()
    page.wait_for_function(
        "document.querySelector('#message').innerText.includes('Fastest on this device')", timeout=120_000
    )
    text = page.locator("#message").inner_text()
    chosen = re.search(r"MTAD with γ (\d+) and W (\d+) \(([\d.]+)× AR\)", text)
    assert chosen, text
    page.wait_for_function(
        "([g, w]) => document.querySelector('#gamma input').value === g && document.querySelector('#beams input').value === w",
        arg=[chosen[1], chosen[2]],
        timeout=10_000,
    )
    page.locator("#message").scroll_into_view_if_needed()
    assert "this device's fastest" in page.locator("#defaults-note").inner_text()
    page.screenshot(path=OUT / "fastest.png")
    page.locator("#paper-btn").click()  # one click back to the paper's settings
    page.wait_for_function(
        "document.querySelector('#gamma input').value === '4' && document.querySelector('#beams input').value === '8'",
        timeout=10_000,
    )
    assert "the paper's settings" in page.locator("#defaults-note").inner_text()


def test_after_a_run_the_race_rests_on_its_winner_and_the_panel_names_the_target_s_token(page):
    """At rest the race's bars are as long as each lane's speed against the fastest (one full bar, marked);
    the status says "Running on" while the run goes and "Ran on" after; the panel's verdict names the token
    the target wrote after the accepted drafts, marked as the lanes mark it."""
    set_number(page, "max-new", 24)
    page.locator("#prompt textarea").fill("abc bad cab")
    page.locator("#run-btn").click()
    page.wait_for_function("document.querySelector('#status').innerText.includes('Running on')", timeout=120_000)
    for lane in ("left", "right", "ar"):
        page.wait_for_selector(DONE.format(lane), timeout=120_000)
    page.wait_for_function("document.querySelector('#status').innerText.includes('Ran on')", timeout=60_000)
    assert "Running on" not in page.locator("#status").inner_text()
    page.wait_for_selector("#race .race-winner", timeout=30_000)
    page.wait_for_timeout(16_000)  # the race plays (at most 15 s), then comes to rest
    widths = page.evaluate(
        "() => [...document.querySelectorAll('#race .race-row')].map(r => [r.dataset.method,"
        " r.querySelector('.race-bar').getBoundingClientRect().width,"
        " r.querySelector('.race-track').getBoundingClientRect().width, r.classList.contains('race-winner')])"
    )
    winner = [w for w in widths if w[3]]
    assert len(winner) == 1 and winner[0][1] == pytest.approx(winner[0][2], abs=2), widths
    assert all(bar < track - 2 for _, bar, track, won in widths if not won), widths  # the others rest shorter
    assert page.locator("#race .race-won").is_visible()
    page.locator("#race").scroll_into_view_if_needed()
    page.screenshot(path=str(OUT / "race_at_rest.png"))
    page.wait_for_selector("#v-panel .v-target-token", timeout=30_000)
    token = page.locator("#v-panel .v-verdict .v-target-token").first
    assert token.is_visible() and token.inner_text() != ""
    colour = token.evaluate("e => getComputedStyle(e).backgroundColor")
    lane_colour = page.locator(".tok-tgt").first.evaluate("e => getComputedStyle(e).backgroundColor")
    assert colour == lane_colour, (colour, lane_colour)  # marked as the lanes mark the target's tokens
    page.locator("#v-panel").scroll_into_view_if_needed()
    page.screenshot(path=str(OUT / "panel_target_token.png"))
    # the next visitor's first view: this device's race, without this visitor's prompt
    later = page.context.new_page()
    later.goto(page.url)
    later.wait_for_selector("#race .mtad-race", timeout=60_000)
    later.wait_for_function(
        "document.querySelector('#race').innerText.includes('This device\\'s latest race')", timeout=60_000
    )
    text = later.locator("#race").inner_text()
    assert "abc bad cab" not in text and "a visitor's own (not shown)" in text
    later.close()
