"""The MTJD lane in a real browser (Debian's chromium via Playwright): picked like any decoder, run, and its
verification panel showing the target's beams. The screenshot goes to ``test-output/`` for a person to read."""

from __future__ import annotations

# the page, its server and browser, and the visitor's gestures: one shared set of browser helpers
from test_app_browser import OUT, browser, page, pick, run_prompt, server, set_number  # noqa: F401


def test_a_visitor_races_mtad_against_mtjd_and_reads_the_targets_beams(page):  # noqa: F811
    pick(page, "left-method", "MTJD (reference, slow)")  # against the default right lane, MTAD
    page.wait_for_selector('#lane-left .mtad-lane[data-method="mtjd"]', timeout=30_000)  # retitled before Run
    page.locator("#paper-btn").click()  # the paper's K and W, whatever this device's timings set on opening
    page.wait_for_function(
        "document.querySelector('#gamma input').value === '4' && document.querySelector('#beams input').value === '8'"
    )
    set_number(page, "max-new", 24)
    run_prompt(page, "abc de")  # a prompt after which the target's best beams do not end at once
    lane = page.locator("#lane-left")
    assert "MTJD (reference, slow)" in lane.locator(".lane-title").inner_text()
    assert "K = 4, W = 8" in lane.locator(".lane-note").inner_text() and lane.locator(".tok-acc").count() == 0
    assert lane.locator(".tok-tgt").count() == 24  # every token is the target's own, from its best beams
    assert page.locator('#lane-right .mtad-lane[data-method="mtad"]').count() == 1
    page.get_by_label("MTJD (reference, slow)", exact=True).check()  # the panel offers the MTJD lane
    page.wait_for_function("document.querySelector('#v-panel').innerText.includes(\"The target's beams\")")
    assert page.locator("#v-panel tr.beam-chosen").count() == 1
    assert "joint log p" in page.locator("#v-panel").inner_text()
    page.locator("#v-panel").scroll_into_view_if_needed()
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / "app_mtjd_lane.png"), full_page=True)
