"""The live debugger's routes: every request in the engine (``/debug/list_requests``), cancelling
one by id (``/debug/abort_request``, kept in the history) and the KV cache opened
(``/debug/dump_kv_cache``), on the real demo engines through the ASGI app."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engines.models import FleetJob
from engines.registry import registry
from tests.server.conftest import TRACED, UNTRACED, assert_error, sse_payloads
from tests.server.test_dashboard_sockets import connected, next_message, of_type

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("async_db_connections_closed")]


#: Long enough for full KV pages (16 tokens) the prefix cache keeps.
PROMPT = "Tell me about the tides of the sea, the moon that pulls them and the shores they wash, at length."


def chat(user: str, max_tokens: int = 1500, stream: bool = True, **extra) -> dict:
    return {"model": TRACED, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "stream": stream, "user": user, "debug_config": {"ignore_eos": True}, **extra}


async def live_row(http: httpx.AsyncClient, request_id: str, **body) -> dict | None:
    reply = await http.post("/debug/list_requests", json={"model": TRACED, **body})
    assert reply.status_code == 200, reply.text
    return next((r for r in reply.json()["requests"] if r["request_id"] == request_id), None)


async def until_decoding(http: httpx.AsyncClient, request_id: str) -> dict:
    for _ in range(500):
        row = await live_row(http, request_id)
        if row is not None and row["state"] == "decoding" and row["output_tokens"] >= 2:
            return row
        await asyncio.sleep(0.02)
    raise AssertionError(f"{request_id} never decoded")


async def test_list_requests_shows_a_live_stream_with_its_progress(client: httpx.AsyncClient) -> None:
    stream = asyncio.create_task(client.post("/v1/chat/completions", json=chat(
        "live-1", temperature=0.5, top_p=0.8, response_format={"type": "json_object"})))
    row = await until_decoding(client, "live-1")
    assert row["user"] == "live-1" and row["client_request_id"] is None
    assert row["prompt_tokens"] > 0 and row["left_tokens"] == 0
    assert row["computed_tokens"] == row["prompt_tokens"]
    assert row["max_output_tokens"] == 1500 and row["kv_pages"] >= 1
    assert (row["temperature"], row["top_p"], row["grammar"]) == (0.5, 0.8, "json_object")
    assert row["ttft_s"] is not None and row["queued_s"] <= row["age_s"]
    await client.post("/debug/abort_request", json={"model": TRACED, "request_id": "live-1"})
    await asyncio.wait_for(stream, 30)
    assert await live_row(client, "live-1") is None  # gone once ended


async def test_the_live_table_names_the_clients_x_request_id(client: httpx.AsyncClient) -> None:
    """With a ``user`` the request runs under an id of ours; the client's X-Request-Id shows beside it."""
    stream = asyncio.create_task(client.post("/v1/chat/completions", json=chat("live-2"),
                                             headers={"X-Request-Id": "client-trace-42"}))
    row = await until_decoding(client, "live-2")
    assert row["user"] == "live-2" and row["client_request_id"] == "client-trace-42"
    await client.post("/debug/abort_request", json={"model": TRACED, "request_id": "live-2"})
    await asyncio.wait_for(stream, 30)


async def test_list_requests_empty_body_is_the_first_engine_and_bounded(client: httpx.AsyncClient) -> None:
    reply = await client.post("/debug/list_requests", content=b"")
    assert reply.status_code == 200
    assert reply.json() == {"model": registry.first().name, "total": 0, "truncated": False, "requests": []}
    assert_error(await client.post("/debug/list_requests", json={"limit": 0}), 400)
    assert_error(await client.post("/debug/list_requests", json={"model": "nope"}), 400)


