"""The dashboard's websockets: who may open one, the snapshots it carries, the actions it takes."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from debugsite.asgi import application
from engines.dashboard.consumers import CLOSE_FORBIDDEN, CLOSE_NOT_FOUND
from engines.dashboard.messages import engine_group
from engines.server.server_identity import server_id
from engines.dashboard.sampler import hub_for
from engines.models import ProfileRecord, TraceRecord
from engines.registry import registry
from tests.server.conftest import TRACED, UNTRACED

pytestmark = pytest.mark.django_db(transaction=True)

REPO = Path(__file__).resolve().parents[2]
ORIGIN = (b"origin", b"http://127.0.0.1:8000")
HOST = (b"host", b"127.0.0.1:8000")
HI = {"model": TRACED, "prompt": "Hi", "max_tokens": 3}  # a short completion, for a trace to save


async def session_cookie(staff: bool = True) -> bytes:
    def login() -> str:
        from django.contrib.auth.models import User

        user = User.objects.create_user(f"u{User.objects.count()}", password="pw", is_staff=staff)
        client = Client()
        client.force_login(user)
        return client.cookies["sessionid"].value

    return b"sessionid=" + (await sync_to_async(login)()).encode()


async def open_socket(path: str, cookie: bytes | None = None, origin: tuple = ORIGIN) -> WebsocketCommunicator:
    headers = [origin, HOST] + ([(b"cookie", cookie)] if cookie else [])
    return WebsocketCommunicator(application, path, headers=headers)


async def connected(path: str, staff: bool = True) -> WebsocketCommunicator:
    socket = await open_socket(path, await session_cookie(staff))
    ok, _ = await socket.connect(timeout=10)
    assert ok
    return socket


async def next_message(socket: WebsocketCommunicator, want: Callable[[dict], bool], timeout: float = 10) -> dict:
    """The next message ``want`` accepts (snapshots in between are skipped)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        message = json.loads(await socket.receive_from(timeout=max(0.01, deadline - loop.time())))
        if want(message):
            return message


def of_type(kind: str, **fields: Any) -> Callable[[dict], bool]:
    return lambda m: m.get("type") == kind and all(m.get(k) == v for k, v in fields.items())


async def test_anonymous_and_non_staff_sockets_are_closed_with_a_clear_code(dashboard) -> None:
    for cookie in (None, await session_cookie(staff=False)):
        socket = await open_socket(f"/ws/engines/{TRACED}/", cookie)
        assert (await socket.connect(timeout=10))[0]
        assert (await socket.receive_output(5))["code"] == CLOSE_FORBIDDEN
        await socket.disconnect()


@pytest.mark.parametrize("origin", [b"https://evil.example", b"http://127.0.0.1:9999", b"http://127.0.0.1",
                                    b"https://127.0.0.1:8000", b"http://localhost:8000", b"null", b"http://127.0.0.1:99999"],
                         ids=["another-site", "another-port", "default-port", "another-scheme", "another-name", "null",
                              "bad-port"])
async def test_a_socket_from_anywhere_but_this_server_is_refused(dashboard, origin: bytes) -> None:
    """Another site, and another port of this very machine (a browser sends the session cookie
    there too): no socket, so no reset or trace save in the user's name."""
    socket = await open_socket("/ws/engines/", await session_cookie(), origin=(b"origin", origin))
    assert not (await socket.connect(timeout=10))[0]
    await socket.disconnect()


async def test_a_socket_from_a_trusted_origin_is_accepted(dashboard, settings) -> None:
    settings.CSRF_TRUSTED_ORIGINS = ["https://dashboard.example"]
    socket = await open_socket("/ws/engines/", await session_cookie(), origin=(b"origin", b"https://dashboard.example"))
    assert (await socket.connect(timeout=10))[0]
    await socket.disconnect()


async def test_an_unknown_engine_is_closed_not_found(dashboard) -> None:
    socket = await connected_or_closed("/ws/engines/nope/")
    assert (await socket.receive_output(5))["code"] == CLOSE_NOT_FOUND
    await socket.disconnect()


async def connected_or_closed(path: str) -> WebsocketCommunicator:
    socket = await open_socket(path, await session_cookie())
    await socket.connect(timeout=10)
    return socket


