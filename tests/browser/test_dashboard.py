"""The dashboard in a real browser: Debian's chromium driven by async Playwright, against a live
``manage.py serve`` (Daphne, the engine in its own process) on a free port (both in conftest.py).

Screenshots of every page go to ``var/screenshots/`` (look at them).
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import threading

import httpx
import pytest

from tests.browser.conftest import SHOTS, LiveServer, load, text_lines

pytestmark = pytest.mark.slow
SERVE_MODELS = ("demo",)  # the real model's pages are test_playground's; this module restarts its server


async def number(page, selector: str) -> float:
    text = (await page.text_content(selector)) or ""
    text = text.replace(",", "").replace("\u202f", "").split()[0] if text.strip() else "–"
    return float(text) if text not in ("–", "") else float("nan")


async def test_overview_shows_the_demo_engine_live_and_load_moves_it(page, dashboard_server: LiveServer) -> None:
    row = 'tr.engine-row[data-engine="demo"]'
    await page.wait_for_selector(f'{row} [data-field="state"][data-state="running"]', timeout=15000)
    await page.wait_for_selector('#connection[data-state="open"]')
    assert await page.text_content(f'{row} [data-field="running"]') == "0"
    await page.screenshot(path=str(SHOTS / "overview-idle.png"), full_page=True)
    stop = threading.Event()
    worker = load(dashboard_server.base, stop)
    try:
        await page.wait_for_function(
            """() => {
                 const row = document.querySelector('tr.engine-row[data-engine="demo"]');
                 const running = Number(row.querySelector('[data-field="running"]').textContent);
                 const decode = parseFloat(
                   row.querySelector('[data-field="decode-rate"]').textContent.replace(/,/g, ''));
                 return running > 0 && decode > 0;
               }""", timeout=30000)
        await asyncio.sleep(2)  # a few sparkline points
        await page.screenshot(path=str(SHOTS / "overview-load.png"), full_page=True)
        await page.set_viewport_size({"width": 900, "height": 1000})
        await asyncio.sleep(0.5)
        await page.screenshot(path=str(SHOTS / "overview-900.png"), full_page=True)
        assert await page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), \
            "the overview overflows a 900 px window"
    finally:
        stop.set()
        worker.join(30)
        await page.set_viewport_size({"width": 1400, "height": 1000})


async def test_engine_page_charts_controls_and_history_link(page, dashboard_server: LiveServer) -> None:
    await page.click('tr.engine-row[data-engine="demo"] a')
    await page.wait_for_url("**/dashboard/engines/demo/")
    await page.wait_for_selector('h1 [data-field="state"][data-state="running"]', timeout=15000)
    await page.wait_for_selector("#metrics tbody tr")
    assert await page.locator(".charts canvas").count() >= 5  # uPlot drew every chart
    stop = threading.Event()
    worker = load(dashboard_server.base, stop, clients=2)
    try:
        await page.wait_for_function(
            "() => [...document.querySelectorAll('#metrics th')].some(th => th.textContent === 'num_running_requests'"
            " && Number(th.nextElementSibling.textContent) > 0)", timeout=30000)
        await page.wait_for_selector("#recent tbody tr:not(.empty) a >> text=history", timeout=30000)
        # MLC's rates are since-reset averages over step time, unlike the live charts: the label says so
        # (the rates' rows come with the first stats after a step of each kind: waited for, not raced).
        await page.wait_for_function(
            "() => [...document.querySelectorAll('#metrics th')].some(th => th.textContent.startsWith("
            "'decode_tokens_per_s')) && [...document.querySelectorAll('#metrics th')].some(th => "
            "th.textContent.startsWith('prefill_tokens_per_s'))", timeout=30000)
        headers = await page.locator("#metrics th").all_text_contents()
        assert "prefill_tokens_per_s (prefill tokens ÷ prefill step time, since reset)" in headers
        assert "decode_tokens_per_s (decode tokens ÷ decode step time, since reset)" in headers
        await asyncio.sleep(3)
        await page.screenshot(path=str(SHOTS / "engine-load.png"), full_page=True)
        # Times as the product prints them: 24-hour ticks (the date under the first), the legend's
        # moment in full (uPlot's own are "8:00pm 12/1/26" and "2026-12-01 8:00pm").
        ticks = await page.evaluate("window.enginePage.charts.rates.plot.axes[0]._values")
        assert ticks and all(re.fullmatch(r"\d\d:\d\d(:\d\d)?(\n\d{4}-\d\d-\d\d)?", t) for t in ticks), ticks
        moment = await page.text_content('[data-chart="rates"] .u-legend .u-series:first-child .u-value')
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", moment), moment
    finally:
        stop.set()
        worker.join(30)

    await page.fill("#trace-note", '<script>alert(1)</script> "><img src=x onerror=alert(2)>')
    await page.fill("#trace-tags", "browser, test")
    await page.click("#save-trace button[type=submit]")
    link = page.locator("#action-log li.success a")
    await link.wait_for(timeout=30000)
    await page.screenshot(path=str(SHOTS / "engine-saved-trace.png"), full_page=True)
    await link.click()
    await page.wait_for_url("**/admin/engines/tracerecord/*/change/")
    assert '<script>alert(1)</script>' in await page.input_value("#id_note")  # kept as text, never run
    await page.screenshot(path=str(SHOTS / "admin-saved-trace.png"), full_page=True)
    await page.go_back()

    await page.wait_for_selector('#connection[data-state="open"]')
    page.once("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
    await page.click("#reset")
    await page.wait_for_selector("#action-log li.success >> text=reset", timeout=15000)
    await page.wait_for_function(
        "() => [...document.querySelectorAll('#metrics th')].some(th => th.textContent === 'num_finished_requests'"
        " && th.nextElementSibling.textContent === '0')", timeout=15000)
    await page.screenshot(path=str(SHOTS / "engine-after-reset.png"), full_page=True)


async def test_the_engine_page_opens_with_its_last_minutes_and_lists_the_requests_running_now(
        page, dashboard_server: LiveServer) -> None:
    """The charts start full from the server's history (not an empty window filling from the right),
    and the table of requests in the engine shows a stream while it runs. In the dark theme too."""
    await page.goto(f"{dashboard_server.base}/dashboard/engines/demo/")  # the server samples while watched
    await page.wait_for_function("() => Number(document.getElementById('charts').dataset.samples) > 12",
                                 timeout=30000)
    await page.goto(f"{dashboard_server.base}/dashboard/")
    await page.goto(f"{dashboard_server.base}/dashboard/engines/demo/")
    # Within a few snapshots of opening, the charts hold the history the server kept.
    await page.wait_for_selector("#charts[data-samples]", timeout=10000)
    assert int(await page.get_attribute("#charts", "data-samples")) > 12
    body = {"model": "demo", "messages": [{"role": "user", "content": "A long story, please."}],
            "max_tokens": 400, "stream": True, "debug_config": {"ignore_eos": True}}
    stop = threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=dashboard_server.base, timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        break

    worker = threading.Thread(target=stream, daemon=True)
    worker.start()
    try:
        await page.wait_for_selector("#live tbody tr[data-state=decoding]", timeout=30000)
        assert "(1)" in await page.text_content("#live-count")
        await page.screenshot(path=str(SHOTS / "engine-live-requests.png"), full_page=True)
        charts = await page.evaluate("""() => {
          const c = window.enginePage.charts; const ctx = document.createElement("canvas").getContext("2d");
          const fit = (p) => { const a = p.axes[1]; ctx.font = a.font[0];
            const widest = Math.max(...a._values.map((v) => ctx.measureText(v).width / devicePixelRatio));
            return a._size >= widest + a.ticks.size; };
          const legend = (name) =>
            [...c[name].plot.root.querySelectorAll(".u-legend .u-value")].map((e) => e.textContent);
          return {requestTicks: c.requests.plot.axes[1]._splits, ratesFit: fit(c.rates.plot),
                  requestsFit: fit(c.requests.plot), legend: legend("rates"), stroke: c.rates.plot.axes[1].stroke};
        }""")
        # Count axes tick at whole numbers; every y label fits its axis; legends show the newest values unhovered.
        assert charts["requestTicks"] and all(float(t).is_integer() for t in charts["requestTicks"])
        assert charts["ratesFit"] and charts["requestsFit"]
        assert all(v not in ("", "--", "–") for v in charts["legend"][1:]), charts["legend"]
        light_stroke = charts["stroke"]
        await page.click(".theme-toggle")  # the admin's theme button: auto -> dark (or light -> dark)
        if await page.evaluate("document.documentElement.dataset.theme") != "dark":
            await page.click(".theme-toggle")
        await page.wait_for_timeout(500)
        dark_stroke = await page.evaluate("window.enginePage.charts.rates.plot.axes[1].stroke")
        assert dark_stroke == await page.evaluate(
            "getComputedStyle(document.documentElement).getPropertyValue('--body-quiet-color').trim()")
        assert dark_stroke != light_stroke  # the charts took the dark theme's colours
        await page.screenshot(path=str(SHOTS / "engine-dark.png"), full_page=False)
        await page.set_viewport_size({"width": 900, "height": 1000})
        await page.wait_for_timeout(300)
        await page.screenshot(path=str(SHOTS / "engine-900.png"), full_page=True)
    finally:
        stop.set()
        worker.join(30)
        await page.set_viewport_size({"width": 1400, "height": 1000})
    await page.wait_for_selector("#live tbody tr.empty", timeout=30000)


async def test_profiling_from_the_engine_page_saves_a_profile_to_open(page, dashboard_server: LiveServer) -> None:
    await page.goto(f"{dashboard_server.base}/dashboard/engines/demo/")
    await page.wait_for_selector('#connection[data-state="open"]')
    await page.check("#profile-stacks")
    await page.click("#profile-start")
    await page.wait_for_selector("#action-log li.success >> text=profiling", timeout=15000)
    assert await page.is_disabled("#profile-start") and not await page.is_disabled("#profile-stop")
    with httpx.Client(base_url=dashboard_server.base, timeout=60) as http:
        for i in range(3):
            http.post("/v1/completions", json={"model": "demo", "prompt": f"profile {i}", "max_tokens": 12})
    # The snapshots count the profiled steps live.
    await page.wait_for_function(
        "() => /profiling: [1-9][0-9]* steps/.test(document.getElementById('profile-state').textContent)",
        timeout=15000)
    await page.screenshot(path=str(SHOTS / "engine-profiling.png"), full_page=True)
    await page.click("#profile-stop")
    link = page.locator("#action-log li.success a")
    await link.wait_for(timeout=30000)
    assert "saved" in await page.text_content("#action-log li.success")
    await page.wait_for_selector("#profile-last:not([hidden])", timeout=15000)
    await link.click()
    await page.wait_for_url("**/dashboard/profiles/*/")
    for kernel in ("attention", "add_rmsnorm", "embedding"):
        await page.wait_for_selector(f"table >> text={kernel}", timeout=15000)


async def test_an_armed_profile_shows_armed_then_saves_itself(page, dashboard_server: LiveServer) -> None:
    await page.goto(f"{dashboard_server.base}/dashboard/engines/demo/")
    await page.wait_for_selector('#connection[data-state="open"]')
    with httpx.Client(base_url=dashboard_server.base, timeout=60) as http:
        armed = http.post("/debug/profile_start", json={"model": "demo", "max_steps": 2,
                                                         "trigger": {"request_id": "browser-trigger"}})
        assert armed.status_code == 200 and armed.json()["status"] == "armed", armed.text
        await page.wait_for_function("() => document.getElementById('profile-state').textContent"
                                     " === \"armed: starts at request 'browser-trigger' arriving\"", timeout=15000)
        assert await page.is_disabled("#profile-start") and not await page.is_disabled("#profile-stop")
        await page.locator("#controls").screenshot(path=str(SHOTS / "engine-profile-armed.png"))
        http.post("/v1/completions", json={"model": "demo", "prompt": "fire", "max_tokens": 6,
                                           "debug_config": {"ignore_eos": True}},
                  headers={"X-Request-Id": "browser-trigger"})
    # It ran its two steps and saved itself: the page links it, and the profile says what started it.
    await page.wait_for_selector("#profile-last:not([hidden])", timeout=30000)
    await page.wait_for_function("() => document.getElementById('profile-state').textContent === 'not profiling'")
    await page.click("#profile-last")
    await page.wait_for_url("**/dashboard/profiles/*/")
    assert "fired: request 'browser-trigger' arrived" in await page.text_content("#profile-trigger")
    await page.screenshot(path=str(SHOTS / "profile-started-by-trigger.png"), full_page=False)


async def test_a_disaggregated_requests_two_halves_show_in_the_recent_table(
        page, dashboard_server: LiveServer) -> None:
    """The three MicroServing calls on one engine: it prefills and sends, then receives and decodes;
    its table shows both halves under the one request id."""
    await page.goto(f"{dashboard_server.base}/dashboard/engines/demo/")
    await page.wait_for_selector('#connection[data-state="open"]', timeout=15000)
    body = {"model": "demo", "prompt": "Tell me about the two halves of a lighthouse keeper's day.",
            "user": "disagg-in-the-browser", "max_tokens": 8}
    with httpx.Client(base_url=dashboard_server.base, timeout=60) as http:
        prep = http.post("/microserving/prep_recv", json={**body, "end": -1}).json()
        end = prep["prompt_length"] - 1
        send = http.post("/microserving/remote_send", json={**body, "begin": prep["prefix_matched_length"],
                                                             "end": end, "kv_addr_info": prep["kv_append_metadata"]})
        assert send.status_code == 200, send.text
        assert http.post("/microserving/start_generate", json={**body, "begin": end}).status_code == 200
    await page.wait_for_function("() => document.querySelectorAll('#recent .disagg-tag').length >= 2", timeout=15000)
    tags = await page.locator("#recent .disagg-tag").all_text_contents()
    assert tags[:2] == [f"decode, KV [0:{end}] received", f"prefill, sent KV [0:{end}]"]
    rows = await page.locator("#recent tbody tr").all_text_contents()
    assert all(row.startswith("disagg-in-the-browser") for row in rows[:2])
    await page.locator("#recent-module").screenshot(path=str(SHOTS / "engine-disaggregated-halves.png"))


async def test_the_engine_page_fits_900_px_with_long_request_ids(page, dashboard_server: LiveServer) -> None:
    """At 900 px beside the admin's sidebar: nothing past the window's edge (the request tables
    scroll inside their modules), each request id on one line, cut short, whole in its tooltip."""
    long_ids = [f"narrow-window-request-{i}-0123456789abcdef0123456789abcdef" for i in range(3)]
    with httpx.Client(base_url=dashboard_server.base, timeout=60) as http:
        for request_id in long_ids:
            done = http.post("/v1/completions", json={"model": "demo", "prompt": "a long id", "max_tokens": 2,
                                                       "user": request_id})
            assert done.status_code == 200, done.text
    for scheme in ("light", "dark"):
        await page.emulate_media(color_scheme=scheme)
        await page.set_viewport_size({"width": 900, "height": 1000})
        await page.goto(f"{dashboard_server.base}/dashboard/engines/demo/")
        await page.wait_for_selector(f'#recent .request-id[title="{long_ids[-1]}"]', timeout=15000)
        assert await page.evaluate("document.scrollingElement.scrollWidth") <= 900
        ids = await text_lines(page, "#recent .request-id")
        assert set(long_ids) <= {request["text"] for request in ids}
        assert all(request["lines"] == 1 and request["tooltip"] == request["text"] for request in ids), ids
        assert all(request["cut"] for request in ids if request["text"] in long_ids)
        await page.screenshot(path=str(SHOTS / f"engine-900-{scheme}.png"), full_page=True)
    await page.emulate_media(color_scheme="light")
    await page.set_viewport_size({"width": 1400, "height": 1000})


async def test_a_killed_engine_shows_restarting_then_running(page, dashboard_server: LiveServer) -> None:
    await page.goto(f"{dashboard_server.base}/dashboard/engines/demo/")
    await page.wait_for_selector('h1 [data-field="state"][data-state="running"]', timeout=15000)
    os.kill(dashboard_server.engine_pid(), signal.SIGKILL)
    await page.wait_for_selector('h1 [data-field="state"][data-state="restarting"]', timeout=15000)
    await page.wait_for_timeout(600)  # a snapshot or two with no numbers
    # The outage is a gap in the charts, not a line drawn across it.
    assert await page.evaluate("window.enginePage.charts.requests.data[1].slice(-2).includes(null)")
    # The controls wait for the engine, and say why.
    for button in ("#reset", "#save-trace-button", "#clear-trace", "#profile-start"):
        assert await page.is_disabled(button), button
    assert "Unavailable: the engine is restarting" in (await page.get_attribute("#reset", "title"))
    assert "The controls wait: the engine is restarting" in await page.text_content("#controls-reason")
    await page.screenshot(path=str(SHOTS / "engine-restarting.png"), full_page=True)
    await page.wait_for_selector('h1 [data-field="state"][data-state="running"]', timeout=60000)
    assert "restarts 1" in (await page.text_content('h1 [data-field="state"]'))
    assert await page.is_enabled("#reset") and await page.is_enabled("#profile-start")
    assert await page.is_hidden("#controls-reason")


async def test_playground_streams_a_request_and_stops_one(page, dashboard_server: LiveServer) -> None:
    await page.goto(f"{dashboard_server.base}/dashboard/playground/")
    await page.fill("#pg-prompt", 'Say <b>hi</b> "><img src=x onerror=alert(1)>')
    await page.fill("#pg-max-tokens", "24")
    # Sampled at the page's default temperature: without ignore_eos the demo model may stop early.
    await page.fill("#pg-debug-config", '{"ignore_eos": true}')
    await page.click("#pg-send")
    try:
        await page.wait_for_selector("#pg-choices .finish >> text=finish_reason", timeout=30000)
    except Exception:
        await page.screenshot(path=str(SHOTS / "playground-failed.png"), full_page=True)
        raise
    stats = await page.text_content("#pg-stats")
    assert "TTFT" in stats and "24 tokens" in stats, stats
    assert len(await page.text_content(".choice-text")) > 0
    await page.wait_for_selector('#pg-engine-now >> text=running')
    await page.screenshot(path=str(SHOTS / "playground.png"), full_page=True)

    await page.fill("#pg-max-tokens", "1500")
    await page.click("#pg-send")
    await page.wait_for_function("() => document.querySelector('.choice-text')?.textContent.length > 20",
                                 timeout=30000)
    await page.click("#pg-stop")
    await page.wait_for_selector("#pg-stats >> text=stopped", timeout=10000)
    await page.wait_for_selector('#pg-engine-now >> text=running 0', timeout=15000)  # the engine let it go


async def test_the_page_says_when_it_lost_the_server_and_resumes_without_a_reload(
        page, dashboard_server: LiveServer) -> None:
    """Last in this module: it stops the server and starts it again."""
    await page.goto(f"{dashboard_server.base}/dashboard/engines/demo/")
    await page.wait_for_selector('#connection[data-state="open"]', timeout=15000)
    await page.evaluate("window.__sameDocument = true")
    await asyncio.to_thread(dashboard_server.stop)
    await page.wait_for_selector('#connection[data-state="retrying"]', timeout=15000)
    assert "reconnecting" in await page.text_content("#connection")
    await page.screenshot(path=str(SHOTS / "engine-disconnected.png"), full_page=True)
    dashboard_server.process = await asyncio.to_thread(dashboard_server.start)
    await page.wait_for_selector('#connection[data-state="open"]', timeout=60000)
    await page.wait_for_selector('h1 [data-field="state"][data-state="running"]', timeout=15000)
    assert await page.evaluate("window.__sameDocument === true")  # no reload happened
