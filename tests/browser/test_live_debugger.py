"""The engine page's live debugger in a real browser: every request in the engine, sortable, with
its progress and the client's ids; the Abort button (asks first; the stream ends with ``abort``;
the history names who); the KV cache section. Screenshots at 1400 and 900 px in ``var/screenshots/``.
"""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.browser.conftest import SHOTS, LiveServer

pytestmark = pytest.mark.slow
SERVE_MODELS = ("demo",)

PROMPT = "Tell me about the tides of the sea, the moon that pulls them and the shores they wash, at length."


def streams(base: str, users: list[str], finished: dict[str, list], stop: threading.Event,
            **extra) -> list[threading.Thread]:
    """One long stream per user in the background; each one's SSE payloads land in ``finished``."""
    def run(user: str) -> None:
        body = {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1500,
                "stream": True, "user": user, "debug_config": {"ignore_eos": True}, **extra.get(user, {})}
        events = []
        with httpx.Client(base_url=base, timeout=120) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                    if stop.is_set():
                        break
        finished[user] = events

    threads = [threading.Thread(target=run, args=(user,), daemon=True) for user in users]
    for thread in threads:
        thread.start()
    return threads


async def rows(page) -> list[dict]:
    return await page.eval_on_selector_all("#live tbody tr[data-request-id]", """trs => trs.map(tr => ({
        id: tr.dataset.requestId, state: tr.dataset.state,
        cells: [...tr.children].map(td => td.textContent)}))""")


async def test_the_live_table_sorts_aborts_and_the_kv_section_opens(page, dashboard_server: LiveServer) -> None:
    base = dashboard_server.base
    await page.goto(f"{base}/dashboard/engines/demo/")
    await page.wait_for_selector('#connection[data-state="open"]', timeout=15000)
    finished: dict[str, list] = {}
    stop = threading.Event()
    users = ["browser-a", "browser-b", "browser-c"]
    threads = streams(base, users, finished, stop,
                      **{"browser-b": {"temperature": 0.6, "top_p": 0.9, "response_format": {"type": "json_object"}}})
    try:
        await page.wait_for_function(
            "() => document.querySelectorAll('#live tbody tr[data-state=decoding]').length === 3", timeout=60000)
        live = {row["id"]: row for row in await rows(page)}
        headers = await page.locator("#live thead th").all_text_contents()
        assert headers[:4] == ["request id", "state", "age", "queued"]
        b = dict(zip(headers, live["browser-b"]["cells"], strict=True))
        assert b["grammar"] == "json_object" and b["sampling"] == "T 0.6 · p 0.9"
        assert live["browser-a"]["cells"][headers.index("grammar")] == "no"
        assert b["output / max"].endswith("/ 1,500") and int(b["KV pages"]) >= 1
        assert b["prompt: cached / computed / left"].endswith("/ 0")  # the prefill is done
        # Sort by age: ascending puts the newest first, the other way the oldest.
        age = page.locator('#live thead th[data-sort="age_s"] button')
        await age.click()
        assert await page.get_attribute('#live thead th[data-sort="age_s"]', "aria-sort") == "ascending"
        await page.wait_for_timeout(600)  # redrawn by later snapshots: the order holds
        ascending = [row["id"] for row in await rows(page)]
        await age.click()
        assert await page.get_attribute('#live thead th[data-sort="age_s"]', "aria-sort") == "descending"
        assert [row["id"] for row in await rows(page)] == ascending[::-1]
        # The KV section: counts that add up, and each stream's pages.
        await page.wait_for_function("() => document.querySelectorAll('#kv-requests tbody tr:not(.empty)').length >= 3")
        figures = dict(zip(await page.locator("#kv-figures th").all_text_contents(),
                           await page.locator("#kv-figures td").all_text_contents(), strict=True))
        def pages(label: str) -> int:
            return int(next(v for k, v in figures.items() if k.startswith(label)).split()[0].replace(",", ""))

        assert pages("pages (16 tokens each)") == pages("used") + pages("cached") + pages("free") == 4096 // 16
        held = await page.locator("#kv-requests tbody tr").all_text_contents()
        assert all(any(row.startswith(user) for row in held) for user in users)
        # The KV chart draws the prefix cache's hit rate over time beside its use.
        series = await page.evaluate("window.enginePage.charts.kv.plot.series.map((s) => s.label)")
        assert "prefix hit rate" in series
        # Evictions over time: beside the preemptions, as a rate of the engine's count.
        labels = await page.evaluate("window.enginePage.charts.preemptions.plot.series.map((s) => s.label)")
        assert "KV evictions/s" in labels
        rate = await page.evaluate("""async () => {
          const { Derivation } = await import('/static/engines/js/charts.js');
          const d = new Derivation(5);
          d.next(100, { num_kv_evictions: 10, num_preemptions: 0 });
          return d.next(102, { num_kv_evictions: 16, num_preemptions: 0 }).evictions;
        }""")
        assert rate == 3
        await page.locator("#live-module").screenshot(path=str(SHOTS / "live-requests-1400.png"))
        await page.locator("#kv-module").screenshot(path=str(SHOTS / "kv-cache-1400.png"))
        await page.screenshot(path=str(SHOTS / "engine-live-debugger-1400.png"), full_page=True)
        await page.set_viewport_size({"width": 900, "height": 1000})
        await page.wait_for_timeout(500)
        assert await page.evaluate("document.scrollingElement.scrollWidth") <= 900
        await page.locator("#live-module").screenshot(path=str(SHOTS / "live-requests-900.png"))
        await page.locator("#kv-module").screenshot(path=str(SHOTS / "kv-cache-900.png"))
        await page.set_viewport_size({"width": 1400, "height": 1000})

        # Abort asks first: dismissed, nothing happens.
        dialogs: list[str] = []

        async def dismiss(dialog) -> None:
            dialogs.append(dialog.message)
            await dialog.dismiss()

        page.once("dialog", dismiss)
        await page.click('#live button[data-abort="browser-a"]')
        await page.wait_for_timeout(700)
        assert dialogs and "browser-a" in dialogs[0]
        assert "browser-a" in {row["id"] for row in await rows(page)}

        async def accept(dialog) -> None:
            await dialog.accept()

        page.once("dialog", accept)
        await page.click('#live button[data-abort="browser-a"]')
        await page.wait_for_selector("#action-log li.success >> text=request browser-a was aborted", timeout=15000)
        await page.wait_for_function(
            "() => !document.querySelector('#live tbody tr[data-request-id=\"browser-a\"]')", timeout=15000)
        for thread in threads[:1]:
            thread.join(30)
        events = finished["browser-a"]
        assert events[-1] == "[DONE]"
        reasons = [c["finish_reason"] for e in events[:-1] for c in json.loads(e).get("choices", [])]
        assert reasons[-1] == "abort"
        assert {row["id"] for row in await rows(page)} == {"browser-b", "browser-c"}
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    # The history keeps who did it.
    await page.goto(f"{base}/admin/engines/fleetjob/?action=abort_request")
    listed = await page.locator("#result_list tbody tr").all_text_contents()
    assert len(listed) == 1 and "admin" in listed[0] and "1 done" in listed[0], listed
    await page.screenshot(path=str(SHOTS / "admin-abort-history.png"), full_page=True)


