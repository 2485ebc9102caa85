"""A disaggregated request followed across the fleet: a prefill server, a decode server and a
``--router disagg`` in front of them, all three members of one fleet sharing the test Redis and a
PostgreSQL database of their own. One "save trace" job from the decode server's fleet page takes
both engines' traces; they open as one timeline where the request's lanes on the two servers are
joined by its id, prefill before decode on the fleet's one clock."""
from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from collections.abc import Iterator

import httpx
import psycopg
import pytest
import redis

from tests.browser.conftest import PASSWORD  # the superuser's, as the browser tests sign in
from tests.fleet.conftest import REDIS_URL
from tests.processes import Server, migrate_and_add_admin, start_server

pytestmark = pytest.mark.slow

PG = os.environ.get("PG_TEST_URL", "postgres://postgres@127.0.0.1:5432/postgres")

SERVE = ["--model", "demo", "--enable-debug", "--enable-tracing", "--backend", "cpu", "--max-num-seqs", "4",
         "--max-total-tokens", "1024", "--prefill-chunk-size", "64"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[Server, Server, Server, str]]:
    """(prefill, decode, router, fleet name): three servers of one fleet on a fresh database."""
    suffix = uuid.uuid4().hex[:8]
    database, name = f"fleet_e2e_{suffix}", f"e2e-{suffix}"
    with psycopg.connect(PG, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{database}"')
    env = {"REDIS_URL": REDIS_URL, "FLEET_NAME": name,
           "DATABASE_URL": PG.rsplit("/", 1)[0] + "/" + database, "DJANGO_SUPERUSER_PASSWORD": PASSWORD}
    var = tmp_path_factory.mktemp("fleet-e2e")
    setup_env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"} | env \
        | {"DEBUGSITE_VAR_DIR": str(var)}
    migrate_and_add_admin(setup_env)
    decode = start_server(SERVE, var / "decode", env=env)
    prefill = start_server([*SERVE, "--engine-mode", "thread"], var / "prefill", env=env)
    router = start_server(["--router", "disagg", "--prefill-url", prefill.base, "--decode-url", decode.base],
                          var / "router", env=env)
    try:
        yield prefill, decode, router, name
    finally:
        for server in (router, prefill, decode):
            server.stop()
        client = redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"fleet:{name}:*"))
        if keys:
            client.delete(*keys)
        with psycopg.connect(PG, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def staff_browser(server: Server) -> httpx.Client:
    """An httpx client signed in to ``server``'s admin, as a browser is."""
    client = httpx.Client(base_url=server.base, timeout=60, follow_redirects=True)
    client.get("/admin/login/")
    reply = client.post("/admin/login/?next=/dashboard/fleet/", data={
        "username": "admin", "password": PASSWORD, "csrfmiddlewaretoken": client.cookies[server.csrf_cookie],
        "next": "/dashboard/fleet/"})
    assert reply.status_code == 200 and reply.url.path == "/dashboard/fleet/", reply.url
    return client


def test_one_disaggregated_request_on_one_timeline_across_the_fleet(fleet) -> None:
    prefill, decode, router, name = fleet
    # The three members see one another; the router lists its own lane, not an engine of a model.
    deadline = time.monotonic() + 30
    while True:
        view = decode.http.get("/fleet.json").json()
        by_port = {int(s["url"].rsplit(":", 1)[1]): s for s in view["servers"] if s["url"]}
        if len(by_port) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert view["fleet"] == name and set(by_port) == {prefill.port, decode.port, router.port}
    assert by_port[router.port]["roles"] == ["router"] and by_port[router.port]["engines"] == 1
    prefill_id, decode_id = by_port[prefill.port]["server"], by_port[decode.port]["server"]
    router_id = by_port[router.port]["server"]

    done = router.openai.completions.create(model="demo", prompt=list(range(300, 352)), max_tokens=8,
                                            temperature=0, user="fleet-e2e")
    assert done.usage.completion_tokens == 8

    page = staff_browser(decode)
    headers = {"X-CSRFToken": page.cookies[decode.csrf_cookie]}
    submitted = page.post("/dashboard/fleet/jobs/", headers=headers, json={"action": "save_trace", "targets": [
        {"server": prefill_id, "engine": "demo"}, {"server": decode_id, "engine": "demo"},
        {"server": router_id, "engine": "router"}]})
    assert submitted.status_code == 201, submitted.text
    deadline = time.monotonic() + 60
    while True:
        job = page.get(submitted.json()["url"]).json()
        if job["finished_at"] is not None or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert [t["state"] for t in job["targets"]] == ["done", "done", "done"], job
    # Each server measured its clock against Redis's, to well under a millisecond on one machine.
    assert all(abs(t["result"]["clock_offset_us"]) < 50_000 and t["result"]["clock_uncertainty_us"] < 50_000
               for t in job["targets"])
    # Each trace record names the server that ran its target (not the decode server, which asked)
    # and the fleet, in the shared database's admin.
    for target in job["targets"]:
        record = page.get(f"/admin/engines/tracerecord/{target['result']['record_id']}/change/").text
        shown = ":<wbr>".join(target["server"].rsplit(":", 1))  # host:port breaks after its colon
        named = f'<span class="engines-server">{shown}</span><span class="engines-quiet">fleet {name}</span>'
        assert named in record, target
    servers = page.get("/admin/engines/tracerecord/", params={"server": prefill_id}).text
    assert servers.count('<td class="field-server_column">') == 1
    assert f'{prefill_id.rsplit(":", 1)[1]}</span>' in servers

    merged = page.get(f"/dashboard/fleet/jobs/{job['id']}/trace.json").json()
    events = merged["traceEvents"]
    pids = {ev["args"]["name"]: ev["pid"] for ev in events if ev.get("name") == "process_name"}
    assert set(pids) == {f"demo @ {prefill_id}", f"demo @ {decode_id}", f"router @ {router_id}"}
    flows = [ev for ev in events if ev.get("ph") in ("s", "f") and ev.get("name", "").startswith("request fleet-e2e")]
    starts = {ev["id"]: ev for ev in flows if ev["ph"] == "s"}
    hops = [(starts[ev["id"]], ev) for ev in flows if ev["ph"] == "f"]
    assert len(hops) >= 2 and len(starts) == len(hops), flows
    prefill_pid, decode_pid = pids[f"demo @ {prefill_id}"], pids[f"demo @ {decode_id}"]
    router_pid = pids[f"router @ {router_id}"]
    # The path as it ran: the router asks the decode server to ready its pages, the prefill server
    # to compute and send the K/V, the decode server to adopt it and generate; each hop forward in time.
    path = [hops[0][0]["pid"]] + [f["pid"] for _, f in hops]
    assert path[0] == router_pid and path[-1] == decode_pid, path
    servers_in_order = [pid for i, pid in enumerate(path) if pid != router_pid]
    assert servers_in_order[0] == decode_pid and prefill_pid in servers_in_order, path
    assert servers_in_order.index(prefill_pid) < len(servers_in_order) - 1  # decode again after prefill
    assert all(s["ts"] <= f["ts"] for s, f in hops)
    request_id = re.sub(r"^request ", "", hops[0][0]["name"])
    lanes = [ev for ev in events if ev.get("name") == "thread_name" and ev["args"]["name"] == request_id]
    assert {ev["pid"] for ev in lanes} == set(pids.values())  # its lane on all three servers
    timeline = page.get(f"/dashboard/fleet/jobs/{job['id']}/timeline/")
    assert timeline.status_code == 200 and "3 traces" in timeline.text
    asyncio.run(screenshot_timeline(decode.base, f"/dashboard/fleet/jobs/{job['id']}/timeline/", request_id))


async def screenshot_timeline(base: str, path: str, request_id: str) -> None:
    """The merged timeline in chromium, found by the request's id (saved for looking at)."""
    from playwright.async_api import async_playwright

    from tests.browser.conftest import CHROMIUM, SHOTS, sign_in

    SHOTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM)
        page = await (await browser.new_context(viewport={"width": 1400, "height": 900})).new_page()
        errors = await sign_in(page, base, "/dashboard/fleet/")
        await page.goto(base + path)
        await page.wait_for_function("() => window.timeline && window.timeline.stats.ready === true", timeout=30000)
        labels = await page.evaluate("() => window.timeline.model.lanes.map((lane) => lane.label)")
        assert labels.count(request_id) == 3, labels          # its lane on each server
        await page.screenshot(path=str(SHOTS / "fleet-disagg-timeline.png"), full_page=True)
        await browser.close()
    assert errors == []


