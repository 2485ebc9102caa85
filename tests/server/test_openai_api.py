"""The OpenAI-compatible API through the ASGI app, on the real demo engine."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import httpx
import orjson
import pytest

from debugsite.asgi import application
from engines.registry import registry
from engines.runtime import RequestOutput
from tests.runtime.demo_engine import lane_events
from tests.server.conftest import TRACED, UNTRACED, assert_error, sse_payloads, wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Tell me a story."}]


def chat_body(**extra):
    return {"model": TRACED, "messages": HELLO, "max_tokens": 8, **extra}


# ----------------------------------------------------------------------------- models


async def test_models_lists_every_engine_in_order(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [TRACED, UNTRACED]
    assert all(m["object"] == "model" and isinstance(m["created"], int) for m in body["data"])


async def test_wrong_method_is_405_in_error_shape(client: httpx.AsyncClient) -> None:
    assert_error(await client.get(CHAT), 405)
    assert_error(await client.post("/v1/models"), 405)


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models"])
async def test_head_is_answered_where_get_is(client: httpx.AsyncClient, path: str) -> None:
    """HTTP requires HEAD wherever GET works; uptime checkers and load balancers probe with it."""
    assert (await client.head(path)).status_code == 200


# ------------------------------------------------------------------------ chat, whole


async def test_chat_non_streaming_ignore_eos_returns_max_tokens(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat_body(debug_config={"ignore_eos": True}, max_tokens=7))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) == len("chatcmpl-") + 32
    assert body["model"] == TRACED
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7
    # --enable-debug: the request's own metrics come back as usage.extra (MLC).
    assert usage["extra"]["completion_tokens"] == 7 and "ttft_s" in usage["extra"]


async def test_user_becomes_the_request_id(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat_body(user="my-request-1"))
    assert response.json()["id"] == "my-request-1"
    assert "my-request-1" in registry.get(TRACED).engine.tracer.request_ids()


async def test_concurrent_requests_with_one_user_both_run(client: httpx.AsyncClient) -> None:
    """Clients send one end-user id on many requests: the second gets its own id, not a 400."""
    body = chat_body(user="same-user", max_tokens=12, debug_config={"ignore_eos": True})
    first, second = await asyncio.gather(client.post(CHAT, json=body), client.post(CHAT, json=body))
    assert first.status_code == second.status_code == 200
    ids = {first.json()["id"], second.json()["id"]}
    assert "same-user" in ids and len(ids) == 2
    assert all(i.startswith("same-user") for i in ids)
    assert all(r.json()["usage"]["completion_tokens"] == 12 for r in (first, second))


async def test_max_completion_tokens_wins_over_max_tokens(client: httpx.AsyncClient) -> None:
    body = chat_body(max_tokens=20, max_completion_tokens=3, debug_config={"ignore_eos": True})
    response = await client.post(CHAT, json=body)
    assert response.json()["usage"]["completion_tokens"] == 3


async def test_n_choices(client: httpx.AsyncClient) -> None:
    body = chat_body(n=3, temperature=1.0, seed=1, debug_config={"ignore_eos": True}, max_tokens=4)
    response = (await client.post(CHAT, json=body)).json()
    assert [c["index"] for c in response["choices"]] == [0, 1, 2]
    assert response["usage"]["completion_tokens"] == 12


async def test_seed_makes_sampling_reproducible(client: httpx.AsyncClient) -> None:
    body = chat_body(temperature=1.0, seed=1234, max_tokens=12)
    first = (await client.post(CHAT, json=body)).json()["choices"][0]["message"]["content"]
    second = (await client.post(CHAT, json=body)).json()["choices"][0]["message"]["content"]
    assert first == second


async def test_logit_bias_bans_the_greedy_token(client: httpx.AsyncClient) -> None:
    body = chat_body(temperature=0, max_tokens=1, logprobs=True, debug_config={"ignore_eos": True})
    first = (await client.post(CHAT, json=body)).json()["choices"][0]["logprobs"]["content"][0]
    tokenizer = registry.get(TRACED).tokenizer
    greedy_id = next(i for i in range(tokenizer.vocab_size) if list(tokenizer.token_bytes(i)) == first["bytes"])
    banned = (await client.post(CHAT, json={**body, "logit_bias": {str(greedy_id): -100}})).json()
    assert banned["choices"][0]["logprobs"]["content"][0]["token"] != first["token"]


async def test_chat_logprobs_one_entry_per_token(client: httpx.AsyncClient) -> None:
    body = chat_body(logprobs=True, top_logprobs=3, max_tokens=5, debug_config={"ignore_eos": True})
    choice = (await client.post(CHAT, json=body)).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert entry["logprob"] <= 0 and isinstance(entry["bytes"], list)
        assert 1 <= len(entry["top_logprobs"]) <= 3


async def test_penalties_and_stop_are_accepted(client: httpx.AsyncClient) -> None:
    body = chat_body(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1, stop=["\n\n"])
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


async def test_response_format_json_schema(client: httpx.AsyncClient) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    body = chat_body(max_tokens=40,
                     response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    choice = (await client.post(CHAT, json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["message"]["content"])["color"] in ("red", "blue")


# --------------------------------------------------------------------- chat, streaming


async def test_chat_streaming_sse_with_usage(client: httpx.AsyncClient) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True}, max_tokens=6,
                     debug_config={"ignore_eos": True})
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(response.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text  # the demo model's token soup, but something


async def test_streaming_without_include_usage_has_no_usage_chunk(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat_body(stream=True))
    events = sse_payloads(response.text)
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])


@pytest.fixture
def aborts(client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids of every abort that reaches the ``demo`` engine (it runs on a thread here),
    on a server configured by ``client``."""
    engine = registry.get(TRACED).engine
    seen: list[str] = []
    real_abort = engine.abort_request

    def spy(request_id: str) -> RequestOutput | None:
        seen.append(request_id)
        return real_abort(request_id)

    monkeypatch.setattr(engine, "abort_request", spy)
    return seen


