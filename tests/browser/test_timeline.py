"""The timeline viewer in a real browser (Debian's chromium, async Playwright) against a live
``manage.py serve``: a live engine under load and a saved trace record.

Screenshots go to ``var/screenshots/timeline-*.png``. Frame times are a benchmark
(``bench/timeline.py``), not asserted here.
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from tests.browser.conftest import SHOTS, LiveServer, load

pytestmark = pytest.mark.slow

SERVE_MODELS = ("demo",)  # every request here is the demo's

HOSTILE_ID = '"><img src=x onerror="window.__xss=1">'


def dump_spans(trace: dict) -> list[list]:
    """A dump's spans and instants as the viewer's ``model.spans()`` lists them (lane label, name,
    start, end; instants end null), lane by lane, spans before instants: the reference."""
    labels = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
              if e["ph"] == "M" and e["name"] == "thread_name"}
    lanes: dict[int, dict[str, list]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M":
            continue
        lane = lanes.setdefault(e["tid"], {"open": [], "spans": [], "instants": []})
        if e["ph"] == "B":
            lane["open"].append(e)
        elif e["ph"] == "E":
            begin = next(b for b in reversed(lane["open"]) if b["name"] == e["name"])
            lane["open"].remove(begin)
            lane["spans"].append(
                [labels[e["tid"]], begin["name"], begin["ts"], e["ts"], e["args"].get("unclosed", False)])
        else:
            lane["instants"].append([labels[e["tid"]], e["name"], e["ts"], None])
    out = []
    for tid in sorted(lanes):
        out += sorted(lanes[tid]["spans"], key=lambda s: (s[2], s[1]))
        out += lanes[tid]["instants"]
    return out


def viewer_spans(spans: list[list]) -> list[list]:
    by_lane: dict[str, list] = {}
    order: list[str] = []
    for label, name, start, end in spans:
        if label not in by_lane:
            order.append(label)
            by_lane[label] = [[], []]
        by_lane[label][0 if end is not None else 1].append([label, name, start, end])
    out = []
    for label in order:
        out += sorted(by_lane[label][0], key=lambda s: (s[2], s[1])) + by_lane[label][1]
    return out


async def wait_for(page, expression: str, timeout_s: float = 60) -> None:
    """Wait until ``expression`` holds; the page's module may not have run yet when polling starts."""
    await page.wait_for_function(
        f"window.timeline !== undefined && window.timeline.view !== undefined && ({expression})",
        timeout=timeout_s * 1000, polling=100)


