"""The live debugger's routes: every request in the engine (``/debug/list_requests``) and the KV
cache opened (``/debug/dump_kv_cache``), on the real demo engines through the ASGI app."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from engines.registry import registry
from tests.server.conftest import TRACED, UNTRACED, assert_error
from tests.server.test_dashboard_sockets import connected, next_message

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
    await client.post("/debug/reset_engine", json={"model": TRACED})
    await asyncio.wait_for(stream, 30)
    assert await live_row(client, "live-1") is None  # gone once ended


async def test_list_requests_empty_body_is_the_first_engine_and_bounded(client: httpx.AsyncClient) -> None:
    reply = await client.post("/debug/list_requests", content=b"")
    assert reply.status_code == 200
    assert reply.json() == {"model": registry.first().name, "total": 0, "truncated": False, "requests": []}
    assert_error(await client.post("/debug/list_requests", json={"limit": 0}), 400)
    assert_error(await client.post("/debug/list_requests", json={"model": "nope"}), 400)


async def test_dump_kv_cache_counts_pages_and_the_prefix_cache(client: httpx.AsyncClient) -> None:
    empty = (await client.post("/debug/dump_kv_cache", content=b"")).json()
    assert empty["model"] == registry.first().name
    stream = asyncio.create_task(client.post("/v1/chat/completions", json=chat("holder")))
    row = await until_decoding(client, "holder")
    dump = (await client.post("/debug/dump_kv_cache", json={"model": TRACED})).json()
    assert dump["used_pages"] + dump["cached_pages"] + dump["free_pages"] == dump["total_pages"]
    [held] = [r for r in dump["requests"] if r["request_id"] == "holder"]
    assert held["pages"] >= row["kv_pages"] - 1 and held["page_ids"]
    await client.post("/debug/reset_engine", json={"model": TRACED})
    await asyncio.wait_for(stream, 30)
    # Full pages stay cached after a request; the same prompt again is a hit on them.
    for user in ("again", "and-again"):
        await client.post("/v1/chat/completions", json=chat(user, max_tokens=2, stream=False))
    dump = (await client.post("/debug/dump_kv_cache", json={"model": TRACED, "max_entries": 5})).json()
    assert dump["num_entries"] >= 1 and 1 <= len(dump["entries"]) <= 5
    assert dump["hit_tokens"] > 0 and 0 < dump["hit_rate"] <= 1
    assert any(e["hits"] >= 1 for e in dump["entries"])
    assert set(dump["entries"][0]) == {"tokens", "pages", "hits", "prefix_hits", "last_use_s", "held_by", "pinned"}
    assert_error(await client.post("/debug/dump_kv_cache", json={"model": UNTRACED, "max_entries": -1}), 400)


async def test_the_live_tables_socket_carries_the_rows_and_the_kv_cache(dashboard, client) -> None:
    """The live table's and the KV section's data: each snapshot's rows and KV dump."""
    stream = asyncio.create_task(client.post("/v1/chat/completions", json=chat("from-page")))
    await until_decoding(client, "from-page")
    socket = await connected(f"/ws/engines/{TRACED}/")
    snap = await next_message(socket, lambda m: m.get("type") == "snapshot" and any(
        r["request_id"] == "from-page" for r in m.get("live_requests") or []))
    assert snap["live_total"] >= 1 and snap["kv_cache"]["total_pages"] > 0
    assert any(r["request_id"] == "from-page" for r in snap["kv_cache"]["requests"])
    await client.post("/debug/reset_engine", json={"model": TRACED})
    await asyncio.wait_for(stream, 30)
    await socket.disconnect()