async def leave_when(body: dict, gone: Callable[[list[dict]], bool]) -> list[dict]:
    """Stream a chat request through the ASGI app with a client that disconnects once ``gone``
    holds of the ASGI messages sent so far (httpx's ASGI transport reads whole replies, so its
    clients cannot leave midway). Returns those messages once every abort sent reached the engine."""
    sent: list[dict] = []
    request_sent = False

    async def receive() -> dict:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await wait_until(lambda: gone(sent))
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(application(scope, receive, send), timeout=30)
    # The engine takes commands in order: once this dump is answered, every abort sent has arrived.
    await registry.get(TRACED).dump_trace()
    return sent


def finished_by_abort(request_id: str) -> bool:
    """Whether the ``demo`` engine's trace ends ``request_id`` with finish reason ``abort``."""
    lane = lane_events(registry.get(TRACED).engine.tracer.dump(), request_id)
    finishes = [e for e in lane if e["name"] == "finish"]
    return bool(finishes) and finishes[-1]["args"]["finish_reason"] == "abort"


def streamed_a_chunk(sent: list[dict]) -> bool:
    """Whether the ASGI messages sent so far hold a piece of the body."""
    return any(m["type"] == "http.response.body" and m.get("body") for m in sent)


async def test_client_disconnect_mid_stream_aborts_the_request_once(aborts: list[str]) -> None:
    """Django cancels the stream; the engine hears one abort, which frees the request's KV pages."""
    engine = registry.get(TRACED)
    await leave_when(chat_body(stream=True, max_tokens=1000, user="gone-1", debug_config={"ignore_eos": True}),
                     streamed_a_chunk)
    assert aborts == ["gone-1"]
    await wait_until(lambda: engine.engine.metrics.as_dict()["num_running_requests"] == 0)
    assert finished_by_abort("gone-1")


