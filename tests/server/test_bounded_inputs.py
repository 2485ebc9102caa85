"""What one request may put into the engine, its trace and the history is bounded (issue 10)."""
from __future__ import annotations

import json

import httpx
import pytest

from engines.history import MAX_NOTE_CHARS, MAX_TAGS, validate_note
from engines.registry import registry
from engines.runtime import REQUEST_LIMITS, AsyncEngine, Checkpoint, EngineConfig, demo_checkpoint_path, load_checkpoint
from tests.server.conftest import SMALL_ENGINE, TRACED, assert_error


@pytest.fixture(scope="module")
def demo_checkpoint() -> Checkpoint:
    return load_checkpoint(demo_checkpoint_path(), load_weights=False)

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Tell me a story."}]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
async def test_a_user_longer_than_a_request_id_is_refused(client: httpx.AsyncClient, path: str) -> None:
    limit = REQUEST_LIMITS.max_user_chars
    prompt = {"messages": HELLO} if path == CHAT else {"prompt": "Once"}
    tracer = registry.get(TRACED).engine.tracer
    before = tracer.event_count
    body = assert_error(await client.post(path, json={"model": TRACED, **prompt, "max_tokens": 2,
                                                      "user": "u" * (limit + 1)}), 400)
    assert body["param"] == "user" and f"at most {limit} characters" in body["message"]
    assert tracer.event_count == before  # refused before anything reached the engine or its trace
    ok = await client.post(path, json={"model": TRACED, **prompt, "max_tokens": 2, "user": "u" * limit})
    assert ok.status_code == 200 and ok.json()["id"] == "u" * limit


def nested_schema(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}, "required": ["a"]}
    return value


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
async def test_a_body_nested_too_deep_is_a_400(client: httpx.AsyncClient, path: str) -> None:
    prompt = {"messages": HELLO} if path == CHAT else {"prompt": "Once"}
    deep = {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(300)}}
    body = assert_error(await client.post(path, json={"model": TRACED, **prompt, "response_format": deep}), 400)
    assert "too deep" in body["message"] and "64 levels" in body["message"]
    deep_text = {"type": "json_schema", "json_schema": {"name": "deep", "schema": json.dumps(nested_schema(300))}}
    body = assert_error(await client.post(path, json={"model": TRACED, **prompt, "response_format": deep_text}), 400)
    assert "too deep" in body["message"]


async def test_the_deepest_schema_accepted_crosses_into_an_engine_process(serve, demo_checkpoint) -> None:
    """Depth 240 used to fail pickling to the engine process (a 500); what parses now always crosses."""
    engine = AsyncEngine(demo_checkpoint, "deep", EngineConfig(**SMALL_ENGINE), backend="cpu", process=True)
    engine.start()
    try:
        async with serve(serving=[engine]) as http:
            schema = nested_schema(29)  # 2 levels a step: the body is then 63 deep
            fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
            response = await http.post(CHAT, json={"model": "deep", "messages": HELLO, "max_tokens": 4,
                                                   "response_format": fmt})
            assert response.status_code == 200, response.text
            deep = {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(300)}}
            refused = await http.post(CHAT, json={"model": "deep", "messages": HELLO, "response_format": deep})
            assert "too deep" in assert_error(refused, 400)["message"]  # was a 500: pickling recursed
            assert engine.is_alive
    finally:
        engine.shutdown()


@pytest.mark.parametrize("route", ["/debug/reset_engine", "/debug/dump_event_trace", "/debug/save_event_trace"])
async def test_debug_errors_echo_a_short_prefix_of_the_body(client: httpx.AsyncClient, route: str) -> None:
    raw = '{"model": ["' + "x" * 2_000_000 + '"]}'  # a model that is no string
    response = await client.post(route, content=raw)
    body = assert_error(response, 400)
    assert body["message"].startswith('Invalid request {"model": ["xxx')
    assert f"({len(raw)} characters)" in body["message"]
    assert len(response.content) < 2000
    deep = await client.post(route, content="[" * 100 + "]" * 100)
    assert "deeper than 64 levels" in assert_error(deep, 400)["message"]


async def test_save_event_trace_bounds_the_note_and_the_tags(client: httpx.AsyncClient) -> None:
    note = assert_error(await client.post("/debug/save_event_trace",
                                          json={"model": TRACED, "note": "n" * (MAX_NOTE_CHARS + 1)}), 400)
    assert '"note"' in note["message"] and str(MAX_NOTE_CHARS) in note["message"]
    tags = assert_error(await client.post("/debug/save_event_trace",
                                          json={"model": TRACED, "tags": [f"t{i}" for i in range(10_000)]}), 400)
    assert '"tags"' in tags["message"] and str(MAX_TAGS) in tags["message"]
    with pytest.raises(ValueError, match=f"at most {MAX_NOTE_CHARS} fit"):
        validate_note("n" * (MAX_NOTE_CHARS + 1))


async def test_a_request_id_costs_the_trace_once_not_per_event(client: httpx.AsyncClient) -> None:
    """The trace names a request's lane with its id and nothing else repeats it: a maximal id adds
    its own length to the dump once, however many events its request has."""
    limit = REQUEST_LIMITS.max_user_chars
    sizes, events = {}, {}
    for user in ("u", "u" * limit):
        await registry.get(TRACED).reset(clear_trace=True)
        body = {"model": TRACED, "messages": HELLO, "max_tokens": 24, "user": user,
                "debug_config": {"ignore_eos": True}}
        assert (await client.post(CHAT, json=body)).status_code == 200
        dump = await client.post("/debug/dump_event_trace", json={"model": TRACED})
        sizes[user] = len(dump.content)
        events[user] = dump.json()["otherData"]["event_count"]
    short, long = sizes.values()
    assert events["u"] == events["u" * limit] > 24  # one event or more per token
    assert long - short < 2 * limit, (short, long)
