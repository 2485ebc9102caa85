"""The fleet page in a real browser: two live servers of ours sharing a Redis and a database,
and a foreign (vLLM-like) server attached from one's page, all seen from the other's; a server
that stops shows as stopped. Screenshots in ``var/screenshots/fleet-*.png``."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
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
        # Under each name, the weights its engine computes with (the demo's floats: a Hugging Face folder).
        assert [await el.text_content() for el in await page_a.query_selector_all("tr.fleet-row .fleet-weights")] \
            == ["weights float32"] * 2
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
        assert re.search(r"last seen .+ ago \(\d\d:\d\d:\d\d\)", detail), detail  # the time in 24-hour
        await page_b.screenshot(path=str(SHOTS / "fleet-one-gone.png"), full_page=True)
        assert errors_a == [] and errors_b == []
    finally:
        foreign.close()


def tolerant_load(base: str, stop: threading.Event, clients: int = 4) -> list[threading.Thread]:
    """Streaming requests on ``demo`` until ``stop``; a server killed under them ends them quietly."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 200, "stream": True, "debug_config": {"ignore_eos": True}}

    def client() -> None:
        with httpx.Client(base_url=base, timeout=60) as http:
            while not stop.is_set():
                try:
                    with http.stream("POST", "/v1/chat/completions", json=body) as response:
                        for _ in response.iter_lines():
                            if stop.is_set():
                                return
                except httpx.HTTPError:
                    stop.wait(0.2)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    return threads


# The grid as it is on screen at one instant: each row's server state and cells, and the totals.
GRID = """() => ({
  rows: [...document.querySelectorAll('#fleet-body tr.fleet-row')].map((tr) => ({
    server: tr.dataset.server, engine: tr.dataset.engine, live: tr.dataset.live,
    load: tr.querySelector('[data-field=load]').textContent,
    decode: tr.querySelector('[data-field=decode]').textContent,
    cells: [...tr.querySelectorAll('td.num')].map((td) => td.textContent),
    last: tr.querySelector('.fleet-last').hidden ? null : tr.querySelector('.fleet-last').textContent,
    link: tr.querySelector('th a') ? tr.querySelector('th a').href : null})),
  groups: [...document.querySelectorAll('#fleet-body tr.fleet-group')].map((tr) => ({
    name: tr.querySelector('.fleet-group-name').textContent, state: tr.querySelector('.state').textContent,
    title: tr.querySelector('.state').title})),
  servers: document.querySelector('[data-total=servers]').textContent,
  engines: document.querySelector('[data-total=engines]').textContent,
  load: document.querySelector('[data-total=load]').textContent,
  decode: document.querySelector('[data-total=decode]').textContent,
})"""


def number(text: str) -> float:
    return float(text.replace(",", ""))


def assert_totals_are_the_live_rows(grid: dict) -> None:
    """The totals row equals the sum of the rows shown whose servers are up, at that instant."""
    live = [r for r in grid["rows"] if r["live"] == "yes"]
    running = sum(number(r["load"].split(" / ")[0]) for r in live)
    waiting = sum(number(r["load"].split(" / ")[1]) for r in live)
    assert grid["load"] == f"{running:.0f} / {waiting:.0f}", grid
    assert grid["engines"] == str(len(live)), grid
    # Each rate is shown rounded (0.1 below 100 tok/s, 1 above): the sum of those within their rounding.
    shown = [number(r["decode"]) for r in live]
    slack = sum(0.05 if v < 100 else 0.5 for v in shown) + (0.05 if number(grid["decode"]) < 100 else 0.5)
    assert abs(number(grid["decode"]) - sum(shown)) <= slack + 1e-9, grid


