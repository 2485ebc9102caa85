"""A saved profile in a real browser (Debian's chromium, async Playwright) against a live
``manage.py serve``: the kernel table sorts, the step chart and the flame graph draw, frames
are named on hover, the kernels open in the timeline, and two profiles compare.

Screenshots go to ``var/screenshots/profile*.png``.
"""
from __future__ import annotations

import httpx
import pytest

from tests.browser.conftest import SHOTS, LiveServer, contrast

pytestmark = pytest.mark.slow

SERVE_MODELS = ("demo",)  # every request here is the demo's


def take_profile(http: httpx.Client, note: str, max_tokens: int) -> dict:
    started = http.post("/debug/profile_start", json={"model": "demo", "stack_sampling": True})
    assert started.status_code == 200, started.text
    for i in range(3):
        http.post("/v1/completions", json={"model": "demo", "prompt": f"profile page {i}", "max_tokens": max_tokens,
                                           "debug_config": {"ignore_eos": True}})
    stopped = http.post("/debug/profile_stop", json={"model": "demo", "note": note})
    assert stopped.status_code == 200, stopped.text
    return stopped.json()


async def test_a_profile_page_sorts_draws_and_compares(page, dashboard_server: LiveServer) -> None:
    base = dashboard_server.base
    with httpx.Client(base_url=base, timeout=60) as http:
        first = take_profile(http, '<b>before</b> "><img src=x onerror="window.__xss=1">', 24)
        second = take_profile(http, "after", 12)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    await page.goto(f"{base}{second['url']}")
    await page.wait_for_function("window.profilePage && window.profilePage.ready === true", timeout=30000)

    # Sort by total time: largest first, then the other way round.
    header = page.locator("#kernel-table thead th", has_text="total")
    await header.locator("button").click()
    totals = await page.eval_on_selector_all("#kernel-table tbody tr td:nth-child(3)",
                                             "cells => cells.map(c => Number(c.dataset.sort))")
    assert totals == sorted(totals, reverse=True) and len(totals) >= 6
    await header.locator("button").click()
    totals = await page.eval_on_selector_all("#kernel-table tbody tr td:nth-child(3)",
                                             "cells => cells.map(c => Number(c.dataset.sort))")
    assert totals == sorted(totals)
    assert await header.get_attribute("aria-sort") == "ascending"

    # The step chart has a series per phase that ran and a bar per step.
    series = await page.evaluate("window.profilePage.stepChart.series.slice(1).map(s => s.label)")
    assert "kernels" in series and "schedule" in series
    legend = await page.eval_on_selector_all("#step-chart .u-legend th", "ths => ths.map(th => th.textContent)")
    assert legend[:3] == ["step", "schedule", "prepare"]  # in the step's order, not the paint order
    assert await page.evaluate("window.profilePage.stepChart.data[0].length") == second["steps"]
    over = page.locator("#step-chart .u-over")
    await page.locator("#step-summary").scroll_into_view_if_needed()  # the chart and its legend in view
    chart = await over.bounding_box()
    await page.mouse.move(chart["x"] + chart["width"] / 2, chart["y"] + chart["height"] - 4)
    step_value = page.locator("#step-chart .u-legend .u-series").first.locator(".u-value")
    assert "ms in all" in await step_value.text_content()  # the hovered step's whole time
    await page.screenshot(path=str(SHOTS / "profile-steps.png"))

    # Hover the flame graph's widest frame above the root: its name and share in the tooltip.
    canvas = page.locator(".flame-canvas")
    await canvas.scroll_into_view_if_needed()
    box = await canvas.bounding_box()
    await page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] - 18 - 9)
    tip = page.locator("#flame-tip")
    await tip.wait_for(state="visible", timeout=5000)
    assert "samples" in await tip.text_content() and "%" in await tip.text_content()
    tip_box = await tip.bounding_box()  # beside the pointer, not somewhere else on the page
    assert abs(tip_box["y"] - (box["y"] + box["height"] - 27 + 12)) < 4
    await page.screenshot(path=str(SHOTS / "profile.png"))
    await page.screenshot(path=str(SHOTS / "profile-full.png"), full_page=True)

    # A click zooms into the hovered frame; a click on it again zooms back out to all. (The
    # full-page screenshot moved the page: measure again.)
    await canvas.scroll_into_view_if_needed()
    box = await canvas.bounding_box()
    await page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] - 18 - 9)
    frame = await tip.locator("strong").text_content()
    await page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] - 18 - 9)
    assert await page.evaluate("window.profilePage.flame.focus.name") == frame != "all"
    zoomed = await canvas.bounding_box()
    await page.mouse.click(zoomed["x"] + 5, zoomed["y"] + zoomed["height"] - 18 - 9)
    assert await page.evaluate("window.profilePage.flame.focus.name") == "all"
    # At 900 px beside the sidebar the page stays in the window: the kernel table scrolls in its box.
    await page.set_viewport_size({"width": 900, "height": 1000})
    # (the step chart and the flame graph are drawn again to their boxes' width once the resizing settles)
    await page.wait_for_function("document.scrollingElement.scrollWidth <= 900", timeout=10000)
    await page.screenshot(path=str(SHOTS / "profile-900.png"), full_page=True)
    await page.set_viewport_size({"width": 1400, "height": 1000})

    # Compare with the first profile: every kernel in one table, the change column filled.
    await page.select_option("#compare-b", str(first["profile_id"]))
    await page.click(".compare-form button[type=submit]")
    await page.wait_for_url("**/dashboard/profiles/compare/**")
    rows = await page.locator("#compare-kernels tbody tr").count()
    assert rows >= 6
    assert await page.locator("#compare-kernels tbody tr td.change").first.text_content() != ""
    assert await page.evaluate("window.__xss") is None
    await page.screenshot(path=str(SHOTS / "profile-compare.png"), full_page=True)
    # Its highlighted rows read in the dark theme too (the admin's text is near-white there).
    await page.emulate_media(color_scheme="dark")
    highlighted = [verdict for verdict in ("slower", "faster")
                   if await page.locator(f"#compare-kernels tr.change-{verdict}").count()]
    assert highlighted, "no kernel changed by more than the threshold: nothing to look at"
    for verdict in highlighted:
        assert await contrast(page, f"#compare-kernels tr.change-{verdict} td") >= 4.5, verdict
    await page.screenshot(path=str(SHOTS / "profile-compare-dark.png"), full_page=True)
    await page.emulate_media(color_scheme="light")

    # The kernels on the timeline: three lanes (steps, phases, kernels).
    await page.goto(f"{base}{second['url']}timeline/")
    await page.wait_for_function("window.timeline && window.timeline.stats.ready === true", timeout=30000)
    labels = await page.evaluate("window.timeline.model.lanes.map(l => l.label)")
    assert labels == ["steps", "phases", "kernels"]
    # Its lanes are not requests: no request search, no request panel, counted as lanes.
    assert await page.locator("#timeline-search").count() == 0
    assert (await page.text_content("#timeline-status")).endswith(" events · 3 lanes")
    lanes = await page.locator(".tl-canvas").bounding_box()
    await page.mouse.click(lanes["x"] + 60, lanes["y"] + 24 + 40)  # the kernels lane's label
    assert await page.locator("#lane-panel").is_hidden()
    # A range on the ruler: its time by lane (named as the lanes are) and span name.
    await page.mouse.move(lanes["x"] + 260, lanes["y"] + 10)
    await page.mouse.down()
    await page.mouse.move(lanes["x"] + lanes["width"] - 40, lanes["y"] + 10, steps=5)
    await page.mouse.up()
    await page.wait_for_selector("#range-panel:not([hidden])")
    first_cells = await page.locator("#range-table tr td:nth-child(1)").all_text_contents()
    assert {"steps", "phases", "kernels"} == set(first_cells)
    await page.screenshot(path=str(SHOTS / "profile-timeline.png"), full_page=True)

    # A profile of two or three steps: its step axis ticks at whole steps, never at step 0.5.
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.post("/debug/profile_start", json={"model": "demo"}).status_code == 200
        http.post("/v1/completions", json={"model": "demo", "prompt": "short", "max_tokens": 2,
                                           "debug_config": {"ignore_eos": True}})
        short = http.post("/debug/profile_stop", json={"model": "demo"}).json()
    await page.goto(f"{base}{short['url']}")
    await page.wait_for_function("window.profilePage && window.profilePage.ready === true", timeout=30000)
    ticks = await page.evaluate("window.profilePage.stepChart.axes[0]._values")
    assert ticks and all(float(t).is_integer() for t in ticks), ticks

    # A profile that is not (or no longer) kept: a page that says so, in the admin's frame.
    missing = await page.goto(f"{base}/dashboard/profiles/999999/")
    assert missing.status == 404 and "There is no profile #999999" in await page.text_content("#profile-problem")
    await page.screenshot(path=str(SHOTS / "profile-missing.png"))
    assert errors == []