async def test_client_disconnect_before_the_first_token_aborts_the_request_once(
        aborts: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Django cancels the view while it waits for the first output; the engine hears one abort."""
    engine = registry.get(TRACED)
    real_step = engine.engine.step

    def held_step() -> list[RequestOutput]:
        # Hold the first step until the client's stream has closed: it leaves before any token, surely.
        deadline = time.monotonic() + 30
        while engine.is_streaming("gone-2") and time.monotonic() < deadline:
            time.sleep(0.005)
        return real_step()

    monkeypatch.setattr(engine.engine, "step", held_step)
    sent = await leave_when(chat_body(stream=True, max_tokens=1000, user="gone-2", debug_config={"ignore_eos": True}),
                            lambda _: engine.is_streaming("gone-2"))
    assert sent == []  # not even the headers: the view still waited for the first output
    assert aborts == ["gone-2"]
    await wait_until(lambda: engine.engine.metrics.as_dict()["num_running_requests"] == 0)
    assert finished_by_abort("gone-2")


# ------------------------------------------------------------------------- completions


async def test_completions_text_prompt(client: httpx.AsyncClient) -> None:
    body = {"model": TRACED, "prompt": "Once upon a time", "max_tokens": 5, "debug_config": {"ignore_eos": True}}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["object"] == "text_completion" and payload["id"].startswith("cmpl-")
    assert payload["choices"][0]["finish_reason"] == "length"
    assert payload["usage"]["completion_tokens"] == 5


async def test_completions_token_prompt_streaming_with_logprobs(client: httpx.AsyncClient) -> None:
    body = {"model": TRACED, "prompt": [1, 200, 300, 400], "max_tokens": 4, "stream": True, "logprobs": 2,
            "stream_options": {"include_usage": True}, "debug_config": {"ignore_eos": True}}
    events = sse_payloads((await client.post(COMPLETIONS, json=body)).text)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["prompt_tokens"] == 4 and events[-2]["usage"]["completion_tokens"] == 4
    chunks = events[:-2]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 4
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and offsets[0] == 0


# ------------------------------------------------------------------------ debug_config


async def test_debug_config_ignored_without_enable_debug(serve, caplog) -> None:
    async with serve(enable_debug=False) as http:
        with caplog.at_level(logging.WARNING, logger="engines"):
            response = await http.post(CHAT, json=chat_body(debug_config={"ignore_eos": True}))
    assert response.status_code == 200
    assert "extra" not in response.json()["usage"]
    assert any("debug_config" in r.getMessage() and "--enable-debug" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_query_engine_metrics_special_request(client: httpx.AsyncClient, path: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Answered by the view from the engine's metrics: the engine takes no step and traces nothing."""
    engine = registry.get(TRACED)
    steps: list[None] = []
    real_step = engine.engine.step

    def counted_step() -> list[RequestOutput]:
        steps.append(None)
        return real_step()

    monkeypatch.setattr(engine.engine, "step", counted_step)
    events = engine.engine.tracer.event_count
    body = {"model": TRACED, "stream": True, "stream_options": {"include_usage": True},
            "debug_config": {"special_request": "query_engine_metrics"}, "user": "metrics-query"}
    body |= {"messages": []} if path == CHAT else {"prompt": ""}
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    (chunk, done) = sse_payloads(response.text)
    assert done == "[DONE]" and chunk["choices"] == []
    assert chunk["usage"]["prompt_tokens"] == 0 and chunk["usage"]["completion_tokens"] == 0
    assert "engine_prefill_time_sum" in chunk["usage"]["extra"]
    # Server-side events travel with the engine's next command: after this dump, any sent was recorded.
    await engine.dump_trace()
    # Internal queries never show up in the trace (a fix over MLC), nor reach the step loop.
    assert engine.engine.tracer.event_count == events
    assert steps == []


async def test_special_request_without_stream_is_422(client: httpx.AsyncClient) -> None:
    body = chat_body(debug_config={"special_request": "query_engine_metrics"})
    error = assert_error(await client.post(CHAT, json=body), 422)
    assert error["message"].endswith("DebugConfig.special_request requires stream=True")


# ------------------------------------------------------------------------------ errors


async def test_body_not_json_is_400(client: httpx.AsyncClient) -> None:
    error = assert_error(await client.post(CHAT, content=b"{not json"), 400)
    assert "not valid JSON" in error["message"]
    assert_error(await client.post(CHAT, content=b"[1, 2]"), 400, "the request body must be a JSON object")


async def test_bad_parameter_is_400_naming_the_field(client: httpx.AsyncClient) -> None:
    error = assert_error(await client.post(CHAT, json=chat_body(temperature=5)), 400)
    assert error["param"] == "temperature" and "temperature" in error["message"]
    error = assert_error(await client.post(CHAT, json=chat_body(debug_config={"ignore_eso": True})), 400)
    assert "ignore_eso" in error["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, "/debug/dump_engine_metrics"])
async def test_body_over_the_upload_limit_is_413(client: httpx.AsyncClient, settings, path: str) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = {"model": TRACED, "prompt": "x " * 1000, "max_tokens": 1}
    error = assert_error(await client.post(path, json=body), 413)
    assert "1000 bytes" in error["message"]


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    error = assert_error(await client.post(CHAT, json=chat_body(model="gpt-17")), 404)
    assert error["message"].startswith('The requested model "gpt-17" is not served.')


async def test_missing_model_is_400(client: httpx.AsyncClient) -> None:
    body = chat_body()
    del body["model"]
    error = assert_error(await client.post(CHAT, json=body), 400)
    assert error["param"] == "model"


async def test_engine_refusals_are_400(client: httpx.AsyncClient) -> None:
    too_long = {"model": TRACED, "prompt": [5] * 4000, "max_tokens": 1}
    error = assert_error(await client.post(COMPLETIONS, json=too_long), 400)
    assert "Shorten the prompt" in error["message"]
    outside = {"model": TRACED, "prompt": [10**6], "max_tokens": 1}
    assert "outside the vocabulary" in assert_error(await client.post(COMPLETIONS, json=outside), 400)["message"]
    bias = {"model": TRACED, "prompt": "hi", "logit_bias": {str(10**6): 5}}
    assert_error(await client.post(COMPLETIONS, json=bias), 400)


async def test_unknown_api_path_is_a_json_404(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/engines"), 404, "No endpoint GET /v1/engines on this server.")
    assert_error(await client.post("/debug/nothing", json={}), 404)
