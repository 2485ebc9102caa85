"""The fleet on a server: its page, its JSON and socket with this server's engines, a second
server seen through the shared Redis, a foreign server attached by URL (the page's form and
manage.py) and polled, its API key never sent back."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import orjson
import pytest
from asgiref.sync import sync_to_async
from django.core.management import CommandError, call_command

from engines.dashboard.consumers import CLOSE_FORBIDDEN
from engines.server.server_identity import server_id
from engines.fleet import service as fleet
from engines.fleet.membership import ServerCard
from engines.fleet.rows import EngineRow, ServerRows
from engines.fleet.store import RedisFleetStore
from engines.registry import registry
from tests.fleet.conftest import REDIS_URL
from tests.fleet.fake_server import FakeServer
from tests.fleet.history_rows import make_history
from tests.server.conftest import TRACED, UNTRACED
from tests.server.test_dashboard_sockets import connected, of_type, next_message, open_socket, session_cookie

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def server() -> Iterator[FakeServer]:
    """A vLLM-like server on a free port (``tests/fleet/fake_server.py``)."""
    fake = FakeServer()
    yield fake
    fake.close()


@pytest.fixture
async def page(serve) -> AsyncIterator[httpx.AsyncClient]:
    """A staff member's browser on a server with both demo engines; the fleet service of this
    test's loop stopped afterwards."""
    cookie = (await session_cookie()).decode().split("=", 1)[1]
    async with serve(enable_debug=True) as http:
        http.cookies.set("sessionid", cookie)
        yield http
        await fleet.fleet_service().stop()


@pytest.fixture
async def shared_fleet(page: httpx.AsyncClient, settings) -> AsyncIterator[RedisFleetStore]:
    """This test's server in a fleet of its own on the test Redis, and a store on it for playing
    the other members; the fleet's keys deleted after."""
    import redis.asyncio as aioredis

    name = f"test-{uuid.uuid4().hex[:8]}"
    settings.REDIS_URL, settings.FLEET_NAME = REDIS_URL, name
    await fleet.fleet_service().stop()
    fleet._services.clear()                                       # the next service is on the shared Redis
    other = RedisFleetStore(aioredis.from_url(REDIS_URL), name)
    yield other
    keys = [k async for k in other.redis.scan_iter(f"fleet:{name}:*")]
    await fleet.fleet_service().stop()
    if keys:
        await other.redis.delete(*keys)
    await other.redis.aclose()
    fleet._services.clear()