async def test_snapshots_arrive_for_the_engine_joined_and_the_overview_sees_all(dashboard) -> None:
    socket = await connected(f"/ws/engines/{TRACED}/")
    snap = await next_message(socket, of_type("snapshot"))
    assert (snap["engine"], snap["server"], snap["state"], snap["mode"]) == (TRACED, server_id(), "running", "thread")
    assert snap["tracing"] is True and snap["backend"] == "cpu"
    assert {"num_running_requests", "kv_cache_usage", "ttft_s", "engine_prefill_time_sum"} <= snap["metrics"].keys()
    second = await next_message(socket, of_type("snapshot"))
    assert 0 < second["at"] - snap["at"] < 2  # watched: several a second
    await socket.disconnect()

    overview = await connected("/ws/engines/")
    seen = set()
    while seen != {TRACED, UNTRACED}:
        seen.add((await next_message(overview, of_type("snapshot")))["engine"])
    await overview.disconnect()


async def test_two_sockets_on_one_engine_receive_every_snapshot(dashboard) -> None:
    a, b = await connected(f"/ws/engines/{TRACED}/"), await connected(f"/ws/engines/{TRACED}/")
    got_a = [(await next_message(a, of_type("snapshot")))["at"] for _ in range(10)]
    got_b = [(await next_message(b, of_type("snapshot")))["at"] for _ in range(10)]
    assert got_a == sorted(got_a) and got_b == sorted(got_b)
    # While both were open (b opened a little later), each got every snapshot the other did.
    start, end = max(got_a[0], got_b[0]), min(got_a[-1], got_b[-1])
    both = [at for at in got_a if start <= at <= end]
    assert len(both) >= 3 and both == [at for at in got_b if start <= at <= end]
    await a.disconnect()
    await b.disconnect()


async def test_reset_is_acknowledged_done_and_the_counters_drop(dashboard, client) -> None:
    body = {"model": TRACED, "prompt": "Once upon a time", "max_tokens": 4, "debug_config": {"ignore_eos": True}}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    socket = await connected(f"/ws/engines/{TRACED}/")
    before = await next_message(socket, of_type("snapshot"))
    assert before["metrics"]["num_finished_requests"] >= 1
    assert before["recent_requests"][0]["completion_tokens"] == 4  # the table of recent requests
    await socket.send_to(text_data=json.dumps({"action": "reset", "id": 7}))
    assert (await next_message(socket, of_type("ack", id=7)))["engine"] == TRACED
    await next_message(socket, of_type("done", id=7))
    after = await next_message(socket, of_type("snapshot"))
    assert after["metrics"]["num_finished_requests"] == 0 and after["metrics"]["prompt_tokens_sum"] == 0
    assert after["recent_requests"] == []
    await socket.disconnect()


async def test_save_trace_reports_progress_and_links_the_record(dashboard, client) -> None:
    body = {"model": TRACED, "prompt": "Once upon a time", "max_tokens": 4}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    socket = await connected(f"/ws/engines/{TRACED}/")
    await socket.send_to(text_data=json.dumps({"action": "save_trace", "id": "s1", "note": "<b>n</b>",
                                               "tags": ["x"]}))
    await next_message(socket, of_type("progress", id="s1"))
    done = await next_message(socket, of_type("done", id="s1"))
    record = await TraceRecord.objects.aget(pk=done["result"]["record_id"])
    assert (record.source, record.note, record.tags) == ("dashboard", "<b>n</b>", "x")
    assert (record.server, record.fleet) == (server_id(), "default")  # the server that saved it
    assert done["result"]["url"] == f"/admin/engines/tracerecord/{record.pk}/change/"
    await socket.disconnect()


