"""The disaggregating router's choices, against mock upstream servers: which decode server, when
``remote_send`` is skipped, a preempted request run once more, upstream errors passed through, one
``X-Request-Id`` on every call and on the reply, vLLM's ``/tokenize`` and ``/detokenize`` relayed (the
last two also through the ASGI app, as served)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from engines.disagg.router import DisaggRouter, RouterError
from engines.registry import ServerOptions, configure, registry

PREFILL, DECODE_A, DECODE_B = "http://prefill", "http://decode-a", "http://decode-b"


class Upstreams:
    """Mock prefill and decode servers that log every call and answer as told."""

    def __init__(self, matched: int = 0, prompt_length: int = 10, preempt_times: int = 0, stream: bool = False):
        self.calls: list[tuple[str, str, dict]] = []
        #: Each call's X-Request-Id (None: it had none).
        self.request_ids: list[str | None] = []
        #: Each call's (traceparent, tracestate).
        self.trace_context: list[tuple[str | None, str | None]] = []
        self.matched, self.prompt_length = matched, prompt_length
        self.preempt_times, self.stream = preempt_times, stream

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        host, path = f"http://{request.url.host}", request.url.path
        self.calls.append((host, path, body))
        self.request_ids.append(request.headers.get("x-request-id"))
        self.trace_context.append((request.headers.get("traceparent"), request.headers.get("tracestate")))
        if path == "/microserving/prep_recv":
            return httpx.Response(200, json={"kv_append_metadata": "m", "prefix_matched_length": self.matched,
                                             "prompt_length": self.prompt_length})
        if path == "/microserving/remote_send":
            return httpx.Response(200, json={})
        if path == "/microserving/start_generate":
            reason = "preempt" if self.preempt_times > 0 else "length"
            self.preempt_times -= 1
            text = "" if reason == "preempt" else "hello"
            choice = {"index": 0, "text": text, "finish_reason": reason}
            if self.stream:
                events = [{"choices": [{"index": 0, "text": "", "finish_reason": None}]}, {"choices": [choice]}]
                sse = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
                return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})
            return httpx.Response(200, json={"choices": [choice]})
        if path == "/tokenize":
            return httpx.Response(200, json={"count": 2, "max_model_len": 2048, "tokens": [1, 2], "token_strs": None})
        if path == "/detokenize":
            if max(body["tokens"]) >= 49152:
                return httpx.Response(400, json={"object": "error", "message": "token id 49152 is outside the "
                                                 "vocabulary (size 49152)", "type": "BadRequestError",
                                                 "param": "tokens", "code": 400})
            return httpx.Response(200, json={"prompt": "hi"})
        return httpx.Response(404, json={"object": "error", "message": "no route", "code": 404})

    def router(self, decode=(DECODE_A,)) -> DisaggRouter:
        return DisaggRouter([PREFILL], list(decode), transport=httpx.MockTransport(self.handler))

    def paths(self) -> list[str]:
        return [path.rsplit("/", 1)[1] for _, path, _ in self.calls]


async def test_three_calls_in_order_tied_by_one_fresh_id():
    up = Upstreams(matched=0, prompt_length=10)
    reply = await up.router().route({"model": "demo", "prompt": "hi", "user": "alice"})
    assert orjson.loads(reply.body)["choices"][0]["text"] == "hello"
    assert up.paths() == ["prep_recv", "remote_send", "start_generate"]
    users = {body["user"] for _, _, body in up.calls}
    assert len(users) == 1 and next(iter(users)).startswith("alice-")
    prep, send, start = (body for _, _, body in up.calls)
    assert prep["end"] == -1 and send["begin"] == 0 and send["kv_addr_info"] == "m" and start["begin"] == 9
    assert [host for host, _, _ in up.calls] == [DECODE_A, PREFILL, DECODE_A]


async def test_streaming_options_go_only_to_start_generate():
    up = Upstreams(stream=True)
    reply = await up.router().route({"model": "demo", "prompt": "hi", "stream": True,
                                     "stream_options": {"include_usage": True}})
    assert b"hello" in b"".join([e async for e in reply.stream])
    for _, path, body in up.calls:
        streaming = path.endswith("start_generate")
        assert ("stream" in body) == streaming and ("stream_options" in body) == streaming, path


async def test_remote_send_is_skipped_when_the_decode_cache_holds_the_window():
    up = Upstreams(matched=9, prompt_length=10)
    await up.router().route({"model": "demo", "prompt": "hi"})
    assert up.paths() == ["prep_recv", "start_generate"]


async def test_the_least_loaded_decode_server_is_picked():
    up = Upstreams()
    router = up.router(decode=(DECODE_A, DECODE_B))
    router.in_flight[DECODE_A] = 2
    await router.route({"model": "demo", "prompt": "hi"})
    assert up.calls[0][0] == DECODE_B
    router.in_flight[DECODE_A] = 0
    await router.route({"model": "demo", "prompt": "hi"})
    assert up.calls[-1][0] == DECODE_A
    assert router.in_flight == {DECODE_A: 0, DECODE_B: 0}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_preempted_request_is_run_once_more(stream):
    up = Upstreams(preempt_times=1, stream=stream)
    router = up.router()
    reply = await router.route({"model": "demo", "prompt": "hi", "stream": stream})
    body = b"".join([e async for e in reply.stream]) if stream else reply.body
    assert b'"hello"' in body and b"preempt" not in body
    assert up.paths().count("prep_recv") == 2
    ids = [b["user"] for _, p, b in up.calls if p.endswith("prep_recv")]
    assert ids[0] != ids[1]  # each attempt is a new request on the engines
    assert router.in_flight[DECODE_A] == 0


async def test_a_second_preemption_reaches_the_client():
    up = Upstreams(preempt_times=2)
    reply = await up.router().route({"model": "demo", "prompt": "hi"})
    assert orjson.loads(reply.body)["choices"][0]["finish_reason"] == "preempt"


async def test_upstream_errors_come_back_as_they_were():
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"object": "error", "message": "temperature must be >= 0", "code": 400})
    router = DisaggRouter([PREFILL], [DECODE_A], transport=httpx.MockTransport(refuse))
    with pytest.raises(RouterError) as err:
        await router.route({"model": "demo", "prompt": "hi", "temperature": -1})
    assert err.value.status == 400 and err.value.body["message"] == "temperature must be >= 0"
    assert router.in_flight[DECODE_A] == 0

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")
    router = DisaggRouter([PREFILL], [DECODE_A], transport=httpx.MockTransport(down))
    with pytest.raises(RouterError) as err:
        await router.route({"model": "demo", "prompt": "hi"})
    assert err.value.status == 502 and "could not be reached" in err.value.body["message"]


def test_a_router_needs_both_sides():
    with pytest.raises(ValueError, match="at least one prefill URL and one decode URL"):
        DisaggRouter([], [DECODE_A])


async def test_a_relayed_stream_counts_in_flight_and_closing_it_closes_upstream():
    from engines.registry import registry
    from engines.views.api import counted_stream

    closed = []

    async def upstream():
        try:
            for i in range(3):
                yield f"data: {i}\n\n".encode()
        finally:
            closed.append(True)

    before = registry.responses_in_flight
    body = counted_stream(upstream())
    assert await anext(body) == b"data: 0\n\n"
    assert registry.responses_in_flight == before + 1  # a draining shutdown waits for it
    await body.aclose()  # the client went away
    assert closed == [True] and registry.responses_in_flight == before


async def test_every_call_after_the_first_says_how_old_the_request_is():
    """The servers behind the router count a request's life from its arrival at the router."""
    import time

    seen: list[tuple[str, str | None]] = []
    up = Upstreams(matched=0, prompt_length=10)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path.rsplit("/", 1)[1], request.headers.get("x-request-age")))
        return up.handler(request)

    router = DisaggRouter([PREFILL], [DECODE_A], transport=httpx.MockTransport(handler))
    await router.route({"model": "demo", "prompt": "hi"}, arrival=time.perf_counter() - 2.0)
    ages = dict(seen)
    assert ages["prep_recv"] is None  # it starts no request
    assert 2.0 <= float(ages["remote_send"]) <= float(ages["start_generate"]) < 10.0