def test_one_of_ours_without_redis_joins_by_url(fleet, tmp_path) -> None:
    """A server of ours outside the fleet's Redis (its own SQLite, no REDIS_URL) attached by URL:
    read through the alias table as kind "ours", every quantity exported, its reset a /debug call."""
    _, decode, _, _ = fleet
    loner = start_server(SERVE, tmp_path / "loner")
    try:
        page = staff_browser(decode)
        headers = {"X-CSRFToken": page.cookies[decode.csrf_cookie]}
        attached = page.post("/dashboard/fleet/attach/", headers=headers, json={"url": loner.base, "name": "loner"})
        assert attached.status_code == 201 and attached.json()["kind"] == "ours", attached.text
        deadline = time.monotonic() + 30
        while True:
            view = decode.http.get("/fleet.json").json()
            rows = [r for r in view["rows"] if r["kind"] == "ours" and r["server"].startswith("foreign-")]
            if (rows and rows[0]["figures"].get("generation_tokens") is not None) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        (row,) = rows
        assert row["engine"] == "demo" and row["state"] == "up" and row["not_exported"] == []
        job = page.post("/dashboard/fleet/jobs/", headers=headers, json={"action": "reset", "targets": [
            {"server": row["server"], "engine": "demo"}]})
        deadline = time.monotonic() + 30
        while True:
            state = page.get(job.json()["url"]).json()
            if state["finished_at"] is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [(t["state"], t["message"]) for t in state["targets"]] == [("done", "POST /debug/reset_engine: 200")]
    finally:
        loner.stop()
