"""The fleet page in a real browser: two live servers of ours sharing a Redis and a database,
and a foreign (vLLM-like) server attached from one's page, all seen from the other's; a server
that stops shows as stopped. Screenshots in ``var/screenshots/fleet-*.png``."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis

from tests.browser.conftest import PASSWORD, REPO, SHOTS, LiveServer, free_port, sign_in
from tests.fleet.conftest import REDIS_URL
from tests.fleet.fake_server import FakeServer
from tests.processes import migrate_and_add_admin

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet_servers(tmp_path_factory) -> Iterator[tuple[LiveServer, LiveServer, str]]:
    var = tmp_path_factory.mktemp("fleet-var")
    name = f"browser-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env |= {"DEBUGSITE_VAR_DIR": str(var), "PYTHONUNBUFFERED": "1", "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
            "REDIS_URL": REDIS_URL, "FLEET_NAME": name}
    manage = [sys.executable, "manage.py"]
    migrate_and_add_admin(env)
    servers = []
    for engine in ("demo", "demo-b"):
        port = free_port()
        command = manage + ["serve", "--model", "demo" if engine == "demo" else f"demo:{engine}", "--port", str(port),
                            "--backend", "cpu", "--max-num-seqs", "4", "--max-total-tokens", "1024", "--enable-tracing",
                            "--drain-timeout", "1"]
        servers.append(LiveServer(command, env, f"http://127.0.0.1:{port}"))
    yield servers[0], servers[1], name
    for server in servers:
        if server.process.poll() is None:
            server.stop()
    client = redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"fleet:{name}:*"))
    if keys:
        client.delete(*keys)


async def signed_in(browser, base: str):
    """A page of its own browser context (cookies ignore ports: the servers share a host)."""
    context = await browser.new_context(viewport={"width": 1400, "height": 1000})
    page = await context.new_page()
    return page, await sign_in(page, base, "/dashboard/fleet/")


async def test_two_servers_and_a_foreign_one_in_one_grid_from_either(fleet_servers, browser) -> None:
    first, second, name = fleet_servers
    foreign = FakeServer()
    try:
        page_a, errors_a = await signed_in(browser, first.base)
        # Both of ours, with their engines, on the first server's page.
        await page_a.wait_for_function(
            """() => document.querySelectorAll('#fleet-body tr.fleet-row').length === 2 &&
                     document.querySelectorAll('#fleet-body tr.fleet-group').length === 2""", timeout=30000)
        assert {await el.get_attribute("data-engine") for el in await page_a.query_selector_all("tr.fleet-row")} \
            == {"demo", "demo-b"}
        summary = await page_a.text_content("#fleet-summary")
        assert f"fleet “{name}”, shared over Redis" in summary and "2 server(s), 2 engine(s)" in summary
        # Attach the foreign server from the first server's form.
        await page_a.fill("#attach-url", foreign.url)
        await page_a.fill("#attach-name", "vllm-gpu-1")
        await page_a.fill("#attach-key", "sk-browser-secret")
        await page_a.click("#fleet-attach input[type=submit]")
        await page_a.wait_for_function(
            "() => document.getElementById('attach-result').textContent"
            ".startsWith('attached vllm-gpu-1 (vllm 0.11.0)')",
            timeout=15000)
        # The second server's page shows all three, the foreign one with its model and "n/e" nowhere
        # it exports the quantity.
        page_b, errors_b = await signed_in(browser, second.base)
        await page_b.wait_for_function(
            """() => [...document.querySelectorAll('#fleet-body tr.fleet-row')]
                     .some(tr => tr.dataset.engine === 'meta-llama/Llama-3.1-8B-Instruct'
                                 && tr.querySelector('[data-field=load]').textContent === '4 / 1')""",
            timeout=30000)
        assert await page_b.text_content('[data-total="servers"]') == "3 / 3"
        assert "sk-browser-secret" not in await page_b.content()
        await page_b.screenshot(path=str(SHOTS / "fleet-three-servers.png"), full_page=True)
        await page_b.select_option("#fleet-group", "model")
        await page_b.wait_for_function("() => document.querySelectorAll('#fleet-body tr.fleet-group').length === 2")
        await page_b.screenshot(path=str(SHOTS / "fleet-by-model.png"), full_page=True)
        await page_b.select_option("#fleet-group", "server")
        # One job on every engine shown: ours reset, the vLLM one through its /reset_prefix_cache.
        await page_b.check("#fleet-pick-all")
        assert await page_b.text_content("#fleet-selected") == "3 engines selected"
        await page_b.click('#fleet-actions button[data-action="reset"]')
        await page_b.wait_for_function(
            "() => document.getElementById('fleet-job-title').textContent.includes('finished, all done')",
            timeout=30000)
        assert [await el.text_content() for el in await page_b.query_selector_all("#fleet-job-body .state")] \
            == ["done"] * 3
        assert [path for path, _ in foreign.posts] == ["/reset_prefix_cache"]
        await page_b.screenshot(path=str(SHOTS / "fleet-job-done.png"), full_page=True)
        server_of = dict(await page_b.evaluate(
            "() => [...document.querySelectorAll('#fleet-job-body tr')].map((tr) => [tr.cells[1].textContent,"
            " tr.cells[0].textContent])"))
        first_id, second_id = server_of["demo"], server_of["demo-b"]
        # A request on each server, then one job saving both traces: they open as one timeline.
        for base, engine in ((first.base, "demo"), (second.base, "demo-b")):
            reply = httpx.post(f"{base}/v1/completions", json={"model": engine, "prompt": "Hi", "max_tokens": 4},
                               timeout=60)
            assert reply.status_code == 200
        await page_b.click('#fleet-actions button[data-action="save_trace"]')
        await page_b.wait_for_selector("#fleet-job-timeline:not([hidden])", timeout=30000)
        await page_b.click("#fleet-job-timeline a")
        await page_b.wait_for_url("**/dashboard/fleet/jobs/*/timeline/")
        await page_b.wait_for_function("() => window.timeline && window.timeline.stats.ready === true", timeout=30000)
        lanes = await page_b.evaluate("() => window.timeline.model.lanes.map((lane) => lane.label)")
        assert "demo @ " + first_id in lanes and "demo-b @ " + second_id in lanes, lanes
        await page_b.wait_for_timeout(500)
        await page_b.screenshot(path=str(SHOTS / "fleet-merged-timeline.png"), full_page=True)
        await page_b.goto(f"{second.base}/dashboard/fleet/")
        # A profile of the first server's engine, started and stopped from the second's page.
        await page_b.wait_for_selector('tr.fleet-row[data-engine="demo"] input[type=checkbox]')
        await page_b.check('tr.fleet-row[data-engine="demo"] input[type=checkbox]')
        for action, said in (("profile_start", "profiling"), ("profile_stop", "saved")):
            await page_b.click(f'#fleet-actions button[data-action="{action}"]')
            await page_b.wait_for_function(
                "() => document.getElementById('fleet-job-title').textContent.includes('finished')", timeout=30000)
            message = await page_b.text_content("#fleet-job-body tr td:last-child")
            assert said in message, message
            if action == "profile_start":
                await page_b.evaluate("() => { document.getElementById('fleet-job-title').textContent = ''; }")
                reply = httpx.post(f"{first.base}/v1/completions",
                                   json={"model": "demo", "prompt": "Hi", "max_tokens": 4}, timeout=60)
                assert reply.status_code == 200
        # A llama.cpp server: what it does not export reads "n/e", never 0.
        llama = FakeServer("llama.cpp")
        try:
            await page_b.fill("#attach-url", llama.url)
            await page_b.fill("#attach-name", "llama-cpp-1")
            await page_b.click("#fleet-attach input[type=submit]")
            ne = 'tr.fleet-row[data-server^="foreign-"] [data-field="ttft"]'
            await page_b.wait_for_function(
                f"""() => [...document.querySelectorAll('{ne}')].some(td => td.textContent === 'n/e')""",
                timeout=30000)
            await page_b.screenshot(path=str(SHOTS / "fleet-not-exported.png"), full_page=True)
        finally:
            llama.close()
        # The first server is killed (no goodbye): the second shows it gone, with when it was last seen.
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
        await page_b.wait_for_function(
            """() => [...document.querySelectorAll('#fleet-body tr.fleet-group .state')]
                     .some(el => el.textContent === 'gone')""", timeout=30000)
        detail = await page_b.text_content("#fleet-body tr.fleet-group:has(.state[data-state=gone])")
        assert "last seen" in detail
        await page_b.screenshot(path=str(SHOTS / "fleet-one-gone.png"), full_page=True)
        assert errors_a == [] and errors_b == []
    finally:
        foreign.close()


async def test_the_history_page_charts_the_fleet_with_its_jobs(fleet_servers, browser) -> None:
    first, second, _ = fleet_servers
    env = second.env | {"DJANGO_SETTINGS_MODULE": "debugsite.settings", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "tests.fleet.history_rows"], cwd=REPO, env=env, check=True)
    page, errors = await signed_in(browser, second.base)
    await page.goto(f"{second.base}/dashboard/fleet/history/?hours=1&ttft_ms=100&itl_ms=50")
    await page.wait_for_selector("#chart-latency .uplot")
    await page.wait_for_selector("#chart-within .uplot")
    assert await page.text_content('tr.slo-fleet [data-slo="ttft-within"]') == "90.0 %"
    await page.screenshot(path=str(SHOTS / "fleet-history.png"), full_page=True)
    assert errors == []