async def test_clear_trace_and_profiling_answer_done_or_a_clear_error(dashboard, client) -> None:
    traced = await connected(f"/ws/engines/{TRACED}/")
    await traced.send_to(text_data=json.dumps({"action": "clear_trace", "id": 1}))
    await next_message(traced, of_type("done", id=1))
    # The built-in profiler, on a CPU engine too: started, shown in the snapshots, stopped and saved.
    await traced.send_to(text_data=json.dumps({"action": "profile_stop", "id": 2}))
    assert "no profile is running" in (await next_message(traced, of_type("error", id=2)))["message"]
    await traced.send_to(text_data=json.dumps({"action": "profile_start", "id": 3, "stack_sampling": True}))
    assert (await next_message(traced, of_type("done", id=3)))["result"]["profiling"] is True
    await traced.send_to(text_data=json.dumps({"action": "profile_start", "id": 4}))
    assert "already running" in (await next_message(traced, of_type("error", id=4)))["message"]
    body = {"model": TRACED, "prompt": "Once upon a time", "max_tokens": 8}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    running = await next_message(traced, lambda m: m["type"] == "snapshot" and m["profile"]["steps"] > 0)
    assert running["profile"]["running"] is True
    await traced.send_to(text_data=json.dumps({"action": "profile_stop", "id": 5, "note": "<i>ws</i>"}))
    await next_message(traced, of_type("progress", id=5))
    done = await next_message(traced, of_type("done", id=5))
    record = await ProfileRecord.objects.aget(pk=done["result"]["record_id"])
    assert (record.source, record.note, record.engine) == ("dashboard", "<i>ws</i>", TRACED) and record.steps > 0
    assert (record.server, record.fleet) == (server_id(), "default")
    assert done["result"]["url"] == f"/dashboard/profiles/{record.pk}/" and done["result"]["profiling"] is False
    after = await next_message(traced, lambda m: m["type"] == "snapshot" and not m["profile"]["running"])
    assert after["profile"]["last_id"] == record.pk
    await traced.disconnect()
    untraced = await connected(f"/ws/engines/{UNTRACED}/")
    await untraced.send_to(text_data=json.dumps({"action": "clear_trace", "id": 3}))
    assert "--enable-tracing" in (await next_message(untraced, of_type("error", id=3)))["message"]
    await untraced.disconnect()


@pytest.mark.parametrize(("message", "says"), [
    ("not json", "not a JSON message"),
    ("[" * 100 + "]" * 100, "not a JSON message"),
    (json.dumps({"action": "explode", "id": 1}), "action"),
    (json.dumps({"action": "reset"}), "id"),
    (json.dumps({"action": "reset", "id": 1, "surprise": True}), "surprise"),
    (json.dumps({"action": "reset", "id": 1, "engine": "nope"}), "no engine 'nope'"),
    (json.dumps({"action": "save_trace", "id": 1, "note": "n" * 5000}), "note"),
])
async def test_a_bad_message_gets_an_error_event_and_the_socket_stays_open(dashboard, message, says) -> None:
    socket = await connected(f"/ws/engines/{TRACED}/")
    await socket.send_to(text_data=message)
    error = await next_message(socket, of_type("error"))
    assert says in error["message"]
    await socket.send_to(text_data=json.dumps({"action": "clear_trace", "id": "after"}))
    await next_message(socket, of_type("done", id="after"))
    await socket.disconnect()


async def test_an_error_event_names_the_id_when_the_message_had_a_valid_one(dashboard) -> None:
    socket = await connected(f"/ws/engines/{TRACED}/")
    await socket.send_to(text_data=json.dumps({"action": "explode", "id": "mine"}))
    assert (await next_message(socket, of_type("error")))["id"] == "mine"
    await socket.send_to(text_data=json.dumps({"action": "explode", "id": True}))  # not a valid id: none named
    assert "id" not in (await next_message(socket, of_type("error")))
    await socket.disconnect()


async def test_saving_an_empty_trace_is_an_error_and_no_record(dashboard) -> None:
    socket = await connected(f"/ws/engines/{TRACED}/")
    await socket.send_to(text_data=json.dumps({"action": "save_trace", "id": "e"}))
    assert "recorded no event" in (await next_message(socket, of_type("error", id="e")))["message"]
    assert not await TraceRecord.objects.aexists()
    await socket.disconnect()


