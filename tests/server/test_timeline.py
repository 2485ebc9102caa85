"""The timeline viewer's server side: its pages, the saved trace's data, the live socket."""
from __future__ import annotations

import gzip
import json

import pytest
from asgiref.sync import sync_to_async
from django.urls import reverse

from engines.dashboard.consumers import CLOSE_FORBIDDEN, CLOSE_NOT_FOUND
from engines.history import asave_engine_trace
from engines.registry import registry
from engines.runtime.telemetry.chrome_trace_reference import export_dict
from engines.runtime.telemetry.trace_recorder import TraceWindow
from tests.server.conftest import TRACED, UNTRACED
from tests.server.test_dashboard_sockets import connected, next_message, of_type, open_socket, session_cookie

pytestmark = pytest.mark.django_db(transaction=True)

COMPLETION = {"model": TRACED, "prompt": "hello timeline", "max_tokens": 6, "temperature": 0}


def collected_window(calls: list, now_us: int) -> TraceWindow:
    return TraceWindow([(ts * 1000, tuple(ids), ev, args, lane) for ts, ids, ev, args, lane in calls],
                       now_us * 1000, 0, 0, 1, TRACED, "", "", "")


def events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] != "M"]


async def follow_until_quiet(socket, cursor: int = 0, tag: int = 0) -> tuple[list, dict, int]:
    """Follow from ``cursor`` until a delta brings nothing; (calls, the last delta, events missed).

    Deltas of an earlier follow still in flight (another ``tag``) are passed over.
    """
    await socket.send_json_to({"action": "follow", "cursor": cursor, "tag": tag})
    calls: list = []
    missed = 0
    while True:
        delta = await next_message(socket, of_type("trace_delta", tag=tag))
        calls += delta["calls"]
        missed += delta["missed"]
        if not delta["calls"] and not delta["more"]:
            return calls, delta, missed


async def test_the_live_socket_streams_what_the_dump_holds(dashboard, serve) -> None:
    socket = await connected(f"/ws/engines/{TRACED}/timeline/")
    hello = await next_message(socket, of_type("hello"))
    assert (hello["engine"], hello["tracing"]) == (TRACED, True)
    client = serve(enable_debug=True)
    assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
    calls, last, missed = await follow_until_quiet(socket)
    # Earlier tests may have cleared this engine's trace: those events are missed, the rest all came.
    assert last["cursor"] - missed == last["held_events"]
    # The socket carried every call; the dump's pairing of them is the dump itself.
    dumped = json.loads(await registry.get(TRACED).dump_trace())
    assert events(export_dict(collected_window(calls, last["now_us"]))) == events(dumped)
    lanes = {ids[0] for _, ids, _, _, _ in calls if ids}
    assert any(lane.startswith("cmpl-") for lane in lanes)
    # Following on from the cursor brings only what is new.
    assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
    more, _, missed = await follow_until_quiet(socket, last["cursor"], tag=1)
    assert missed == 0
    assert more and more[0][2] in ("receive request", "start tokenization", "request added to engine")
    assert not set(map(json.dumps, more)) & set(map(json.dumps, calls))
    await socket.disconnect()


async def test_bad_messages_get_an_error_and_the_socket_stays_open(dashboard) -> None:
    socket = await connected(f"/ws/engines/{TRACED}/timeline/")
    for bad in ("not json", json.dumps({"action": "rewind"}), json.dumps({"action": "follow", "cursor": -1}),
                json.dumps({"action": "follow", "cursor": "0"}),
                json.dumps({"action": "follow", "cursor": 0, "tag": -1}), "[" * 100 + "]" * 100):
        await socket.send_to(text_data=bad)
        error = await next_message(socket, of_type("error"))
        assert error["message"]
    calls, _, _ = await follow_until_quiet(socket)   # still serving
    assert isinstance(calls, list)
    await socket.disconnect()


async def test_an_engine_without_tracing_says_so(dashboard) -> None:
    socket = await connected(f"/ws/engines/{UNTRACED}/timeline/")
    assert (await next_message(socket, of_type("hello")))["tracing"] is False
    await socket.send_json_to({"action": "follow", "cursor": 0})
    assert "--enable-tracing" in (await next_message(socket, of_type("error")))["message"]
    await socket.disconnect()