async def test_live_timeline_follows_the_engine_and_matches_its_dump(page, dashboard_server: LiveServer) -> None:
    base = dashboard_server.base
    await page.goto(f"{base}/dashboard/engines/demo/")
    await page.click("#timeline-link")
    await page.wait_for_url("**/dashboard/engines/demo/timeline/")
    with httpx.Client(base_url=base, timeout=60) as http:   # one request with a hostile id first
        http.post("/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 4, "user": HOSTILE_ID})
    await wait_for(page, "window.timeline.model.lanes.length >= 2")
    stop = threading.Event()
    worker = load(base, stop, clients=3)
    try:
        await wait_for(page, "window.timeline.model.lanes.length >= 5")
        first = await page.evaluate("window.timeline.model.events")
        await asyncio.sleep(1.5)
        grown = await page.evaluate("window.timeline.model.events")
        assert grown > first, "the live view did not grow while requests ran"
        # Following the present: the view ends near the engine's clock.
        lag = await page.evaluate("window.timeline.stats.lastNowUs - window.timeline.model.last")
        assert lag < 1_000_000
        await page.screenshot(path=str(SHOTS / "timeline-live.png"), full_page=True)
    finally:
        stop.set()
        worker.join(60)
    await asyncio.sleep(1.5)   # the last deltas arrive
    # What the viewer drew is what a dump taken now holds: same lanes, names, pairing and times.
    trace = httpx.get(f"{base}/dashboard/engines/demo/trace.json",
                      cookies={c["name"]: c["value"] for c in await page.context.cookies()}).json()
    assert not any(len(s) == 5 and s[4] for s in dump_spans(trace)), "a request was still running"
    expected = [s[:4] for s in dump_spans(trace)]
    drawn = viewer_spans(await page.evaluate("window.timeline.model.spans()"))
    assert drawn == expected
    assert await page.evaluate("window.timeline.stats.missed") == 0

    # Hover shows the span under the pointer; the hostile id stays text.
    await page.click("#fit")
    await page.fill("#timeline-search", "onerror")
    await page.click("#search-next")
    assert await page.text_content("#search-result") == "1 of 1"
    assert await page.text_content("#lane-title") == HOSTILE_ID
    # Its lane links its request page (where its time went), the id encoded as encodeURIComponent does.
    from urllib.parse import quote

    assert await page.get_attribute("#lane-history", "href") == (
        f"/dashboard/engines/demo/requests/{quote(HOSTILE_ID, safe=chr(39) + '-_.!~*()')}/")
    box = await page.locator(".tl-canvas").bounding_box()
    hit = await page.evaluate("""() => {
      const v = window.timeline.view; const lane = v.highlight; v.layoutLanes();
      const i = v.lanes.indexOf(lane); const row = lane.rows[0];
      const t = row.start.data[0] + (Math.min(row.end.data[0], v.t1) - row.start.data[0]) / 2;
      return {x: v.xOf(t), y: 24 + v.laneTops[i] - v.scroller.scrollTop + 7};
    }""")
    await page.mouse.move(box["x"] + hit["x"], box["y"] + hit["y"])
    await page.wait_for_selector("#timeline-tooltip:not([hidden])")
    tip = await page.text_content("#timeline-tooltip")
    assert "lane: " + HOSTILE_ID in tip and "duration" in tip
    assert await page.evaluate("window.__xss") is None
    assert await page.locator("img[src=x]").count() == 0
    await page.screenshot(path=str(SHOTS / "timeline-live-hover.png"), full_page=True)

    # The wheel zooms around the pointer, and the ruler follows.
    before = await page.evaluate(
        "[window.timeline.view.t0, window.timeline.view.t1, window.timeline.view.ticks.join()]")
    await page.mouse.wheel(0, -400)
    await asyncio.sleep(0.3)
    after = await page.evaluate("[window.timeline.view.t0, window.timeline.view.t1, window.timeline.view.ticks.join()]")
    assert after[1] - after[0] < (before[1] - before[0]) / 2
    assert after[2] != before[2]

    # A lane's label, cut short in the gutter, shows its whole id on hover.
    label = await page.evaluate("""() => {
      const v = window.timeline.view; const i = v.lanes.indexOf(v.highlight);
      return {x: 40, y: 24 + v.laneTops[i] - v.scroller.scrollTop + 7};
    }""")
    await page.mouse.move(box["x"] + label["x"], box["y"] + label["y"])
    await page.wait_for_selector("#timeline-tooltip:not([hidden])")
    assert (await page.text_content("#timeline-tooltip .tip-title")) == HOSTILE_ID


def stream(base: str, request_id: str, started: threading.Event, stop: threading.Event) -> None:
    """A long streamed request that runs until ``stop`` (``started`` at its first chunk)."""
    body = {"model": "demo", "prompt": "a long one", "max_tokens": 1500, "stream": True, "user": request_id,
            "debug_config": {"ignore_eos": True}}
    with httpx.Client(base_url=base, timeout=120) as http, http.stream("POST", "/v1/completions", json=body) as reply:
        for _ in reply.iter_lines():
            started.set()
            if stop.is_set():
                break


async def test_following_shows_the_running_requests_first_and_hides_the_finished_lanes(
        page, dashboard_server: LiveServer) -> None:
    """After many requests (a long run's), the live timeline's first lanes are the requests running
    now, not the first minute's: the lanes that ended before the window are hidden, counted, and
    shown after the others on request."""
    base = dashboard_server.base
    await page.goto(f"{base}/dashboard/engines/demo/timeline/")
    await wait_for(page, "window.timeline.stats.deltas > 0")
    with httpx.Client(base_url=base, timeout=60) as http:
        for i in range(150):
            done = http.post("/v1/completions", json={"model": "demo", "prompt": f"early {i}", "max_tokens": 2,
                                                       "user": f"early-{i}"})
            assert done.status_code == 200, done.text
    # Followed out of the window (10 s wide), the early lanes are hidden, one by one.
    await wait_for(page, "window.timeline.view.lanes.every(l => !l.label.startsWith('early-'))")
    running = [f"running-{i}" for i in range(4)]
    started = [threading.Event() for _ in running]
    stop = threading.Event()
    streams = [threading.Thread(target=stream, args=(base, rid, flag, stop), daemon=True)
               for rid, flag in zip(running, started, strict=True)]
    for thread in streams:
        thread.start()
    try:
        assert all(flag.wait(60) for flag in started)
        await wait_for(page, "window.timeline.view.lanes.filter(l => l.label.startsWith('running-')).length === 4")
        shown = await page.evaluate("window.timeline.view.lanes.map(l => l.label)")
        assert shown[0] == "engine" and sorted(shown[1:5]) == running, shown[:8]
        lanes = await page.evaluate("window.timeline.model.lanes.length")
        assert lanes >= 150 + 5
        button = page.locator("#show-finished")
        hidden = lanes - len(shown)
        assert await button.is_visible() and await button.text_content() == f"Show {hidden:,} finished lanes"
        assert f"{hidden:,} finished lanes hidden" in await page.text_content("#timeline-status")
        await page.screenshot(path=str(SHOTS / "timeline-live-many-lanes.png"), full_page=True)

        # Shown on request: after the running ones, which stay at the top.
        await button.click()
        shown = await page.evaluate("window.timeline.view.lanes.map(l => l.label)")
        assert len(shown) == await page.evaluate("window.timeline.model.lanes.length")
        assert sorted(shown[1:5]) == running and "early-0" in shown[5:]
        assert await button.text_content() == "Hide finished lanes"
        await page.screenshot(path=str(SHOTS / "timeline-live-many-lanes-shown.png"), full_page=True)
        await button.click()
        await wait_for(page, "window.timeline.view.lanes.every(l => !l.label.startsWith('early-'))")
    finally:
        stop.set()
        for thread in streams:
            thread.join(60)


async def test_after_an_engine_restart_the_live_ruler_counts_from_zero_again(
        page, dashboard_server: LiveServer) -> None:
    import os
    import signal

    base = dashboard_server.base
    await page.goto(f"{base}/dashboard/engines/demo/timeline/")
    with httpx.Client(base_url=base, timeout=60) as http:
        http.post("/v1/completions", json={"model": "demo", "prompt": "before", "max_tokens": 4})
    await wait_for(page, "window.timeline.model.lanes.length >= 2")
    os.kill(dashboard_server.engine_pid(), signal.SIGKILL)
    await page.wait_for_selector("#timeline-notice >> text=restarted", timeout=60000)
    await asyncio.sleep(1)
    # Nothing recorded yet by the new engine: the ruler reads from the restart (seconds), not from
    # the epoch ("+1795756606.0 s").
    offsets = await page.evaluate("() => window.timeline.view.ticks.map(t => t - window.timeline.model.origin)")
    assert offsets and all(abs(t) < 600e6 for t in offsets), offsets
    await page.screenshot(path=str(SHOTS / "timeline-after-restart.png"), full_page=True)
    with httpx.Client(base_url=base, timeout=60) as http:   # back: the new trace's events from zero
        for _ in range(60):
            body = {"model": "demo", "prompt": "after", "max_tokens": 4}
            if http.post("/v1/completions", json=body).status_code == 200:
                break
            await asyncio.sleep(1)
    await wait_for(page, "window.timeline.model.lanes.length >= 2")
    offsets = await page.evaluate("() => window.timeline.view.ticks.map(t => t - window.timeline.model.origin)")
    assert all(abs(t) < 600e6 for t in offsets)


async def test_saved_timeline_shows_the_record_its_summaries_and_downloads(page, dashboard_server: LiveServer) -> None:
    base = dashboard_server.base
    with httpx.Client(base_url=base, timeout=60) as http:
        for i in range(4):
            http.post("/v1/completions", json={"model": "demo", "prompt": f"story {i}", "max_tokens": 8 + 8 * i,
                                               "user": f"saved-{i}"})
        saved = http.post("/debug/save_event_trace", json={"model": "demo", "note": "<b>timeline</b>"}).json()
    await page.goto(f"{base}{saved['admin_url']}")
    await page.click("text=Open in the timeline")
    await wait_for(page, "window.timeline.stats.ready === true")
    assert await page.evaluate("window.timeline.model.events") == saved["events"]
    lanes = await page.evaluate("window.timeline.model.lanes.map(l => l.label)")
    assert lanes[0] == "engine" and {f"saved-{i}" for i in range(4)} <= set(lanes)
    assert len(lanes) == saved["requests"] + 1

    # The viewer's own summary of each lane equals the server's RequestSummary row (the reference).
    rows = httpx.get(f"{base}/dashboard/traces/{saved['id']}/requests.json",
                     cookies={c["name"]: c["value"] for c in await page.context.cookies()}).json()
    server = {r[1]: dict(zip(rows["fields"], r, strict=True)) for r in rows["rows"]}
    mine = await page.evaluate("""async () => {
      const { laneSummary } = await import('/static/engines/js/timeline/model.js');
      const m = window.timeline.model;
      return m.lanes.filter(l => l.kind === 'request').map(l => laneSummary(l, m.names));
    }""")
    assert len(mine) == len(server)
    for summary in mine:
        row = server[summary["request_id"]]
        for field in ("prompt_tokens", "completion_tokens", "queue_us", "ttft_us", "prefill_us", "decode_us",
                      "e2e_us", "finish_reason", "preemptions"):
            assert summary[field] == row[field], (summary["request_id"], field, summary[field], row[field])

    # Find a request, see its summary and the link to its saved row.
    await page.fill("#timeline-search", "saved-3")
    await page.press("#timeline-search", "Enter")
    await page.wait_for_selector("#lane-panel:not([hidden])")
    assert await page.text_content("#lane-title") == "saved-3"
    # The demo model may stop before max_tokens: the saved row says how many it made.
    assert await page.text_content('#lane-table td[data-field="completion_tokens"]') == str(
        server["saved-3"]["completion_tokens"])
    href = await page.get_attribute("#lane-history", "href")
    assert href == f"/admin/engines/requestsummary/{server['saved-3']['id']}/change/"

    # Filters: only the long ones, by the saved rows' own end-to-end times (which request is
    # slowest depends on the machine's load, not on max_tokens).
    slowest = max(server.values(), key=lambda row: row["e2e_us"])
    await page.fill("#filter-e2e", str(slowest["e2e_us"] / 1000 - 0.001))
    await page.press("#filter-e2e", "Enter")
    await page.dispatch_event("#filter-e2e", "change")
    shown = await page.evaluate("window.timeline.view.lanes.map(l => l.label)")
    want = {rid for rid, row in server.items() if row["e2e_us"] / 1000 >= slowest["e2e_us"] / 1000 - 0.001}
    assert shown[0] == "engine" and set(shown[1:]) == want and len(want) < len(server)
    await page.fill("#filter-e2e", "")
    await page.dispatch_event("#filter-e2e", "change")

    # A range selected on the ruler: what the engine spent its time on inside it.
    await page.click("#fit")
    box = await page.locator(".tl-canvas").bounding_box()
    await page.mouse.move(box["x"] + 260, box["y"] + 10)
    await page.mouse.down()
    await page.mouse.move(box["x"] + box["width"] - 40, box["y"] + 10, steps=5)
    await page.mouse.up()
    await page.wait_for_selector("#range-panel:not([hidden])")
    names = await page.locator("#range-table tr td:nth-child(2)").all_text_contents()
    assert "prefill" in names and "decode" in names
    await page.screenshot(path=str(SHOTS / "timeline-saved.png"), full_page=True)

    # Downloads load as traces.
    cookies = {c["name"]: c["value"] for c in await page.context.cookies()}
    for link in ("#download-json", "#download-gzip"):
        href = await page.get_attribute(link, "href")
        body = httpx.get(f"{base}{href}", cookies=cookies).content
        if link.endswith("gzip"):
            import gzip

            body = gzip.decompress(body)
        trace = json.loads(body)
        assert len([e for e in trace["traceEvents"] if e["ph"] != "M"]) == saved["events"]
