"""MLC's /debug endpoints through the ASGI app: MLC's texts, with our fixes (see the reference)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engines.registry import registry
from tests.server.conftest import TRACED, UNTRACED, assert_error, assert_invalid_request, sse_payloads

ROUTES = ["dump_event_trace", "save_event_trace", "dump_engine_metrics", "reset_engine", "cuda_profiler_start",
          "cuda_profiler_stop", "profile_start", "profile_stop", "list_requests", "abort_request", "dump_kv_cache"]


async def generate(http: httpx.AsyncClient, user: str, max_tokens: int = 4, model: str = TRACED) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "user": user, "debug_config": {"ignore_eos": True}}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


# ------------------------------------------------------------------------------ gating


@pytest.mark.parametrize("route", ROUTES)
async def test_debug_routes_absent_without_enable_debug(serve, route: str) -> None:
    async with serve(enable_debug=False) as http:
        error = assert_error(await http.post(f"/debug/{route}", json={"model": TRACED}), 404)
        assert_error(await http.get(f"/debug/{route}"), 404)
    assert "--enable-debug" in error["message"]


@pytest.mark.parametrize("route", ROUTES)
async def test_debug_routes_are_post_only(client: httpx.AsyncClient, route: str) -> None:
    assert_error(await client.get(f"/debug/{route}"), 405)


# ------------------------------------------------------------------------ event trace


async def test_dump_event_trace_holds_the_request(client: httpx.AsyncClient) -> None:
    await generate(client, "traced-1", max_tokens=3)
    response = await client.post("/debug/dump_event_trace", json={"model": TRACED})
    assert response.status_code == 200
    trace = response.json()
    assert trace["otherData"]["engine"] == TRACED
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    tid = next(t for t, name in lanes.items() if name == "traced-1")
    names = [(e["name"], e["ph"]) for e in trace["traceEvents"] if e.get("tid") == tid and e["ph"] != "M"]
    # Server-side events first, then the engine's; prefill and decode as B/E spans.
    assert names[0] == ("receive request", "i")
    assert ("tokenization (0)", "B") in names and ("tokenization (0)", "E") in names
    assert ("prefill (0)", "B") in names and ("prefill (0)", "E") in names
    assert ("decode (0)", "B") in names and ("decode (0)", "E") in names
    assert names[-1] == ("finish", "i")


@pytest.mark.parametrize("raw", [b"{oops", b"[]", b'{"model": 7}'])
async def test_dump_event_trace_invalid_request(client: httpx.AsyncClient, raw: bytes) -> None:
    response = await client.post("/debug/dump_event_trace", content=raw)
    assert_invalid_request(response, raw.decode())


@pytest.mark.parametrize("raw", [b"", b"{}", b'{"no_model": 1}'])
async def test_dump_event_trace_without_a_model_is_the_first_engine_s(client: httpx.AsyncClient, raw: bytes) -> None:
    response = await client.post("/debug/dump_event_trace", content=raw)
    assert response.status_code == 200 and response.json()["otherData"]["engine"] == TRACED


async def test_dump_event_trace_unknown_model(client: httpx.AsyncClient) -> None:
    response = await client.post("/debug/dump_event_trace", json={"model": "nope"})
    assert_error(response, 400, 'The requested model "nope" is not served.')


async def test_dump_event_trace_tracing_off(client: httpx.AsyncClient) -> None:
    response = await client.post("/debug/dump_event_trace", json={"model": UNTRACED})
    assert_error(response, 400, f'The requested model "{UNTRACED}" does not enable tracing')


async def test_lone_engine_is_not_returned_for_another_name(serve, engines) -> None:
    # MLC hands a lone engine to any model name; our lookup never guesses.
    async with serve(serving=[engines[TRACED]]) as http:
        response = await http.post("/debug/dump_engine_metrics", json={"model": "other"})
    assert_error(response, 400, 'The requested model "other" is not served.')


# ----------------------------------------------------------------------- engine metrics


@pytest.mark.parametrize("content", [b"", b"{}", b'{"model": "demo"}'])
async def test_dump_engine_metrics(client: httpx.AsyncClient, content: bytes) -> None:
    response = await client.post("/debug/dump_engine_metrics", content=content)
    assert response.status_code == 200, response.text
    metrics = response.json()["metrics"]
    assert {"engine_prefill_time_sum", "engine_decode_time_sum", "prompt_tokens_sum"} <= metrics.keys()


async def test_dump_engine_metrics_errors(client: httpx.AsyncClient) -> None:
    assert_invalid_request(await client.post("/debug/dump_engine_metrics", content=b"{oops"), "{oops")
    response = await client.post("/debug/dump_engine_metrics", json={"model": "nope"})
    assert_error(response, 400, 'The requested model "nope" is not served.')


async def test_dump_engine_metrics_names_an_engine(client: httpx.AsyncClient) -> None:
    await generate(client, "untraced-1", max_tokens=3, model=UNTRACED)
    response = await client.post("/debug/dump_engine_metrics", json={"model": UNTRACED})
    assert response.json()["metrics"]["completion_tokens_sum"] >= 3


# ------------------------------------------------------------------------------- reset


async def test_reset_engine_zeroes_metrics_after_completion(client: httpx.AsyncClient) -> None:
    await generate(client, "before-reset", max_tokens=5)
    metrics = (await client.post("/debug/dump_engine_metrics", json={"model": TRACED})).json()["metrics"]
    assert metrics["completion_tokens_sum"] == 5 and metrics["engine_decode_time_sum"] > 0
    response = await client.post("/debug/reset_engine", json={"model": TRACED})
    assert response.status_code == 200
    assert response.json() == {"status": "reset", "model": TRACED, "trace_cleared": False}
    # The reply came after the reset: metrics are zero now, not "soon".
    metrics = (await client.post("/debug/dump_engine_metrics", json={"model": TRACED})).json()["metrics"]
    assert metrics["completion_tokens_sum"] == 0 and metrics["engine_decode_time_sum"] == 0
    # The trace survives a plain reset (as in MLC) ...
    assert "before-reset" in registry.get(TRACED).engine.tracer.request_ids()
    # ... and goes with clear_trace.
    response = await client.post("/debug/reset_engine", json={"model": TRACED, "clear_trace": True})
    assert response.json()["trace_cleared"] is True
    assert registry.get(TRACED).engine.tracer.request_ids() == []


async def test_reset_aborts_a_live_stream(client: httpx.AsyncClient) -> None:
    body = {"model": TRACED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500,
            "stream": True, "user": "reset-victim", "debug_config": {"ignore_eos": True}}
    stream = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    engine = registry.get(TRACED)
    while "reset-victim" not in engine.engine.tracer.request_ids():
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    await client.post("/debug/reset_engine", json={"model": TRACED})
    events = sse_payloads((await asyncio.wait_for(stream, 30)).text)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize("raw", [b"{oops", b"[]", b'{"clear_trace": 1}'])
async def test_reset_engine_invalid_request(client: httpx.AsyncClient, raw: bytes) -> None:
    assert_invalid_request(await client.post("/debug/reset_engine", content=raw), raw.decode())


@pytest.mark.parametrize("raw", [b"", b"{}", b'{"clear_trace": true}'])
async def test_reset_engine_without_a_model_resets_the_first_engine(client: httpx.AsyncClient, raw: bytes) -> None:
    """aiperf's --reset-kv-cache posts an empty body: it aborted the run on our 400."""
    await generate(client, "before-reset", max_tokens=3)
    response = await client.post("/debug/reset_engine", content=raw)
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "reset", "model": TRACED, "trace_cleared": b"true" in raw}
    metrics = (await client.post("/debug/dump_engine_metrics", content=b"")).json()["metrics"]
    assert metrics["completion_tokens_sum"] == 0


