"""One clock for a request's life: stamped where the request reaches the server (the outermost
ASGI layer), carried to the engine, and what queue time, TTFT and end-to-end latency count from
(docs/metrics.md)."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from debugsite.asgi import application
from engines.request_arrival import AGE_HEADER, ARRIVAL_KEY, StampArrival, age_headers, age_of, arrival_of
from engines.registry import registry
from tests.server.conftest import TRACED, sse_payloads
from tests.server.test_microserving import PROMPT, body, disaggregated, new_user

HELD_S = 0.6


class Held:
    """An app that holds each request this long after it was stamped: what the step in flight,
    the tokenizer and the server's other work cost a request before the engine takes it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await asyncio.sleep(HELD_S)
        await self.app(scope, receive, send)


@pytest.fixture
async def held(serve):
    serve(enable_debug=True)
    await registry.get(TRACED).reset(clear_trace=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=StampArrival(Held(application))),
                                 base_url="http://127.0.0.1", timeout=60) as http:
        yield http


@pytest.mark.parametrize("stream", [False, True])
async def test_the_time_before_the_engine_takes_a_request_counts(held, stream) -> None:
    request = {"model": TRACED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
               "stream": stream, "stream_options": {"include_usage": True} if stream else None,
               "debug_config": {"ignore_eos": True}}
    started = time.perf_counter()
    response = await held.post("/v1/chat/completions", json={k: v for k, v in request.items() if v is not None})
    client_e2e = time.perf_counter() - started
    assert response.status_code == 200, response.text
    usage = (sse_payloads(response.text)[-2] if stream else response.json())["usage"]
    extra = usage["extra"]
    assert extra["queue_time_s"] >= HELD_S and extra["ttft_s"] >= HELD_S
    assert HELD_S <= extra["end_to_end_latency_s"] <= client_e2e
    metrics = await registry.get(TRACED).metrics()
    assert metrics["ttft_s"]["min"] >= HELD_S and metrics["queue_time_s"]["min"] >= HELD_S
    # The anatomy (issue 61): its phases add up to the same E2E, the held time as the server's.
    breakdown = extra["time_breakdown"]
    assert sum(breakdown.values()) == pytest.approx(extra["end_to_end_latency_s"], abs=1e-3)
    assert breakdown["server"] >= HELD_S
    assert any("server" in sentence for sentence in extra["diagnosis"]), extra["diagnosis"]


async def test_the_trace_s_queue_span_opens_at_the_arrival(held) -> None:
    response = await held.post("/v1/completions", json={"model": TRACED, "prompt": "hi", "max_tokens": 2,
                                                        "user": "stamped"})
    assert response.status_code == 200, response.text
    trace = (await held.post("/debug/dump_event_trace", json={"model": TRACED})).json()
    lane_tid = next(e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"
                    and e["args"]["name"] == "stamped")
    lane = [e for e in trace["traceEvents"] if e["tid"] == lane_tid and e["ph"] != "M"]
    assert [e["name"] for e in lane[:2]] == ["receive request", "queue (0)"]
    assert lane[0]["ts"] == lane[1]["ts"]
    queue_end = next(e for e in lane if e["name"] == "queue (0)" and e["ph"] == "E")
    tokenization = next(e for e in lane if e["name"].startswith("tokenization") and e["ph"] == "B")
    # The hold came before the view: the tokenizer ran after it, inside the queue span.
    assert (tokenization["ts"] - lane[0]["ts"]) / 1e6 >= HELD_S and queue_end["ts"] > tokenization["ts"]


def test_the_stamp_is_taken_once_by_the_outermost_layer_and_ages_are_checked() -> None:
    class Request:
        def __init__(self, scope, headers) -> None:
            self.scope, self.headers = scope, headers

    stamped = {ARRIVAL_KEY: 100.0}
    assert arrival_of(Request(stamped, {AGE_HEADER: "2.5"})) == 100.0  # the stamp is this server's
    assert age_of(Request(stamped, {AGE_HEADER: "2.5"})) == 2.5
    for bad in ("-1", "nan", "inf", "1e9", "soon", ""):
        assert age_of(Request(stamped, {AGE_HEADER: bad})) == 0.0
    before = time.perf_counter()
    assert before <= arrival_of(Request({}, {})) <= time.perf_counter()  # unstamped: now
    age = float(age_headers(time.perf_counter() - 3.0)[AGE_HEADER])
    assert 3.0 <= age < 4.0


async def test_a_router_s_age_moves_the_decode_engine_s_clock_back(client) -> None:
    """The MicroServing calls behind a router carry the client's request's age: the decode
    engine's TTFT is the client's, not start_generate's own."""
    from tests.server.conftest import UNTRACED

    await registry.get(UNTRACED).reset()
    user = new_user()
    prep = await client.post("/microserving/prep_recv", json=body(user, end=-1))
    send = await client.post("/microserving/remote_send", json=body(
        user, TRACED, begin=prep.json()["prefix_matched_length"], end=-1,
        kv_addr_info=prep.json()["kv_append_metadata"], recv_rank=0), headers={AGE_HEADER: "1.5"})
    assert send.status_code == 200, send.text
    start = await client.post("/microserving/start_generate", json=body(user, begin=len(PROMPT) - 1),
                              headers={AGE_HEADER: "4.0"})
    assert start.status_code == 200, start.text
    assert start.json()["usage"]["extra"]["ttft_s"] >= 4.0
    plain = await disaggregated(client, new_user(), -1)  # no router: the call's own arrival
    assert plain.json()["usage"]["extra"]["ttft_s"] < 4.0


@pytest.mark.django_db(transaction=True)
async def test_a_saved_trace_keeps_each_request_s_anatomy_as_the_client_got_it(held) -> None:
    """The history's request summary holds the same time breakdown and diagnosis the client's
    ``usage.extra`` had: one definition (docs/metrics.md, "Anatomy of a request"), two readers."""
    from engines.history import asave_trace
    from engines.models import RequestSummary

    response = await held.post("/v1/completions", json={"model": TRACED, "prompt": "hi", "max_tokens": 3,
                                                        "user": "anatomy-kept"})
    assert response.status_code == 200, response.text
    extra = response.json()["usage"]["extra"]
    trace = (await held.post("/debug/dump_event_trace", json={"model": TRACED})).json()
    record = await asave_trace(trace, engine=TRACED, model="demo")
    row = await RequestSummary.objects.aget(trace=record, request_id="anatomy-kept")
    assert row.time_breakdown == pytest.approx(extra["time_breakdown"], abs=1e-9)
    assert row.diagnosis == extra["diagnosis"] and row.diagnosis  # the hold: "server ..." at least
    assert row.time_breakdown["server"] >= HELD_S