async def fleet_json(http: httpx.AsyncClient, until=lambda view: True, timeout: float = 10.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        response = await http.get("/fleet.json")
        assert response.status_code == 200, response.text
        view = response.json()
        if until(view) or asyncio.get_running_loop().time() > deadline:
            return view
        await asyncio.sleep(0.2)


async def csrf(http: httpx.AsyncClient) -> dict[str, str]:
    page = await http.get("/dashboard/fleet/")
    assert page.status_code == 200
    return {"X-CSRFToken": http.cookies["csrftoken"]}


async def test_the_fleet_page_is_staff_only_and_in_the_admins_frame(page: httpx.AsyncClient, serve) -> None:
    html = (await page.get("/dashboard/fleet/")).text
    assert 'class="breadcrumbs"' in html and "engines/js/fleet.js" in html and 'id="fleet-attach"' in html
    overview = (await page.get("/dashboard/")).text
    assert 'href="/dashboard/fleet/"' in overview
    async with serve(enable_debug=True) as anonymous:
        assert (await anonymous.get("/dashboard/fleet/")).status_code == 302
    # /fleet.json is an API route: the server's API key, as /stats.
    async with serve(enable_debug=True, api_key="k-9") as api:
        assert (await api.get("/fleet.json")).status_code == 401
        keyed = await api.get("/fleet.json", headers={"Authorization": "Bearer k-9"})
        assert keyed.status_code == 200 and keyed.json()["type"] == "fleet"


async def test_fleet_json_lists_this_server_and_its_engines(page: httpx.AsyncClient) -> None:
    view = await fleet_json(page, lambda v: len(v["rows"]) == 2)
    assert not view["shared"] and [s["server"] for s in view["servers"]] == [server_id()]
    (me,) = view["servers"]
    assert me["state"] == "up" and me["roles"] == ["engines"] and me["engines"] == 2
    rows = {row["engine"]: row for row in view["rows"]}
    assert set(rows) == {TRACED, UNTRACED}
    assert rows[TRACED]["state"] == "running" and rows[TRACED]["figures"]["running"] == 0
    assert "windows" not in rows[TRACED]                        # the histograms stay server-side
    assert view["totals"]["engines"] == 2 and view["totals"]["servers_up"] == 1


async def test_a_second_server_in_the_shared_redis_shows_up_and_goes(page: httpx.AsyncClient,
                                                                     shared_fleet: RedisFleetStore) -> None:
    other = shared_fleet
    await other.announce(ServerCard(server="other:9", url="http://10.0.0.9:8000", version="0.1.0",
                                    roles=["decode"], engines=[], started_at=0.0))
    await other.put_rows(ServerRows(server="other:9", at=0.0, rows=[EngineRow(
        server="other:9", engine="llama", model="llama-8b", state="running", at=0.0,
        figures={"running": 7.0, "waiting": 2.0})]))
    view = await fleet_json(page, lambda v: len(v["rows"]) == 3)
    assert view["shared"] and view["fleet"] == other.name
    servers = {s["server"]: s for s in view["servers"]}
    assert set(servers) == {server_id(), "other:9"} and servers["other:9"]["roles"] == ["decode"]
    assert view["totals"]["running"] == 7.0 and view["totals"]["waiting"] == 2.0
    await other.leave()
    view = await fleet_json(page)
    assert {s["server"]: s["state"] for s in view["servers"]}["other:9"] == "stopped"


async def test_the_fleets_keys_expire_as_fleet_key_ttl_s_says(page: httpx.AsyncClient,
                                                                shared_fleet: RedisFleetStore, settings) -> None:
    settings.FLEET_KEY_TTL_S = 30
    view = await fleet_json(page, lambda v: len(v["rows"]) == 2)
    assert view["shared"] and [s["state"] for s in view["servers"]] == ["up"]
    for key in ("cards", "beats", "rows"):
        assert 0 < await shared_fleet.redis.pttl(f"fleet:{shared_fleet.name}:{key}") <= 30_000, key


async def test_attaching_a_foreign_server_from_the_page(page: httpx.AsyncClient, server: FakeServer) -> None:
    headers = await csrf(page)
    for body, error in (({"url": "ftp://x"}, "is not an http(s) URL"), ({"url": server.url, "interval": 60},
                        "1 to 5 seconds"), ({"url": 5}, "strings")):
        refused = await page.post("/dashboard/fleet/attach/", json=body, headers=headers)
        assert refused.status_code == 400 and error in refused.json()["error"]
    assert (await page.post("/dashboard/fleet/attach/", content=b"{", headers=headers)).status_code == 400
    attached = await page.post("/dashboard/fleet/attach/", headers=headers,
                               json={"url": server.url + "/", "name": "gpu-1", "api_key": "sk-secret-123"})
    assert attached.status_code == 201, attached.text
    assert attached.json()["kind"] == "vllm" and attached.json()["url"] == server.url
    again = await page.post("/dashboard/fleet/attach/", json={"url": server.url}, headers=headers)
    assert again.status_code == 400 and "attached already" in again.json()["error"]
    view = await fleet_json(page, lambda v: any(r["kind"] == "vllm" for r in v["rows"]))
    gpu = next(s for s in view["servers"] if s["name"] == "gpu-1")
    assert gpu["state"] == "up" and gpu["kind"] == "vllm" and gpu["url"] == server.url
    (row,) = [r for r in view["rows"] if r["server"] == gpu["server"]]
    assert row["figures"]["running"] == 4 and row["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    text = (await page.get("/fleet.json")).text + (await page.get("/dashboard/fleet/")).text
    assert "sk-secret-123" not in text                            # the key stays on the server
    pk = int(gpu["server"].removeprefix("foreign-"))
    assert (await page.post(f"/dashboard/fleet/servers/{pk}/detach/", headers=headers)).status_code == 200
    assert (await page.post(f"/dashboard/fleet/servers/{pk}/detach/", headers=headers)).status_code == 404
    view = await fleet_json(page)
    assert all(s["name"] != "gpu-1" for s in view["servers"])


def test_manage_py_fleet_attach_list_detach(server: FakeServer, capsys) -> None:
    call_command("fleet", "attach", server.url, "--name", "box", "--api-key", "k-1")
    assert "Attached box: vllm" in capsys.readouterr().out
    call_command("fleet", "list")
    listed = capsys.readouterr().out
    assert "box\tvllm\t" + server.url in listed and "API key set" in listed and "k-1" not in listed
    with pytest.raises(CommandError, match="attached already"):
        call_command("fleet", "attach", server.url)
    with pytest.raises(CommandError, match="not an http"):
        call_command("fleet", "attach", "localhost:8000")
    call_command("fleet", "detach", "box")
    with pytest.raises(CommandError, match="no attached server"):
        call_command("fleet", "detach", "box")


async def test_the_fleet_socket_sends_the_view_and_refuses_non_staff(page: httpx.AsyncClient) -> None:
    socket = await connected("/ws/fleet/")
    view = await next_message(socket, lambda m: m.get("type") == "fleet" and len(m["rows"]) == 2)
    assert {r["engine"] for r in view["rows"]} == {TRACED, UNTRACED}
    await socket.send_to(text_data="nope")
    assert "not a JSON message" in (await next_message(socket, of_type("error")))["error"]
    await socket.send_to(text_data=json.dumps({"action": "explode"}))
    assert (await next_message(socket, of_type("error")))["error"].startswith("action:")
    await socket.send_to(text_data=json.dumps({"action": "refresh"}))
    assert (await next_message(socket, of_type("fleet")))["fleet"] == "default"
    await socket.disconnect()
    refused = await open_socket("/ws/fleet/", await session_cookie(staff=False))
    assert (await refused.connect(timeout=10))[0]
    assert (await refused.receive_output(5))["code"] == CLOSE_FORBIDDEN
    await refused.disconnect()


async def job(page: httpx.AsyncClient, headers: dict[str, str], body: dict, timeout: float = 20.0) -> dict:
    """Submit a fleet job and wait for it to finish; its final state."""
    submitted = await page.post("/dashboard/fleet/jobs/", json=body, headers=headers)
    assert submitted.status_code == 201, submitted.text
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        state = (await page.get(submitted.json()["url"])).json()
        if state["finished_at"] is not None:
            return state
        assert asyncio.get_running_loop().time() < deadline, state
        await asyncio.sleep(0.1)


async def test_a_job_across_this_server_a_peer_and_a_foreign_server(page: httpx.AsyncClient, server: FakeServer,
                                                                    shared_fleet: RedisFleetStore,
                                                                    monkeypatch) -> None:
    from engines.fleet import controls
    from engines.models import FleetJob

    monkeypatch.setattr(controls, "ANSWER_S", 1.0)
    headers = await csrf(page)
    attached = await page.post("/dashboard/fleet/attach/", headers=headers,
                               json={"url": server.url, "name": "gpu-1", "api_key": "sk-2"})
    foreign = f"foreign-{attached.json()['id']}"
    peer = shared_fleet
    # A peer server of ours: its card in the fleet, and its control listener (run here, on this
    # process's engines, as that server would run them on its own).
    listener = asyncio.create_task(controls.ControlListener(peer, "peer:1").run())
    try:
        for who in ("peer:1", "silent:2"):
            await peer.announce(ServerCard(server=who, url="http://peer", version="0.1.0", roles=["engines"],
                                           engines=[], started_at=0.0))
        await fleet_json(page, lambda v: len(v["servers"]) == 4)
        state = await job(page, headers, {"action": "reset", "targets": [
            {"server": server_id(), "engine": TRACED}, {"server": "peer:1", "engine": UNTRACED},
            {"server": foreign, "engine": "meta-llama/Llama-3.1-8B-Instruct"},
            {"server": "silent:2", "engine": "x"}, {"server": "nowhere:3", "engine": "x"}]})
        outcome = {t["server"]: (t["state"], t["message"]) for t in state["targets"]}
        assert outcome[server_id()] == ("done", f"engine {TRACED} was reset")
        assert outcome["peer:1"] == ("done", f"engine {UNTRACED} was reset")
        assert outcome[foreign] == ("done", "POST /reset_prefix_cache: 200")
        assert outcome["silent:2"] == ("error", "no answer from silent:2 in 1 s")
        assert outcome["nowhere:3"] == ("error", "no server 'nowhere:3' in this fleet")
        assert server.posts == [("/reset_prefix_cache", "Bearer sk-2")]
        # An action the foreign server has no endpoint for is refused with the reason, not tried.
        state = await job(page, headers, {"action": "save_trace", "targets": [{"server": foreign, "engine": "m"}]})
        assert [(t["state"], t["message"]) for t in state["targets"]] == [("error", "vLLM records no event trace")]
        assert len(server.posts) == 1
        audit = await sync_to_async(lambda: [(j.action, j.requested_by, j.finished_at is not None)
                                             for j in FleetJob.objects.order_by("id")])()
        assert [a[0] for a in audit] == ["reset", "save_trace"] and all(a[2] for a in audit)
        for body, error in (({"action": "explode", "targets": [{"server": server_id(), "engine": TRACED}]}, "action:"),
                            ({"action": "reset", "targets": []}, "targets:")):
            refused = await page.post("/dashboard/fleet/jobs/", json=body, headers=headers)
            assert refused.status_code == 400 and refused.json()["error"].startswith(error)
        assert (await page.get("/dashboard/fleet/jobs/999999.json")).status_code == 404
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)


async def test_a_save_trace_job_opens_as_one_timeline(page: httpx.AsyncClient) -> None:
    headers = await csrf(page)
    done = await page.post("/v1/completions", json={"model": TRACED, "prompt": "Hi", "max_tokens": 3})
    assert done.status_code == 200
    await fleet_json(page, lambda v: len(v["rows"]) == 2)  # the publisher has measured its clock
    state = await job(page, headers, {"action": "save_trace", "targets": [{"server": server_id(), "engine": TRACED}],
                                      "note": "fleet"})
    (target,) = state["targets"]
    assert target["state"] == "done" and target["result"]["server"] == server_id()
    assert abs(target["result"]["clock_offset_us"]) < 1e6 and target["result"]["clock_uncertainty_us"] >= 0
    trace = await page.get(f"/dashboard/fleet/jobs/{state['id']}/trace.json")
    assert trace.status_code == 200 and trace.headers["content-encoding"] == "gzip"
    merged = trace.json()
    names = [ev["args"]["name"] for ev in merged["traceEvents"] if ev.get("name") == "process_name"]
    assert names == [f"{TRACED} @ {server_id()}"]
    assert any(ev.get("name") == "thread_name" and ev["tid"] != 0 for ev in merged["traceEvents"])
    timeline = await page.get(f"/dashboard/fleet/jobs/{state['id']}/timeline/")
    assert timeline.status_code == 200 and "engines/js/timeline/page.js" in timeline.text
    assert f"/dashboard/fleet/jobs/{state['id']}/trace.json" in timeline.text and "job #" in timeline.text
    reset = await job(page, headers, {"action": "reset", "targets": [{"server": server_id(), "engine": TRACED}]})
    assert (await page.get(f"/dashboard/fleet/jobs/{reset['id']}/trace.json")).json()["error"] == \
        "this job saved no trace"
    assert (await page.get("/dashboard/fleet/jobs/999999/timeline/")).status_code == 404


async def test_a_save_workload_job_keeps_the_engines_flight_recorder(page: httpx.AsyncClient) -> None:
    from engines.models import WorkloadRecord

    headers = await csrf(page)
    done = await page.post("/v1/completions", json={"model": TRACED, "prompt": "Hi", "max_tokens": 3})
    assert done.status_code == 200
    state = await job(page, headers, {"action": "save_workload", "targets": [{"server": server_id(), "engine": TRACED}],
                                      "note": "before the upgrade"})
    (target,) = state["targets"]
    assert target["state"] == "done", target
    record = await WorkloadRecord.objects.aget(pk=target["result"]["record_id"])
    assert (record.engine, record.note, record.request_count) == (TRACED, "before the upgrade", 1)
    await registry.get(TRACED).reset()


async def test_our_own_metrics_read_as_a_foreign_server_export_every_quantity(page: httpx.AsyncClient) -> None:
    """One of ours attached by URL (outside the fleet's Redis) is read through the alias table:
    the table's names for our kind are the ones our /metrics exports."""
    from engines.fleet.server_kinds import QUANTITIES, ServerKind
    from engines.fleet.foreign import ForeignReader

    done = await page.post("/v1/completions", json={"model": TRACED, "prompt": "Hi", "max_tokens": 3})
    assert done.status_code == 200
    reading = ForeignReader().read((await page.get("/metrics")).text)
    assert reading.kind is ServerKind.OURS and reading.error is None
    assert reading.not_exported == () and set(reading.sources) == set(QUANTITIES)
    assert set(reading.models) == {TRACED, UNTRACED}
    assert reading.models[TRACED]["ttft"]["count"] >= 1


async def test_the_history_page_shows_slos_for_the_fleet_each_server_and_engine(page: httpx.AsyncClient) -> None:
    await sync_to_async(make_history)()
    html = (await page.get("/dashboard/fleet/history/?hours=1&ttft_ms=100&itl_ms=50")).text
    assert "Fleet history and SLOs" in html and "60 minute rollups" in html and "1 job in the window" in html
    fleet_row = html[html.index('data-label="fleet"'):]
    fleet_row = fleet_row[:fleet_row.index("</tr>")]
    # TTFT within 100 ms: a 95 of 100 a minute (65 in its five slow minutes), b 90: (25*95 + 5*65 + 30*90) / 6000
    assert '<td class="num" data-slo="ttft-within">90.0 %</td>' in fleet_row
    a_row = html[html.index('data-label="a:1"'):]
    assert '<td class="num" data-slo="ttft-within">90.0 %</td>' in a_row[:a_row.index("</tr>")]  # (25*95+5*65)/3000
    assert '<td class="num" data-slo="itl-within">90.0 %</td>' in fleet_row  # 90 of every 100 gaps within 50 ms
    assert 'data-label="demo @ a:1"' in html and 'data-label="b:2"' in html and 'data-label="model llama"' in html
    assert '"jobs": [{"at":' in html or '"jobs":[{"at":' in html.replace(" ", "")
    one = (await page.get("/dashboard/fleet/history/?hours=1&ttft_ms=100&of=server:a:1")).text
    assert "<h2>Server a:1 per minute</h2>" in one and '<option value="model:llama">model llama</option>' in one
    chart = orjson.loads(one[one.index('<script id="fleet-history" type="application/json">') + 51:
                             one.index("</script>", one.index('id="fleet-history"'))])
    assert min(row[3] for row in chart["series"]) == pytest.approx(65.0, abs=0.1)  # a's five slow minutes
    unknown = (await page.get("/dashboard/fleet/history/?of=server:nope")).text
    assert "<h2>The fleet per minute</h2>" in unknown
    clamped = await page.get("/dashboard/fleet/history/?hours=abc&ttft_ms=-5")
    assert clamped.status_code == 200 and "TTFT ≤ 1 ms" in clamped.text  # bad numbers: default or bound


async def test_an_sglang_server_read_and_reset_through_its_own_routes(page: httpx.AsyncClient) -> None:
    sglang = FakeServer("sglang")
    try:
        headers = await csrf(page)
        attached = await page.post("/dashboard/fleet/attach/", headers=headers, json={"url": sglang.url})
        assert attached.status_code == 201 and attached.json()["kind"] == "sglang", attached.text
        server = f"foreign-{attached.json()['id']}"
        view = await fleet_json(page, lambda v: any(r["server"] == server and r["state"] == "up" for r in v["rows"]))
        (row,) = [r for r in view["rows"] if r["server"] == server]
        assert row["kind"] == "sglang" and row["figures"]["running"] == 3 and row["model"] == "Qwen/Qwen2.5-7B-Instruct"
        done = await job(page, headers, {"action": "reset", "targets": [{"server": server, "engine": row["engine"]}]})
        assert [(t["state"], t["message"]) for t in done["targets"]] == [("done", "POST /flush_cache: 200")]
        refused = await job(page, headers, {"action": "clear_trace", "targets": [{"server": server, "engine": "m"}]})
        assert refused["targets"][0]["message"] == "SGLang records no event trace here"
        assert [path for path, _ in sglang.posts] == ["/flush_cache"]
    finally:
        sglang.close()


async def test_a_load_of_one_minute_is_one_minute_of_data_on_the_history_charts(page: httpx.AsyncClient) -> None:
    from tests.fleet.history_rows import make_one_minute_load

    await sync_to_async(make_one_minute_load)()
    html = (await page.get("/dashboard/fleet/history/?hours=1&of=server:c:3")).text
    assert '<span class="help chart-holds" data-holds="latency">1 minute of data</span>' in html
    assert '<span class="help chart-holds" data-holds="within">1 minute of data</span>' in html
    chart = orjson.loads(html[html.index('<script id="fleet-history" type="application/json">') + 51:
                              html.index("</script>", html.index('id="fleet-history"'))])
    assert [row[1] is not None for row in chart["series"]] == [False, False, False, True, False, False]
    assert chart["end"] >= chart["series"][-1][0] + 60              # the window ends now, past the last minute
    idle = (await page.get("/dashboard/fleet/history/?hours=1&of=server:idle:4")).text
    assert '<span class="help chart-holds" data-holds="latency">no data in this range</span>' in idle