async def test_one_model_is_the_first_decode_server_s_answer_relayed():
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append((request.url.host, request.url.path))
        if request.url.path == "/v1/models/org/demo":
            return httpx.Response(200, json={"id": "org/demo", "object": "model", "created": 1, "owned_by": "engines"})
        return httpx.Response(404, json={"object": "error", "message": "not served", "code": 404})

    router = DisaggRouter([PREFILL], [DECODE_A, DECODE_B], transport=httpx.MockTransport(handler))
    found = await router.model("org/demo")
    assert found.status == 200 and orjson.loads(found.body)["id"] == "org/demo"
    missing = await router.model("nope")
    assert missing.status == 404 and orjson.loads(missing.body)["message"] == "not served"
    assert asked == [("decode-a", "/v1/models/org/demo"), ("decode-a", "/v1/models/nope")]


# ------------------------------------------------------------------------- X-Request-Id


@pytest.mark.parametrize("stream", [False, True])
async def test_every_call_of_every_attempt_carries_the_client_s_request_id(stream):
    up = Upstreams(preempt_times=1, stream=stream)  # two attempts: six calls
    reply = await up.router().route({"model": "demo", "prompt": "hi", "stream": stream}, request_id="req_7f3a")
    if stream:
        assert b"hello" in b"".join([e async for e in reply.stream])
    assert len(up.calls) == 6 and up.request_ids == ["req_7f3a"] * 6
    # Without a user it names the engines' request too (as on one server), suffixed per request and attempt.
    users = [body["user"] for _, _, body in up.calls]
    assert all(u.startswith("req_7f3a-") for u in users) and users[0] != users[-1]