async def detach_all(page, base: str) -> None:
    """Detach every foreign server the fleet has (another test attached them), from the page."""
    view = httpx.get(f"{base}/fleet.json", timeout=10).json()
    for server in view["servers"]:
        if server["server"].startswith("foreign-"):
            pk = server["server"].removeprefix("foreign-")
            status = await page.evaluate(
                """async (url) => (await fetch(url, {method: 'POST', headers: {'X-CSRFToken':
                     document.querySelector('#fleet-attach [name=csrfmiddlewaretoken]').value}})).status""",
                f"{base}/dashboard/fleet/servers/{pk}/detach/")
            assert status == 200


async def test_a_killed_server_greys_out_and_its_restart_on_the_port_takes_its_place(fleet_servers, browser) -> None:
    first, second, _ = fleet_servers
    if first.process.poll() is not None:                          # the test above killed it
        first.process = first.start()
    port = first.base.rsplit(":", 1)[1]
    first_id = f"{socket.gethostname()}:{port}"                   # named host:port, not host:pid
    page, errors = await signed_in(browser, second.base)
    await detach_all(page, second.base)
    await page.wait_for_function(
        "() => document.querySelector('[data-total=servers]').textContent === '2 / 2' &&"
        " document.querySelectorAll('#fleet-body tr.fleet-row').length === 2", timeout=30000)
    stop = threading.Event()
    threads = tolerant_load(first.base, stop)
    try:
        await page.wait_for_function(
            """() => [...document.querySelectorAll('#fleet-body tr.fleet-row[data-engine=demo] [data-field=load]')]
                     .some((td) => td.textContent.startsWith('4 /'))""", timeout=60000)
        # Totals are summed from the rows on screen: equal to them at every instant, pushes included.
        for _ in range(20):
            assert_totals_are_the_live_rows(await page.evaluate(GRID))
            await page.wait_for_timeout(150)
        grid = await page.evaluate(GRID)
        (demo,) = [r for r in grid["rows"] if r["engine"] == "demo"]
        assert demo["server"] == first_id and demo["link"] == f"{first.base}/dashboard/engines/demo/"
        assert "no beat for 3 s (a heartbeat of 2 s + 1 s grace)" in grid["groups"][0]["title"]
        await page.screenshot(path=str(SHOTS / "fleet-before-kill.png"), full_page=True)
        # Killed under load (no goodbye): gone, live columns blank, last figures greyed "as of".
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    await page.wait_for_function(
        f"""() => [...document.querySelectorAll('#fleet-body tr.fleet-group')].some((tr) =>
                 tr.querySelector('.fleet-group-name').textContent === '{first_id}' &&
                 tr.querySelector('.state').textContent === 'gone')""", timeout=30000)
    grid = await page.evaluate(GRID)
    (ghost,) = [r for r in grid["rows"] if r["server"] == first_id]
    assert ghost["live"] == "no" and ghost["cells"][:6] == [""] * 6, ghost
    last = r"as of \d\d:\d\d:\d\d: \d+ running · \d+ waiting · KV .* · decode [\d.,]+ tok/s"
    assert re.fullmatch(last, ghost["last"]), ghost
    assert grid["servers"] == "1 / 2"
    assert_totals_are_the_live_rows(grid)                         # the ghost's figures count in no total
    await page.screenshot(path=str(SHOTS / "fleet-ghost.png"), full_page=True)
    await page.locator("#fleet").screenshot(path=str(SHOTS / "fleet-ghost-grid.png"))
    dark = await browser.new_context(viewport={"width": 1400, "height": 1000}, color_scheme="dark")
    dark_page = await dark.new_page()
    await sign_in(dark_page, second.base, "/dashboard/fleet/")
    await dark_page.wait_for_selector("#fleet-body tr.fleet-row[data-live=no]")
    await dark_page.screenshot(path=str(SHOTS / "fleet-ghost-dark.png"), full_page=True)
    await dark_page.locator("#fleet").screenshot(path=str(SHOTS / "fleet-ghost-grid-dark.png"))
    await dark.close()
    # Back on the same port: the same server, in its own place, not beside its ghost.
    first.process = first.start()
    await page.wait_for_function(
        "() => document.querySelector('[data-total=servers]').textContent === '2 / 2'", timeout=30000)
    grid = await page.evaluate(GRID)
    assert len(grid["groups"]) == 2 and first_id in [g["name"] for g in grid["groups"]]
    assert {g["state"] for g in grid["groups"]} == {"up"}
    assert sorted(r["engine"] for r in grid["rows"]) == ["demo", "demo-b"]
    assert all(r["live"] == "yes" and r["last"] is None for r in grid["rows"])
    await page.screenshot(path=str(SHOTS / "fleet-ghost-replaced.png"), full_page=True)
    assert errors == []