async def test_abort_ends_a_stream_with_abort_and_done_and_keeps_it_in_the_history(
        client: httpx.AsyncClient) -> None:
    stream = asyncio.create_task(client.post("/v1/chat/completions", json=chat("abort-me")))
    await until_decoding(client, "abort-me")
    reply = await client.post("/debug/abort_request", json={"model": TRACED, "request_id": "abort-me"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["status"] == "aborted" and body["request_id"] == "abort-me" and body["model"] == TRACED
    events = sse_payloads((await asyncio.wait_for(stream, 30)).text)
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")][-1] == "abort"
    job = await FleetJob.objects.prefetch_related("targets").aget(pk=body["history_id"])
    assert job.action == "abort_request" and job.requested_by.startswith("api from ")
    assert job.options == {"request_id": "abort-me", "source": "api"} and job.finished_at is not None
    [target] = job.targets.all()
    assert (target.engine, target.state) == (TRACED, "done")


async def test_abort_of_a_non_streaming_call_returns_what_it_had(client: httpx.AsyncClient) -> None:
    call = asyncio.create_task(client.post("/v1/chat/completions", json=chat("whole", stream=False)))
    row = await until_decoding(client, "whole")
    await client.post("/debug/abort_request", json={"request_id": "whole", "model": TRACED})
    reply = (await asyncio.wait_for(call, 30)).json()
    assert reply["choices"][0]["finish_reason"] == "abort"
    assert reply["usage"]["completion_tokens"] >= row["output_tokens"]


async def test_abort_of_an_unknown_or_ended_request_is_a_404(client: httpx.AsyncClient) -> None:
    error = assert_error(await client.post("/debug/abort_request", json={"model": TRACED, "request_id": "ghost"}), 404)
    assert "ghost" in error["message"] and error["param"] == "request_id"
    done = await client.post("/v1/chat/completions", json=chat("ended", max_tokens=2, stream=False))
    assert done.status_code == 200
    assert_error(await client.post("/debug/abort_request", json={"model": TRACED, "request_id": "ended"}), 404)
    assert_error(await client.post("/debug/abort_request", json={"model": TRACED}), 400)
    assert not await FleetJob.objects.filter(action="abort_request").aexists()


async def test_abort_of_a_request_waiting_for_its_kv_frees_its_reservation(client: httpx.AsyncClient) -> None:
    """A disaggregated request that prep_recv reserved pages for, whose K/V never came: the live
    table's "kv_transfer" row; aborting it frees the pages (before, it was a 404 while its row
    stayed and held them until the reservation expired)."""
    decode = registry.get(UNTRACED)
    await decode.reset()
    prep = await client.post("/microserving/prep_recv", json={
        "model": UNTRACED, "prompt": list(range(300, 340)), "user": "waits-for-kv", "max_tokens": 4, "end": 30})
    assert prep.status_code == 200, prep.text
    (row,) = (await client.post("/debug/list_requests", json={"model": UNTRACED})).json()["requests"]
    assert (row["request_id"], row["state"]) == ("waits-for-kv", "kv_transfer") and row["kv_pages"] == 2
    aborted = await client.post("/debug/abort_request", json={"model": UNTRACED, "request_id": "waits-for-kv"})
    assert aborted.status_code == 200, aborted.text
    assert (await client.post("/debug/list_requests", json={"model": UNTRACED})).json()["total"] == 0
    assert (await decode.metrics())["kv_pages_used"] == 0
    assert await FleetJob.objects.filter(action="abort_request", options__request_id="waits-for-kv").aexists()
    again = await client.post("/debug/abort_request", json={"model": UNTRACED, "request_id": "waits-for-kv"})
    assert again.status_code == 404


async def test_dump_kv_cache_counts_pages_and_the_prefix_cache(client: httpx.AsyncClient) -> None:
    empty = (await client.post("/debug/dump_kv_cache", content=b"")).json()
    assert empty["model"] == registry.first().name
    stream = asyncio.create_task(client.post("/v1/chat/completions", json=chat("holder")))
    row = await until_decoding(client, "holder")
    dump = (await client.post("/debug/dump_kv_cache", json={"model": TRACED})).json()
    assert dump["used_pages"] + dump["cached_pages"] + dump["free_pages"] == dump["total_pages"]
    [held] = [r for r in dump["requests"] if r["request_id"] == "holder"]
    assert held["pages"] >= row["kv_pages"] - 1 and held["page_ids"]
    await client.post("/debug/abort_request", json={"model": TRACED, "request_id": "holder"})
    await asyncio.wait_for(stream, 30)
    # Full pages stay cached after a request; the same prompt again is a hit on them.
    for user in ("again", "and-again"):
        await client.post("/v1/chat/completions", json=chat(user, max_tokens=2, stream=False))
    dump = (await client.post("/debug/dump_kv_cache", json={"model": TRACED, "max_entries": 5})).json()
    assert dump["num_entries"] >= 1 and 1 <= len(dump["entries"]) <= 5
    assert dump["hit_tokens"] > 0 and 0 < dump["hit_rate"] <= 1
    assert any(e["hits"] >= 1 for e in dump["entries"])
    assert set(dump["entries"][0]) == {"tokens", "pages", "hits", "prefix_hits", "last_use_s", "held_by", "pinned",
                                         "first_words"}
    assert dump["entries"][0]["first_words"] is None  # no text without --capture-text
    assert_error(await client.post("/debug/dump_kv_cache", json={"model": UNTRACED, "max_entries": -1}), 400)


async def test_the_live_tables_socket_shows_the_request_and_aborts_it_naming_the_user(dashboard, client) -> None:
    """The live table's data and its button: the snapshot's rows, an ``abort_request`` action."""
    stream = asyncio.create_task(client.post("/v1/chat/completions", json=chat("from-page")))
    await until_decoding(client, "from-page")
    socket = await connected(f"/ws/engines/{TRACED}/")
    snap = await next_message(socket, lambda m: m.get("type") == "snapshot" and any(
        r["request_id"] == "from-page" for r in m.get("live_requests") or []))
    assert snap["live_total"] >= 1 and snap["kv_cache"]["total_pages"] > 0
    assert any(r["request_id"] == "from-page" for r in snap["kv_cache"]["requests"])
    await socket.send_to(text_data=json.dumps({"action": "abort_request", "id": 3, "request_id": "from-page"}))
    done = await next_message(socket, of_type("done", id=3))
    assert done["result"]["request_id"] == "from-page"
    events = sse_payloads((await asyncio.wait_for(stream, 30)).text)
    assert events[-1] == "[DONE]"
    job = await FleetJob.objects.aget(pk=done["result"]["history_id"])
    assert job.requested_by.startswith("u") and job.options["source"] == "dashboard"
    await socket.send_to(text_data=json.dumps({"action": "abort_request", "id": 4, "request_id": "from-page"}))
    assert "holds no request" in (await next_message(socket, of_type("error", id=4)))["message"]
    await socket.disconnect()