async def test_a_user_still_names_the_engines_request_and_the_header_stays_the_client_s():
    up = Upstreams()
    await up.router().route({"model": "demo", "prompt": "hi", "user": "alice"}, request_id="trace-42")
    assert all(body["user"].startswith("alice-") for _, _, body in up.calls)
    assert up.request_ids == ["trace-42"] * 3


async def test_without_one_the_router_mints_one_for_both_halves():
    up = Upstreams(matched=0, prompt_length=10)
    await up.router().route({"model": "demo", "prompt": "hi"})
    (minted,) = set(up.request_ids)
    assert minted.startswith("disagg-") and [h for h, _, _ in up.calls] == [DECODE_A, PREFILL, DECODE_A]
    up.calls.clear()
    up.request_ids.clear()
    await up.router().route({"model": "demo", "prompt": "hi"})
    assert set(up.request_ids) != {minted}  # one per request


async def test_the_longest_request_id_still_makes_an_engine_id_the_servers_take():
    from engines.request_ids import MAX_REQUEST_ID_CHARS

    up = Upstreams(preempt_times=1)
    longest = "x" * MAX_REQUEST_ID_CHARS
    await up.router().route({"model": "demo", "prompt": "hi"}, request_id=longest)
    assert up.request_ids == [longest] * 6  # the header goes as it came
    assert max(len(body["user"]) for _, _, body in up.calls) == MAX_REQUEST_ID_CHARS


@pytest.fixture
async def routed() -> AsyncIterator[tuple[httpx.AsyncClient, Upstreams]]:
    """The ASGI app as ``serve --router disagg`` serves it (no engines), in front of mock upstreams."""
    from debugsite.asgi import application

    up = Upstreams()
    configure([], start=False)
    registry.router = up.router(decode=(DECODE_A, DECODE_B))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application),
                                     base_url="http://127.0.0.1", timeout=30) as http:
            yield http, up
    finally:
        await registry.router.aclose()
        registry.replace([], ServerOptions())


async def test_the_router_s_reply_echoes_the_id_its_upstream_calls_carried(routed):
    http, up = routed
    sent = await http.post("/v1/completions", json={"model": "demo", "prompt": "hi"},
                           headers={"X-Request-Id": "req_7f3a"})
    assert sent.status_code == 200 and sent.headers["x-request-id"] == "req_7f3a"
    assert up.request_ids == ["req_7f3a"] * 3
    up.request_ids.clear()
    minted = await http.post("/v1/chat/completions", json={"model": "demo", "messages": [], "stream": True})
    assert minted.headers["x-request-id"].startswith("disagg-")
    assert up.request_ids == [minted.headers["x-request-id"]] * 3
    up.request_ids.clear()
    listed = await http.get("/v1/models", headers={"X-Request-Id": "m-1"})
    assert listed.headers["x-request-id"] == "m-1" and up.request_ids == ["m-1"]