async def test_a_cursor_from_another_recorder_restarts_from_zero(dashboard) -> None:
    socket = await connected(f"/ws/engines/{TRACED}/timeline/")
    await socket.send_json_to({"action": "follow", "cursor": 10**12})
    assert (await next_message(socket, of_type("restarted")))["engine"] == TRACED
    assert (await next_message(socket, of_type("trace_delta")))["cursor"] >= 0
    await socket.disconnect()


async def test_only_staff_and_only_served_engines(dashboard) -> None:
    for cookie, path, code in ((None, f"/ws/engines/{TRACED}/timeline/", CLOSE_FORBIDDEN),
                               (await session_cookie(staff=False), f"/ws/engines/{TRACED}/timeline/", CLOSE_FORBIDDEN),
                               (await session_cookie(), "/ws/engines/nope/timeline/", CLOSE_NOT_FOUND)):
        socket = await open_socket(path, cookie)
        assert (await socket.connect(timeout=10))[0]
        assert (await socket.receive_output(5))["code"] == code
        await socket.disconnect()


async def staff_client(serve, may_view_history: bool = True):
    """A client signed in as staff who may (or may not) view the trace history."""
    def login() -> str:
        from django.contrib.auth.models import Permission, User
        from django.test import Client

        user = User.objects.create_user(f"viewer{User.objects.count()}", password="pw", is_staff=True)
        if may_view_history:
            viewing = Permission.objects.filter(codename__in=["view_tracerecord", "view_requestsummary"])
            user.user_permissions.add(*viewing)
        client = Client()
        client.force_login(user)
        return client.cookies["sessionid"].value

    client = serve(enable_debug=True)
    client.cookies.set("sessionid", await sync_to_async(login)())
    return client


async def test_saved_trace_pages_and_data(dashboard, serve) -> None:
    client = await staff_client(serve)
    assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
    record = await asave_engine_trace(registry.get(TRACED), note="<script>alert(1)</script>")
    page = await client.get(f"/dashboard/traces/{record.pk}/timeline/")
    assert page.status_code == 200
    assert b"<script>alert(1)</script>" not in page.content
    data_url = await sync_to_async(reverse)("dashboard-trace-data", args=[record.pk])
    data = await client.get(data_url)
    # Sent compressed as stored; the client (a browser, httpx here) inflates it.
    assert data.headers["content-encoding"] == "gzip"
    assert int(data.headers["content-length"]) == record.compressed_bytes
    trace = data.json()
    assert len(events(trace)) == record.event_count
    requests_url = await sync_to_async(reverse)("dashboard-trace-requests", args=[record.pk])
    summaries = (await client.get(requests_url)).json()
    rows = [dict(zip(summaries["fields"], row, strict=True)) for row in summaries["rows"]]
    assert len(rows) == record.request_count and all(r["request_id"] for r in rows)
    assert "/ID/" in summaries["change_url"]
    assert (await client.get("/dashboard/traces/999999/timeline/")).status_code == 404
    # Staff without the history's view permission see neither the page nor the data.
    outsider = await staff_client(serve, may_view_history=False)
    assert (await outsider.get(f"/dashboard/traces/{record.pk}/timeline/")).status_code == 403
    assert (await outsider.get(data_url)).status_code == 403


async def test_live_pages_and_the_session_dump(dashboard, serve) -> None:
    client = await staff_client(serve)
    assert (await client.get(f"/dashboard/engines/{TRACED}/timeline/")).status_code == 200
    assert (await client.get("/dashboard/engines/nope/timeline/")).status_code == 404
    assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
    dump = await client.get(f"/dashboard/engines/{TRACED}/trace.json")
    assert dump.status_code == 200 and events(dump.json())
    packed = await client.get(f"/dashboard/engines/{TRACED}/trace.json?gzip=1")
    assert events(json.loads(gzip.decompress(packed.content)))
    assert (await client.get(f"/dashboard/engines/{UNTRACED}/trace.json")).status_code == 409
    anonymous = serve(enable_debug=True)
    assert (await anonymous.get(f"/dashboard/engines/{TRACED}/trace.json")).status_code == 302