async def test_the_history_page_charts_the_fleet_with_its_jobs(fleet_servers, browser) -> None:
    first, second, _ = fleet_servers
    env = second.env | {"DJANGO_SETTINGS_MODULE": "debugsite.settings", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "tests.fleet.history_rows"], cwd=REPO, env=env, check=True)
    page, errors = await signed_in(browser, second.base)
    await page.goto(f"{second.base}/dashboard/fleet/history/?hours=1&ttft_ms=100&itl_ms=50")
    await page.wait_for_selector("#chart-latency .uplot")
    await page.wait_for_selector("#chart-within .uplot")
    # The live servers of this module add their own rollups to the fleet's row; the written ones
    # are read on their servers' rows: 25 minutes at 95 % and 5 at 65 % on a:1, 90 % on b:2.
    for server in ("a:1", "b:2"):
        cell = f'tr.slo-server[data-label="{server}"] [data-slo="ttft-within"]'
        assert await page.text_content(cell) == "90.0 %", server
    assert (await page.text_content('tr.slo-fleet [data-slo="ttft-within"]')).endswith(" %")
    await page.screenshot(path=str(SHOTS / "fleet-history.png"), full_page=True)
    assert errors == []


# Where each chart drew its one non-null value, and the canvas pixel there.
LONE_POINTS = """() => Object.fromEntries(Object.entries(window.fleetHistoryCharts).map(([name, chart]) => {
  const u = chart.plot;
  const i = u.data[1].findIndex((v) => v != null);
  const x = Math.round(u.valToPos(u.data[0][i], 'x', true));
  const y = Math.round(u.valToPos(u.data[1][i], 'y', true));
  return [name, {count: u.data[1].filter((v) => v != null).length, inside: x > u.bbox.left &&
                 x < u.bbox.left + u.bbox.width, pixel: [...u.ctx.getImageData(x, y, 1, 1).data]}];
}))"""


async def test_a_load_of_one_minute_is_drawn_as_a_point_on_the_history_charts(fleet_servers, browser) -> None:
    _, second, _ = fleet_servers
    env = second.env | {"DJANGO_SETTINGS_MODULE": "debugsite.settings", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "tests.fleet.history_rows", "one-minute"], cwd=REPO, env=env, check=True)
    page, errors = await signed_in(browser, second.base)
    await page.goto(f"{second.base}/dashboard/fleet/history/?hours=1&of=server:c:3")
    await page.wait_for_function("() => window.fleetHistoryCharts && window.fleetHistoryCharts.within.plot")
    assert await page.text_content('[data-holds="latency"]') == "1 minute of data"
    drawn = await page.evaluate(LONE_POINTS)
    for name, chart in drawn.items():
        red, green, blue, alpha = chart["pixel"]
        assert chart["count"] == 1 and chart["inside"], (name, chart)
        # TTFT's colour (#417690) where its lone value is, not the empty canvas.
        assert alpha > 200 and abs(red - 0x41) < 40 and abs(green - 0x76) < 40 and abs(blue - 0x90) < 40, (name, chart)
    await page.screenshot(path=str(SHOTS / "fleet-history-one-minute.png"), full_page=True)
    await page.goto(f"{second.base}/dashboard/fleet/history/?hours=1&of=server:idle:4")
    assert await page.text_content('[data-holds="latency"]') == "no data in this range"
    assert errors == []
