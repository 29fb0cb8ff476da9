"""The web app in a real browser: Debian's chromium driven by Playwright, against a local launch.

Screenshots go to ``test-output/`` (git-ignored) for a person to look at.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed", allow_module_level=True)

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


def set_number(page, elem_id: str, value: object) -> None:
    """Type a value into a slider's / number's box and commit it."""
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")
    box.blur()


def run_prompt(page, prompt: str, timeout: float = 120_000) -> None:
    page.locator("#prompt textarea").fill(prompt)
    page.locator("#run-btn").click()
    page.wait_for_selector(DONE.format("sd"), timeout=timeout)
    page.wait_for_selector(DONE.format("mtad"), timeout=timeout)


def test_run_both_lanes_verify_and_replay(page):
    assert "decodes on" in page.content()
    page.get_by_text("Sampling").click()
    page.get_by_label("greedy (argmax everywhere)").check()
    set_number(page, "max-new", 40)
    run_prompt(page, "abc def abc bad")

    # coloured accepted / target tokens and struck-through rejected ones, with p and q on hover
    lanes = page.locator("#lane-sd, #lane-mtad")
    for cls in ("tok-acc", "tok-tgt", "tok-rej"):
        assert lanes.locator(f".{cls}").count() > 0, cls
    styles = page.evaluate(
        """() => ['tok-acc', 'tok-tgt', 'tok-rej'].map(c => {
            const s = getComputedStyle(document.querySelector('#lane-mtad .' + c) || document.querySelector('.' + c));
            return [s.backgroundColor, s.textDecorationLine];
        })"""
    )
    assert len({bg for bg, _ in styles}) == 3, styles
    assert "line-through" in styles[2][1] and "line-through" not in styles[0][1]
    title = page.locator("#lane-mtad .tok-acc, #lane-sd .tok-acc").first.get_attribute("title")
    assert re.search(r"p [\d.e-]+ · q [\d.e-]+", title), title

    # the plots are drawn
    for plot in ("plot-tokens", "plot-accepted"):
        page.wait_for_selector(f"#{plot} .js-plotly-plot .main-svg", timeout=30_000)
        assert page.locator(f"#{plot} .js-plotly-plot .trace").count() > 0
    assert "n/a" in page.locator("#cards").inner_text()
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
    page.wait_for_selector("#v-plot .js-plotly-plot .trace", timeout=30_000)
    page.locator("#v-panel").scroll_into_view_if_needed()
    page.screenshot(path=str(OUT / "app_verify.png"), full_page=True)

    # the SD lane's iterations show p, q and the verdict
    page.get_by_label("Speculative decoding").check()
    page.wait_for_function("document.querySelector('#v-panel').innerText.includes('SD accepts')", timeout=30_000)

    # Replay re-animates both lanes on one time axis
    page.locator("#replay-btn").click()
    page.wait_for_function("document.querySelector('#status').innerText.includes('Replay on one time axis')")
    page.wait_for_selector(DONE.format("sd"), timeout=60_000)
    page.wait_for_selector(DONE.format("mtad"), timeout=60_000)


def test_empty_prompt_shows_the_error(page):
    page.locator("#prompt textarea").fill("   ")
    page.locator("#run-btn").click()
    toast = page.get_by_text("the prompt is empty").first
    toast.wait_for(state="visible", timeout=30_000)
    page.wait_for_timeout(600)  # let the toast finish sliding in
    assert page.locator('#lane-sd .mtad-lane[data-state="running"]').count() == 0
    page.screenshot(path=str(OUT / "app_empty_prompt.png"))


def test_script_prompt_shows_as_text(page):
    set_number(page, "max-new", 6)
    evil = "<script>window.__pwned = 1</script><b id='bold'>bad</b> abc"
    run_prompt(page, evil)
    lane = page.locator("#lane-sd .lane-body")
    assert "<script>window.__pwned = 1</script>" in lane.inner_text()
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#lane-sd #bold").count() == 0


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


def test_stop_ends_the_run_at_the_next_iteration(page, monkeypatch):
    from mtad.ui import runner

    monkeypatch.setattr(runner, "decode", endless_decode)  # never reaches EOS: only Stop ends it
    set_number(page, "max-new", 200)
    page.locator("#prompt textarea").fill("ab")
    page.locator("#run-btn").click()
    page.wait_for_selector("#lane-sd .tok", timeout=60_000)
    page.locator("#stop-btn").click()
    page.wait_for_selector('#lane-sd .mtad-lane[data-state="stopped"]', timeout=60_000)
    page.wait_for_selector('#lane-mtad .mtad-lane[data-state="stopped"]', timeout=60_000)
    assert "· stopped" in page.locator("#status").inner_text()
    assert page.locator("#lane-mtad .tok").count() == 0  # the lane after a Stop never starts
    for _ in range(100):  # the worker releases the device right after its last event
        if not runner.DEVICE_LOCK.locked():
            break
        page.wait_for_timeout(50)
    assert not runner.DEVICE_LOCK.locked()


def test_closing_the_tab_stops_the_run(browser, server, monkeypatch):
    from mtad.ui import runner

    monkeypatch.setattr(runner, "decode", endless_decode)
    monkeypatch.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.5")
    ctx = browser.new_context()
    pg = ctx.new_page()
    pg.goto(server["url"])
    pg.locator("#prompt textarea").fill("ab")
    pg.locator("#run-btn").click()
    pg.wait_for_selector("#lane-sd .tok", timeout=60_000)
    runner.HISTORY.clear()
    ctx.close()
    deadline = time.time() + 30
    while time.time() < deadline and not (runner.HISTORY and not runner.DEVICE_LOCK.locked()):
        time.sleep(0.1)
    assert [(m, s) for m, s, _ in runner.HISTORY] == [("sd", "stopped")]
    assert not runner.DEVICE_LOCK.locked()