async def test_an_acknowledged_save_completes_after_its_socket_closes_and_the_next_socket_hears_of_it(
        dashboard, client) -> None:
    assert (await client.post("/v1/completions", json=HI)).status_code == 200
    cookie = await session_cookie()
    first = await open_socket(f"/ws/engines/{TRACED}/", cookie)
    assert (await first.connect(timeout=10))[0]
    await first.send_to(text_data=json.dumps({"action": "save_trace", "id": "late", "note": "reloaded"}))
    await next_message(first, of_type("ack", id="late"))
    await first.disconnect()  # the page reloaded right after the click
    from engines.dashboard import consumers

    for _ in range(200):  # the save ends with no page open: its outcome waits
        if consumers._undelivered:
            break
        await asyncio.sleep(0.05)
    record = await TraceRecord.objects.aget(note="reloaded")
    second = await open_socket(f"/ws/engines/{TRACED}/", cookie)  # the same user's next page
    assert (await second.connect(timeout=10))[0]
    late = await next_message(second, of_type("done", id="late"))
    assert late["earlier"] is True and late["result"]["record_id"] == record.pk
    await second.disconnect()
    third = await open_socket(f"/ws/engines/{TRACED}/", cookie)  # told once
    assert (await third.connect(timeout=10))[0]
    deadline = asyncio.get_running_loop().time() + 1
    while asyncio.get_running_loop().time() < deadline:
        if not await third.receive_nothing(timeout=0.1):
            assert not json.loads(await third.receive_from()).get("earlier")
    await third.disconnect()


async def test_a_late_outcome_goes_to_the_users_page_opened_meanwhile(dashboard, client) -> None:
    assert (await client.post("/v1/completions", json=HI)).status_code == 200
    cookie = await session_cookie()
    first = await open_socket(f"/ws/engines/{TRACED}/", cookie)
    assert (await first.connect(timeout=10))[0]
    await first.send_to(text_data=json.dumps({"action": "save_trace", "id": "soon", "note": "reopened"}))
    await next_message(first, of_type("ack", id="soon"))
    await first.disconnect()
    second = await open_socket(f"/ws/engines/{TRACED}/", cookie)  # reopened before the save ended
    assert (await second.connect(timeout=10))[0]
    late = await next_message(second, of_type("done", id="soon"))
    assert late["earlier"] is True
    assert late["result"]["record_id"] == (await TraceRecord.objects.aget(note="reopened")).pk
    await second.disconnect()


async def test_the_overview_socket_needs_the_engine_named(dashboard) -> None:
    socket = await connected("/ws/engines/")
    await socket.send_to(text_data=json.dumps({"action": "clear_trace", "id": 1}))
    assert "name the engine" in (await next_message(socket, of_type("error", id=1)))["message"]
    await socket.send_to(text_data=json.dumps({"action": "clear_trace", "id": 2, "engine": TRACED}))
    await next_message(socket, of_type("done", id=2))
    await socket.disconnect()


async def test_snapshots_from_another_server_process_arrive_over_redis(dashboard, settings) -> None:
    """Two server processes sharing the Redis channel layer: one's snapshots reach the other's sockets."""
    from channels.layers import channel_layers

    url = os.environ.get("REDIS_TEST_URL", "redis://127.0.0.1:6379/1")
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [url], "prefix": "test-dashboard"}}}
    channel_layers.backends.clear()
    try:
        socket = await connected(f"/ws/engines/{TRACED}/")
        await next_message(socket, of_type("snapshot", server=server_id()))  # ours, through Redis
        script = (
            "import asyncio, channels_redis.core as r\n"
            f"layer = r.RedisChannelLayer(hosts=[{url!r}], prefix='test-dashboard')\n"
            f"snap = dict(type='snapshot', server='other-host:1', engine={TRACED!r}, at=1.0, state='running',\n"
            "            restarts=0, backend='cuda', dtype='float16', mode='process', tracing=False, metrics=None)\n"
            "import json\n"
            f"asyncio.run(layer.group_send({engine_group(TRACED)!r},\n"
            "                              dict(type='engine.snapshot', text=json.dumps(snap))))\n"
        )
        await asyncio.to_thread(subprocess.run, [sys.executable, "-c", script], cwd=REPO, check=True, timeout=60)
        other = await next_message(socket, of_type("snapshot", server="other-host:1"))
        assert other["backend"] == "cuda"
        await socket.disconnect()
    finally:
        await hub_for(registry).stop()
        channel_layers.backends.clear()
