"""The history pages in a real browser (Debian's chromium, async Playwright) against a live
``manage.py serve``: after some traffic, a trace saved and two profiles taken through the API, the
trace list, a trace record, the metrics snapshot charts, the request list, the profile list and
the profile compare page, each at 1400 and at 900 px wide, with nothing off screen; and the engine
left idle adds no metrics snapshot while that goes on. A second server's snapshots of the same
engine name, written into the same database in the same seconds, are listed with their server
and charted only when picked, never in the lines of this server's.

Screenshots go to ``var/screenshots/history-*.png`` (look at them).
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import sqlite3
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.browser.conftest import SHOTS, LiveServer, load, text_lines

pytestmark = pytest.mark.slow

WIDTHS = (1400, 900)
#: Metrics snapshots every 2 s (serve's default is 10): the charts' points come in seconds.
EXTRA_SERVE_ARGS = ["--metrics-snapshot-interval", "2"]
#: The idle engine's served name: long, as a GGUF file's name is, for the lists at 900 px.
IDLE = "idle-demo-engine-served-under-a-long-name"
#: The demo, and a second one that no request goes to.
SERVE_MODELS = ("demo", f"demo:{IDLE}")
#: Request ids as long as clients send (an OpenAI ``user``, a uuid-bearing id).
LONG_IDS = [f"history-page-request-{i}-0123456789abcdef0123456789abcdef" for i in range(2)]

# What lies outside the window or outside the box that clips it (a change list's table scrolls
# inside its .results box): the document's overflow, and each visible cell past either edge.
OFF_SCREEN = """() => {
  const out = [];
  const doc = document.documentElement;
  if (doc.scrollWidth > innerWidth) out.push(`the page is ${doc.scrollWidth} px wide in a ${innerWidth} px window`);
  for (const cell of document.querySelectorAll('#content th, #content td')) {
    const box = cell.getBoundingClientRect();
    if (!box.width) continue;  // a column the layout hides
    let clip = innerWidth;
    for (let el = cell.parentElement; el; el = el.parentElement) {
      if (getComputedStyle(el).overflowX !== 'visible') clip = Math.min(clip, el.getBoundingClientRect().right);
    }
    const text = cell.textContent.trim().slice(0, 30);
    if (box.right > clip + 1) out.push(`${cell.className}: "${text}" ends at ${box.right} past ${clip}`);
  }
  return out.slice(0, 10);
}"""


def take_profile(http: httpx.Client, note: str, max_tokens: int) -> dict:
    started = http.post("/debug/profile_start", json={"model": "demo"})
    assert started.status_code == 200, started.text
    for i in range(2):
        http.post("/v1/completions", json={"model": "demo", "prompt": f"history page {i}", "max_tokens": max_tokens,
                                           "debug_config": {"ignore_eos": True}})
    stopped = http.post("/debug/profile_stop", json={"model": "demo", "note": note})
    assert stopped.status_code == 200, stopped.text
    return stopped.json()


def snapshot_count(server: LiveServer, engine: str) -> int:
    db = Path(server.env["DEBUGSITE_VAR_DIR"]) / "db.sqlite3"
    with sqlite3.connect(db, timeout=30) as conn:
        return conn.execute("SELECT count(*) FROM engines_metricssnapshot WHERE engine = ?", [engine]).fetchone()[0]


# Whether each snapshot chart's y axis is as wide as its longest tick label (and its ticks).
Y_LABELS_FIT = """() => window.snapshotCharts.plots.map((u) => {
  const axis = u.axes[1];
  u.ctx.font = axis.font[0];
  const widest = Math.max(...axis._values.filter((v) => v != null).map((v) => u.ctx.measureText(String(v)).width));
  return axis._size >= widest / devicePixelRatio + axis.ticks.size + axis.gap;
})"""

# Whether each snapshot chart's axes are drawn in the admin's quiet text colour of the theme now.
AXES_IN_THEME = """() => {
  const quiet = getComputedStyle(document.documentElement).getPropertyValue("--body-quiet-color").trim();
  return window.snapshotCharts.plots.map((u) => u.axes.every((axis) => axis.stroke(u) === quiet));
}"""

#: Another server writing the same database under the same engine name, a million tokens a second.
OTHER_SERVER = "gpu-box:9000"
OTHER_RATE = 1_000_000


def another_servers_snapshots(server: LiveServer, engine: str) -> int:
    """A snapshot of ``OTHER_SERVER``'s ``engine`` half a second before each one this server saved
    of its own (the issue's three servers, two of them, in the same seconds): how many."""
    db = Path(server.env["DEBUGSITE_VAR_DIR"]) / "db.sqlite3"
    with sqlite3.connect(db, timeout=30) as conn:
        moments = [row[0] for row in conn.execute(
            "SELECT taken_at FROM engines_metricssnapshot WHERE engine = ? ORDER BY taken_at", [engine])]
        start = datetime.fromisoformat(moments[0])
        for i, moment in enumerate(moments):
            at = datetime.fromisoformat(moment) - timedelta(seconds=0.5)
            seconds = (at - start).total_seconds()
            metrics = {"decode_tokens_processed": int(OTHER_RATE * seconds), "num_running_requests": 40,
                       "num_waiting_requests": 12, "kv_cache_usage": 0.9, "num_finished_requests": 239 + i,
                       "ttft_s": {"p50": 3.5, "p99": 7.0}}
            conn.execute("INSERT INTO engines_metricssnapshot (engine, model, taken_at, metrics, server, fleet) "
                         "VALUES (?, 'SmolLM2', ?, ?, ?, 'default')",
                         [engine, at.isoformat(" "), json.dumps(metrics), OTHER_SERVER])
    return len(moments)


async def show(page, url: str, name: str, ready: str = "#content-main") -> None:
    """``url`` at each width: nothing off screen, and a screenshot ``history-<name>-<width>.png``."""
    for width in WIDTHS:
        await page.set_viewport_size({"width": width, "height": 1000})
        await page.goto(url)
        await page.wait_for_selector(ready, timeout=15000)
        await page.wait_for_timeout(300)  # the charts follow their box's new width
        await page.screenshot(path=str(SHOTS / f"history-{name}-{width}.png"), full_page=True)
        assert await page.evaluate(OFF_SCREEN) == [], (name, width)


async def visible_columns(page) -> list[str]:
    return await page.eval_on_selector_all(
        "#result_list thead th", "ths => ths.filter(th => th.getBoundingClientRect().width > 0)"
                                 ".map(th => (th.querySelector('.text') || th).textContent.trim().toLowerCase())")


async def test_the_history_pages_fit_at_1400_and_900_px(page, dashboard_server: LiveServer) -> None:
    base = dashboard_server.base
    stop = threading.Event()
    worker = load(base, stop, clients=3)
    try:
        with httpx.Client(base_url=base, timeout=120) as http:
            deadline = time.monotonic() + 90
            while http.post("/debug/dump_engine_metrics", json={"model": "demo"}).json()["metrics"][
                    "num_finished_requests"] < 4:  # a trace with finished requests in it
                assert time.monotonic() < deadline, "no request finished under load"
                await asyncio.sleep(1)
            for request_id in LONG_IDS:
                done = http.post("/v1/completions", json={"model": "demo", "prompt": "a long id", "max_tokens": 2,
                                                           "user": request_id})
                assert done.status_code == 200, done.text
            saved = http.post("/debug/save_event_trace", json={
                "model": "demo", "note": "history pages: three streaming clients, <b>not bold</b>",
                "tags": ["browser", "history"]})
            assert saved.status_code == 200, saved.text
            trace = saved.json()
            first = take_profile(http, "before", 16)
            second = take_profile(http, "after", 8)
        # Snapshots every 2 s while the load changes the metrics: a few points to chart.
        deadline = time.monotonic() + 90
        while snapshot_count(dashboard_server, "demo") < 4:
            assert time.monotonic() < deadline, "no metrics snapshots while serving"
            await asyncio.sleep(1)
    finally:
        stop.set()
        worker.join(30)
    idle_snapshots = snapshot_count(dashboard_server, IDLE)  # the engine no request went to
    assert idle_snapshots >= 1

    # The trace list: note, tags, source and the way into the timeline.
    await show(page, f"{base}/admin/engines/tracerecord/", "traces", "#result_list")
    timeline = f'a[href="/dashboard/traces/{trace["id"]}/timeline/"]'
    row = page.locator("#result_list tbody tr", has=page.locator(timeline))
    assert "history pages: three streaming clients, <b>not bold</b>" in await row.locator(".engines-note").inner_text()
    assert await row.locator(".engines-tag").all_inner_texts() == ["browser", "history"]
    assert "API" in await row.locator(".field-captured").inner_text()
    await page.set_viewport_size({"width": 1400, "height": 1000})
    assert await visible_columns(page) == ["", "trace", "engine", "server", "captured, source", "duration (ms)",
                                           "events", "requests", "size", "note and tags", "timeline"]

    # A trace record: its capture window in readable times and a duration.
    await show(page, f"{base}{trace['admin_url']}", "trace-record", "#requests")
    window = await page.locator(".field-window .readonly").inner_text()
    readable = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} – \d\d:\d\d:\d\d\.\d{3} UTC \([\d.]+ (s|ms)\)"
    assert re.fullmatch(readable, window), window

    # The snapshot list at 900 px: a long engine name on one line, cut short, whole in its tooltip.
    await show(page, f"{base}/admin/engines/metricssnapshot/?engine={IDLE}", "snapshot-list", "#result_list")
    names = await text_lines(page, "#result_list .field-engine_name > *")
    assert IDLE in {name["text"] for name in names}
    assert all(name["lines"] == 1 and name["tooltip"] == name["text"] for name in names), names
    assert any(name["cut"] for name in names if name["text"] == IDLE)
    # The metrics snapshot charts, above the list: this server's engine, though another server
    # wrote snapshots of an engine of the same name in the same seconds.
    here = f"{socket.gethostname()}:{base.rsplit(':', 1)[1]}"
    others = another_servers_snapshots(dashboard_server, "demo")
    await show(page, f"{base}/admin/engines/metricssnapshot/?engine=demo", "snapshots", "#snapshot-charts canvas")
    assert await page.locator("#snapshot-charts .uplot").count() == 5
    assert await page.locator("#snapshot-charts-server-select").input_value() == here
    assert set(await page.locator("#snapshot-charts-server-select option").all_inner_texts()) == {here, OTHER_SERVER}
    data = await page.evaluate("window.snapshotCharts.data")
    assert len(data["x"]) >= 4 and len(data["x"]) == len(set(data["x"]))  # one point a moment: one server's
    decode = next(s["values"] for c in data["charts"] for s in c["series"] if s["label"] == "decode tok/s")
    assert 0 < max(v for v in decode if v is not None) < OTHER_RATE / 10
    # Counts tick at whole numbers: never 0.5 requests or preemptions.
    for index, chart in enumerate(data["charts"]):
        if chart["key"] in ("requests", "preemptions"):
            ticks = await page.evaluate(f"window.snapshotCharts.plots[{index}].axes[1]._values")
            assert ticks and all(float(t.replace(",", "")).is_integer() for t in ticks), (chart["key"], ticks)
    # The pointer on one chart names the moment on all of them.
    await page.locator("#snapshot-charts .u-over").first.hover(position={"x": 120, "y": 40})
    moments = await page.locator("#snapshot-charts .u-legend tr:first-child .u-value").all_inner_texts()
    assert len(moments) == 5 and len(set(moments)) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", moments[0])
    # Both servers' rows in the list, each with its server; the select charts the other one alone.
    servers = await page.locator("#result_list td.field-server_column .engines-server").all_inner_texts()
    assert set(servers) == {here, OTHER_SERVER}
    await page.select_option("#snapshot-charts-server-select", OTHER_SERVER)
    await page.click("#snapshot-charts-server button")
    await page.wait_for_selector("#snapshot-charts canvas")
    assert "server=gpu-box%3A9000" in page.url and "engine=demo" in page.url
    data = await page.evaluate("window.snapshotCharts.data")
    assert data["count"] == others
    decode = next(s["values"] for c in data["charts"] for s in c["series"] if s["label"] == "decode tok/s")
    assert max(v for v in decode if v is not None) >= 0.9 * OTHER_RATE  # its rate, not this server's
    # Its y axis as wide as its longest label ("1,000,000" once clipped to "00,000").
    assert await page.evaluate(Y_LABELS_FIT) == [True] * 5
    await show(page, page.url, "snapshots-other-server", "#snapshot-charts canvas")
    assert set(await page.locator("#result_list td.field-server_column .engines-server").all_inner_texts()) == {
        OTHER_SERVER}
    # In the admin's dark theme too (the system's colour scheme), for looking at.
    await page.emulate_media(color_scheme="dark")
    await page.set_viewport_size({"width": 1400, "height": 1000})
    await page.reload()
    await page.wait_for_selector("#snapshot-charts canvas")
    await page.screenshot(path=str(SHOTS / "history-snapshots-dark-1400.png"), full_page=True)
    assert await page.evaluate(AXES_IN_THEME) == [True] * 5
    await page.emulate_media(color_scheme="light")
    await page.wait_for_timeout(300)  # drawn again in the light colours
    assert await page.evaluate(AXES_IN_THEME) == [True] * 5

    # The request list: the latency columns on screen at both widths.
    await show(page, f"{base}/admin/engines/requestsummary/", "requests", "#result_list")
    assert await visible_columns(page) == ["request id", "trace", "finish reason", "prompt tokens",
                                           "completion tokens", "queue (ms)", "ttft (ms)", "e2e (ms)"]  # at 900 px
    ids = await text_lines(page, "#result_list .field-request_id .engines-one-line")
    assert set(LONG_IDS) <= {request["text"] for request in ids}
    assert all(request["lines"] == 1 and request["tooltip"] == request["text"] for request in ids), ids
    assert all(request["cut"] for request in ids if request["text"] in LONG_IDS)
    await page.set_viewport_size({"width": 1400, "height": 1000})
    assert len(await visible_columns(page)) == 14  # the diagnosis too (it gives way below 1024 px)
    assert await page.evaluate(OFF_SCREEN) == []

    # The profile list: each profile's page and download on screen.
    await show(page, f"{base}/admin/engines/profilerecord/", "profiles", "#result_list")
    for record in (first, second):
        link = page.locator(f'a[href="/dashboard/profiles/{record["profile_id"]}/profile.json.gz"]')
        box = await link.bounding_box()
        assert box and box["x"] + box["width"] <= 900, box

    # Two profiles compared: one direction in the title, the headers and every change.
    compare = f"/dashboard/profiles/compare/?a={first['profile_id']}&b={second['profile_id']}"
    await show(page, base + compare, "profile-compare", "#compare-kernels")
    assert await page.locator("h1").inner_text() == f"Profile #{second['profile_id']} against #{first['profile_id']}"
    assert "(B − A) / A" in await page.locator("#compare-kernels thead").inner_text()

    # Tens of seconds later the idle engine has added no snapshot: each would equal its last.
    assert snapshot_count(dashboard_server, IDLE) == idle_snapshots