async def shots_that_fit(page, name: str) -> None:
    """Full-page screenshots ``<name>-1400.png`` and ``<name>-900.png``; nothing off screen at 900 px."""
    await page.screenshot(path=str(SHOTS / f"{name}-1400.png"), full_page=True)
    await page.set_viewport_size({"width": 900, "height": 1000})
    await page.wait_for_timeout(300)
    assert await page.evaluate("document.scrollingElement.scrollWidth") <= 900
    await page.screenshot(path=str(SHOTS / f"{name}-900.png"), full_page=True)
    await page.set_viewport_size({"width": 1400, "height": 1000})


async def test_a_request_page_from_the_live_table_shows_where_its_time_went(page, dashboard_server: LiveServer) -> None:
    """Live table -> the request's page (live; it reloads itself when the request ends) -> its
    waterfall and diagnosis; the recent table says why; the saved trace's summary draws the same."""
    base = dashboard_server.base
    await page.goto(f"{base}/dashboard/engines/demo/")
    await page.wait_for_selector('#connection[data-state="open"]', timeout=15000)
    finished: dict[str, list] = {}
    stop = threading.Event()
    threads = streams(base, ["anatomy/one"], finished, stop,
                      **{"anatomy/one": {"max_tokens": 250, "stream_options": {"include_usage": True}}})
    try:
        link = page.locator('#live tbody tr[data-request-id="anatomy/one"] a.request-id')
        await link.wait_for(timeout=60000)
        await link.click()
        await page.wait_for_selector('.request-page[data-where="live"]', timeout=15000)
        assert await page.locator("#request-live").is_visible()
        await page.screenshot(path=str(SHOTS / "request-live-1400.png"), full_page=True)
        # It ends: the page reloads by itself and draws where its time went.
        await page.wait_for_selector('.request-page[data-where="ended"]', timeout=90000)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    usage = json.loads(finished["anatomy/one"][-2])["usage"]["extra"]
    phases = await page.eval_on_selector_all("#anatomy tbody tr", "trs => trs.map(tr => tr.dataset.phase)")
    assert phases == [p for p, s in usage["time_breakdown"].items() if s > 0]
    widths = await page.eval_on_selector_all(".anatomy-bar", "bars => bars.map(b => b.getBoundingClientRect().width)")
    assert widths and all(w >= 2 for w in widths)  # every phase that took time is seen
    await shots_that_fit(page, "request-waterfall")

    # The engine page's recent table links it and says why; saving the trace keeps its anatomy.
    await page.goto(f"{base}/dashboard/engines/demo/")
    recent = page.locator("#recent tbody tr", has_text="anatomy/one")
    await recent.wait_for(timeout=15000)
    why = await recent.locator("td.diagnosis-cell").text_content()
    assert why == (usage["diagnosis"][0] + (f" (+{len(usage['diagnosis']) - 1})" if len(usage["diagnosis"]) > 1
                                             else "") if usage["diagnosis"] else "—")
    await page.locator("#recent-module").screenshot(path=str(SHOTS / "recent-why-1400.png"))
    await page.click("#save-trace-button")
    await page.wait_for_selector("#action-log li.success a", timeout=30000)
    await page.goto(f"{base}/admin/engines/requestsummary/?engine=demo&q=anatomy%2Fone")
    await page.click("#result_list tbody tr a >> nth=0")
    await page.wait_for_selector("#anatomy")
    saved = await page.eval_on_selector_all("#anatomy tbody tr", "trs => trs.map(tr => tr.dataset.phase)")
    assert saved == phases
    await shots_that_fit(page, "history-request-waterfall")
    await page.goto(f"{base}/admin/engines/requestsummary/?e2e_over=0&o=-11")
    await page.screenshot(path=str(SHOTS / "history-slow-requests-1400.png"), full_page=True)