async def test_an_upstream_error_through_the_router_echoes_the_id_too(routed):
    http, _ = routed
    seen = []

    def refuse(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("x-request-id"))
        return httpx.Response(400, json={"object": "error", "message": "temperature must be >= 0", "code": 400})

    registry.router = DisaggRouter([PREFILL], [DECODE_A], transport=httpx.MockTransport(refuse))
    refused = await http.post("/v1/completions", json={"model": "demo", "prompt": "hi", "temperature": -1})
    assert refused.status_code == 400 and refused.json()["message"] == "temperature must be >= 0"
    assert refused.headers["x-request-id"].startswith("disagg-") and seen == [refused.headers["x-request-id"]]


# ------------------------------------------------------------------------- /tokenize, /detokenize


async def test_tokenize_and_detokenize_are_the_first_decode_server_s_answers():
    up = Upstreams()
    router = up.router(decode=(DECODE_A, DECODE_B))
    router.in_flight[DECODE_A] = 3  # no matter: the token ids of one model are the same on any
    counted = await router.tokenizer_call("/tokenize", {"model": "demo", "prompt": "hi"}, "tok-1")
    assert counted.status == 200 and orjson.loads(counted.body)["tokens"] == [1, 2]
    back = await router.tokenizer_call("/detokenize", {"model": "demo", "tokens": [1, 2]}, "tok-2")
    assert orjson.loads(back.body) == {"prompt": "hi"}
    assert [(host, path) for host, path, _ in up.calls] == [(DECODE_A, "/tokenize"), (DECODE_A, "/detokenize")]
    assert up.calls[0][2] == {"model": "demo", "prompt": "hi"} and up.request_ids == ["tok-1", "tok-2"]


async def test_a_refused_tokenizer_call_comes_back_in_the_error_shape():
    up = Upstreams()
    with pytest.raises(RouterError) as err:
        await up.router().tokenizer_call("/detokenize", {"model": "demo", "tokens": [49152]})
    assert err.value.status == 400 and err.value.body["param"] == "tokens"  # the upstream's own error object

    def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="<html>Bad Gateway</html>")  # a proxy's page, not JSON
    router = DisaggRouter([PREFILL], [DECODE_A], transport=httpx.MockTransport(broken))
    with pytest.raises(RouterError) as err:
        await router.tokenizer_call("/tokenize", {"prompt": "hi"})
    assert err.value.status == 502 and err.value.body["object"] == "error"
    assert "upstream answered 502: <html>Bad Gateway" in err.value.body["message"]

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")
    router = DisaggRouter([PREFILL], [DECODE_A], transport=httpx.MockTransport(down))
    with pytest.raises(RouterError) as err:
        await router.tokenizer_call("/tokenize", {"prompt": "hi"})
    assert err.value.status == 502 and "could not be reached" in err.value.body["message"]


async def test_the_router_serves_tokenize_and_detokenize(routed):
    http, up = routed
    counted = await http.post("/tokenize", json={"model": "demo", "prompt": "hi"}, headers={"X-Request-Id": "t-1"})
    assert counted.status_code == 200, counted.text
    assert counted.json() == {"count": 2, "max_model_len": 2048, "tokens": [1, 2], "token_strs": None}
    assert counted.headers["x-request-id"] == "t-1"
    back = await http.post("/detokenize", json={"model": "demo", "tokens": [1, 2]})
    assert back.status_code == 200 and back.json() == {"prompt": "hi"}
    assert back.headers["x-request-id"].startswith("disagg-")
    assert [path for _, path, _ in up.calls] == ["/tokenize", "/detokenize"]
    assert up.request_ids == ["t-1", back.headers["x-request-id"]]
    refused = await http.post("/detokenize", json={"model": "demo", "tokens": [49152]})
    assert refused.status_code == 400 and refused.json()["param"] == "tokens"
    assert refused.json()["message"].startswith("token id 49152 is outside")
    not_json = await http.post("/tokenize", content=b"{nope")  # refused by the router itself, same shape
    assert not_json.status_code == 400 and not_json.json()["object"] == "error" and len(up.calls) == 3


async def test_the_client_s_trace_context_goes_on_to_start_generate_only():
    """start_generate's server makes the request's span (engines.otel): it joins the client's trace."""
    up = Upstreams(matched=0, prompt_length=10)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await up.router().route({"model": "demo", "prompt": "hi"}, request_id="t-1",
                            trace_context={"traceparent": parent, "tracestate": "v=1"})
    assert up.paths() == ["prep_recv", "remote_send", "start_generate"]
    assert up.trace_context == [(None, None), (None, None), (parent, "v=1")]