async def test_reset_engine_unknown_model(client: httpx.AsyncClient) -> None:
    response = await client.post("/debug/reset_engine", json={"model": "nope"})
    assert_error(response, 400, 'The requested model "nope" is not served.')


# ---------------------------------------------------------------------- CUDA profiler


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("route", ["cuda_profiler_start", "cuda_profiler_stop"])
@pytest.mark.parametrize("content", [b"", b'{"model": "demo-untraced"}'])
async def test_cuda_profiler_on_cpu_is_a_clear_400(client: httpx.AsyncClient, route: str, content: bytes) -> None:
    error = assert_error(await client.post(f"/debug/{route}", content=content), 400)
    assert error["message"].startswith("The CUDA profiler is unavailable")
    assert "cpu backend" in error["message"]
    if route == "cuda_profiler_start":  # the built-in profiler started all the same
        assert "built-in profiler started" in error["message"]
        model = json.loads(content)["model"] if content else TRACED
        body = {"model": model, "prompt": "Hi", "max_tokens": 2}
        assert (await client.post("/v1/completions", json=body)).status_code == 200  # a step to keep
        stopped = await client.post("/debug/profile_stop", content=content)
        assert stopped.status_code == 200 and stopped.json()["profile_id"] > 0
    else:
        assert "No built-in profile was running" in error["message"]


async def test_cuda_profiler_unknown_model(client: httpx.AsyncClient) -> None:
    response = await client.post("/debug/cuda_profiler_start", json={"model": "nope"})
    assert_error(response, 400, 'The requested model "nope" is not served.')
