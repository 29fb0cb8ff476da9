"""Refresh the README's screenshots of the web page: ``python scripts/screenshots.py``.

Serves ``app.py`` on the default pair (``smollm2`` where its wheel is installed, else the embedded one;
``MTAD_PAIR`` overrides) and drives Debian's chromium with Playwright through a first visit, a run, the
verification panel and a second visitor waiting in the queue; the PNGs go to ``docs/screenshots/``. Needs no network: it waits
for page elements, never for the network to go idle (web fonts never load offline).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "screenshots"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
VIEW = {"width": 1400, "height": 1000}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_number(page: Page, elem_id: str, value: object) -> None:
    """Type a number and commit it, again until it stays (in the first second after the page opens,
    Gradio was seen putting a freshly typed box back to its default)."""
    box = page.locator(f"#{elem_id} input[type=number]")
    for _ in range(10):
        box.fill(str(value))
        box.press("Enter")
        box.blur()
        page.wait_for_timeout(300)
        if box.input_value() == str(value):
            return
    raise RuntimeError(f"#{elem_id} kept {box.input_value()!r}, not {value!r}")


def open_iteration(page: Page, it: int) -> None:
    """Show iteration ``it`` in the verification panel and wait until the panel has redrawn it."""
    set_number(page, "v-iter", it)
    page.wait_for_function(
        f"document.querySelector('#v-panel').innerText.includes('iteration {it} of')", timeout=30_000
    )


def show(page: Page, selector: str, path: Path) -> None:
    """Scroll ``selector`` to the top of the window and save what a visitor sees there."""
    page.locator(selector).evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(400)
    page.screenshot(path=str(path))
    print(f"wrote {path.relative_to(ROOT)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new", type=int, default=64, help="new tokens for the shown run")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    if not Path(args.chromium).exists():
        print("Debian's chromium is needed: apt-get install chromium", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    import app

    port = free_port()
    app.main(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    url = f"http://127.0.0.1:{port}/"
    OUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        page = browser.new_context(viewport=VIEW).new_page()
        page.goto(url)
        page.wait_for_selector("#run-btn", timeout=120_000)
        page.wait_for_selector("#race .race-row", timeout=60_000)
        page.wait_for_timeout(3000)  # the recorded race plays for a few seconds
        page.screenshot(path=str(OUT / "first_visit.png"))
        print("wrote docs/screenshots/first_visit.png")

        set_number(page, "max-new", args.max_new)
        page.locator("#run-btn").click()
        for lane in ("left", "right", "ar"):
            page.wait_for_selector(f'#lane-{lane} .mtad-lane[data-state="done"]', timeout=600_000)
        page.wait_for_selector("#plot-tokens .js-plotly-plot .main-svg", timeout=60_000)
        page.wait_for_function("document.querySelector('#race').innerText.includes(\"This run's race\")")
        page.wait_for_timeout(3000)
        show(page, "#status", OUT / "run.png")

        page.wait_for_selector("#v-panel .v-eta", timeout=60_000)
        iterations = int(page.locator("#v-iter input[type=number]").get_attribute("max") or 1)
        # prefer an iteration whose table shows a failing prefix kept inside a longer passing one, else
        # the first with both a passing and a failing prefix
        both = None
        for it in range(1, min(iterations, 40) + 1):
            open_iteration(page, it)
            if page.locator("#v-panel .v-kept-note").count():
                break
            if both is None and page.locator("#v-panel .v-pass").count() and page.locator("#v-panel .v-fail").count():
                both = it
        else:
            if both is not None:
                open_iteration(page, both)
        show(page, "#v-lane", OUT / "verify.png")

        # Spectr against BiLD, sampled: each panel in its own rule's terms
        page.evaluate("window.scrollTo(0, 0)")
        for elem_id, label in (("left-method", "Spectr"), ("right-method", "BiLD")):
            page.locator(f"#{elem_id} input").click()
            page.locator(f"#{elem_id}").get_by_role("option", name=label, exact=True).click()
        set_number(page, "max-new", 32)
        page.locator("#run-btn").click()
        page.wait_for_selector('#lane-ar .mtad-lane[data-state="done"]', timeout=600_000)
        page.get_by_label("Spectr", exact=True).check()
        page.wait_for_function("document.querySelector('#v-panel').innerText.includes('min(1, p/(ρq))')")
        page.wait_for_timeout(1000)
        show(page, "#v-lane", OUT / "spectr.png")
        page.get_by_label("BiLD", exact=True).check()
        page.wait_for_function("document.querySelector('#v-panel').innerText.includes('little model')")
        for it in range(2, 21):  # an iteration where the little model drafted, if there is one
            if "≥ τ1" in page.locator("#v-panel").inner_text():
                break
            open_iteration(page, it)
        page.wait_for_timeout(1000)
        show(page, "#v-lane", OUT / "bild.png")
        narrow = browser.new_context(viewport={"width": 400, "height": 860}).new_page()
        narrow.goto(url)
        narrow.wait_for_selector("#race .race-row", timeout=120_000)
        show(narrow, "#status", OUT / "narrow.png")
        narrow.context.close()

        # a second visitor presses Run while the first visitor's long run holds the device
        page.evaluate("window.scrollTo(0, 0)")
        set_number(page, "max-new", 512)
        page.locator("#run-btn").click()
        page.wait_for_selector('#lane-left .mtad-lane[data-state="running"]', timeout=120_000)
        second = browser.new_context(viewport=VIEW).new_page()
        second.goto(url)
        second.wait_for_selector("#run-btn", timeout=120_000)
        second.locator("#run-btn").click()
        second.wait_for_selector('#lane-left .mtad-lane[data-state="line"]', timeout=60_000)
        second.wait_for_timeout(2500)
        show(second, "#run-btn", OUT / "queued.png")
        page.locator("#stop-btn").dispatch_event("click")
        second.wait_for_selector('#lane-right .mtad-lane[data-state="done"]', timeout=600_000)
        browser.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
