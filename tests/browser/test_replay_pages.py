"""Capture, replay, compare in the browser (issue 62's "done when"): bursty traffic to the
dashboard's server, its flight recorder saved from the engine page, the workload replayed from
its page onto that server and onto a second one that runs one sequence at a time, and the report
page saying TTFT p90 is worse beyond noise, with the flag that differs. Screenshots
``replay-workload-*``, ``replay-run-*`` and ``replay-report-*`` at 1400 and 900 px in ``var/screenshots/``."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.browser.conftest import SHOTS, LiveServer
from tests.browser.test_live_debugger import shots_that_fit
from tests.processes import Server, start_server

pytestmark = pytest.mark.slow
SERVE_MODELS = ("demo",)
BURSTS, BURST = 2, 8


@pytest.fixture(scope="module")
def narrow_server(tmp_path_factory) -> Iterator[Server]:
    server = start_server(["--model", "demo", "--enable-debug", "--enable-tracing", "--backend", "cpu",
                           "--max-num-seqs", "1"], tmp_path_factory.mktemp("narrow"))
    yield server
    server.stop()


def bursts(base: str) -> None:
    """Two bursts of eight concurrent requests, a second apart (what the recorder keeps)."""
    def one(i: int) -> None:
        reply = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": "demo", "prompt": f"burst request {i} " * 4, "max_tokens": 24, "temperature": 0,
            "debug_config": {"ignore_eos": True}})
        assert reply.status_code == 200

    for burst in range(BURSTS):
        threads = [threading.Thread(target=one, args=(burst * BURST + i,)) for i in range(BURST)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


async def replay(page, target: str) -> str:
    """Fill the workload page's replay form for ``target``; the run's URL, once its page says done."""
    await page.fill("#replay-target", target)
    await page.click("#replay-submit")
    await page.wait_for_url("**/replayrunrecord/*/change/")
    run_url = page.url
    for _ in range(180):  # the page reloads itself while the run is running; load it afresh meanwhile
        await page.goto(run_url)
        if await page.locator("#run-running").count() == 0:
            break
        await page.wait_for_timeout(1000)
    assert await page.locator("#run-config").count() == 1, await page.text_content("#content")
    return run_url


async def test_a_workload_saved_from_the_dashboard_replays_and_the_report_says_what_changed(
        page, dashboard_server: LiveServer, narrow_server: Server) -> None:
    base = dashboard_server.base
    bursts(base)
    await page.goto(f"{base}/dashboard/engines/demo/")
    await page.wait_for_selector('#connection[data-state="open"]', timeout=15000)
    await page.click("#save-workload")
    link = page.locator("#action-log li.success a")
    await link.wait_for(timeout=30000)
    assert f"{BURSTS * BURST} requests" in await page.text_content("#action-log li.success")
    await page.goto(base + await link.get_attribute("href"))
    await page.wait_for_selector("#replay-form")
    await shots_that_fit(page, "replay-workload")
    workload_url = page.url

    first = await replay(page, base)
    await page.goto(workload_url)
    second = await replay(page, narrow_server.base)
    await shots_that_fit(page, "replay-run")
    assert "max_num_seqs" in await page.text_content("#run-config")

    await page.select_option("#run-compare-a", value=first.rstrip("/").split("/")[-2])
    await page.click("#run-compare-form button")
    await page.wait_for_selector("#report-figures")
    row = page.locator("#report-figures tbody tr", has_text="TTFT p90")
    assert "slower beyond noise" in await row.text_content()
    config = await page.text_content("#report-config")
    assert "engine.config.max_num_seqs" in config
    assert f"{BURSTS * BURST} of {BURSTS * BURST}" in await page.text_content("#report-throughput")
    await page.wait_for_selector("#report-charts .uplot")
    assert await page.locator("#report-charts .uplot").count() == 3
    assert await page.locator("#report-phases tbody tr").count() > 0
    await shots_that_fit(page, "replay-report")
    markdown = httpx.get(page.url + "&format=md", cookies={c["name"]: c["value"] for c in await page.context.cookies()})
    assert "| TTFT p90 |" in markdown.text
    assert SHOTS.exists() and second
