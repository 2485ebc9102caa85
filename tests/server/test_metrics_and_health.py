"""``GET /metrics`` parses as Prometheus exposition, every name under our prefix: MLC's figures and the serving
series; ``GET /health``."""
from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.prometheus_names import DEFAULT_METRICS_PREFIX as P
from engines.registry import registry
from engines.startup import ModelSpec, build_engines
from engines.runtime.core.engine import EngineConfig
from tests.server.conftest import SMALL_ENGINE, TRACED, UNTRACED, assert_error


async def scrape(http: httpx.AsyncClient) -> dict:
    response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def sample(families: dict, family: str, name: str | None = None, **labels: str) -> float:
    """A sample of ``family`` (our prefix before it, as ``name``: ``generation_tokens_total``)."""
    for s in families[P + family].samples:
        if s.name == P + (name or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {name or family} {labels}")


async def test_metrics_cover_every_engine_with_a_model_label(client: httpx.AsyncClient) -> None:
    body = {"model": TRACED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "debug_config": {"ignore_eos": True}}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    families = await scrape(client)
    assert all(name.startswith(P) for name in families)
    for model in (TRACED, UNTRACED):
        assert sample(families, "decode_time_seconds", "decode_time_seconds_total", model=model) >= 0
        assert sample(families, "info", model=model, backend="cpu") == 1
    assert sample(families, "info", model=TRACED, tracing="true") == 1
    assert sample(families, "info", model=UNTRACED, tracing="false") == 1
    # MLC's sums, as counters.
    assert families[P + "prefill_time_seconds"].type == "counter"
    assert sample(families, "prefill_time_seconds", "prefill_time_seconds_total", model=TRACED) > 0
    assert sample(families, "finished_completion_tokens", "finished_completion_tokens_total", model=TRACED) == 6
    assert sample(families, "last_finished_request_completion_tokens", model=TRACED) == 6
    assert sample(families, "last_finished_request_ttft_seconds", model=TRACED) > 0
    assert sample(families, "last_finished_request_decode_tokens_per_second", model=TRACED) > 0
    assert families[P + "prompt_tokens"].type == "counter"
    assert sample(families, "generation_tokens", "generation_tokens_total", model=TRACED) == 6
    assert sample(families, "request_success", "request_success_total", model=TRACED) == 1
    assert sample(families, "num_requests_running", model=TRACED) == 0
    assert sample(families, "num_requests_waiting", model=TRACED) == 0
    assert 0 <= sample(families, "kv_cache_usage_perc", model=TRACED) <= 1
    capacity = (await registry.get(TRACED).metrics())["kv_pages_total"]
    assert capacity > 0 and sample(families, "kv_cache_pages_capacity", model=TRACED) == capacity
    # Histograms with vLLM's buckets: cumulative, ending at +Inf == count.
    assert families[P + "inter_token_latency_seconds"].type == "histogram"
    # Six tokens, five gaps between them.
    assert sample(families, "inter_token_latency_seconds", "inter_token_latency_seconds_count", model=TRACED) == 5
    ttft = families[P + "time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    buckets = [s for s in ttft.samples if s.name.endswith("_bucket") and s.labels["model"] == TRACED]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 1
    assert [b.value for b in buckets] == sorted(b.value for b in buckets)
    assert sample(families, "time_to_first_token_seconds", "time_to_first_token_seconds_count", model=TRACED) == 1
    assert sample(families, "e2e_request_latency_seconds", "e2e_request_latency_seconds_sum", model=TRACED) > 0


async def test_decode_time_by_batch_size_is_a_labelled_summary(client: httpx.AsyncClient) -> None:
    body = {"model": TRACED, "prompt": "hello", "max_tokens": 8, "debug_config": {"ignore_eos": True}}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    families = await scrape(client)
    mlc = (await registry.get(TRACED).metrics())["decode_time_by_batch_size"]
    summary = families[P + "decode_step_time_seconds"]
    assert summary.type == "summary"
    counts = {s.labels["batch_size"]: s.value for s in summary.samples
              if s.labels["model"] == TRACED and s.name.endswith("_count")}
    sums = {s.labels["batch_size"]: s.value for s in summary.samples
            if s.labels["model"] == TRACED and s.name.endswith("_sum")}
    assert counts == {size: mlc[f"count{{batch_size={size}}}"] for size in counts} and counts
    assert sums.keys() == counts.keys()
    for size, total in sums.items():
        assert total / counts[size] == pytest.approx(mlc[f"mean{{batch_size={size}}}"])


async def test_metrics_speaks_openmetrics_when_asked(client: httpx.AsyncClient) -> None:
    response = await client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.rstrip().endswith("# EOF")


async def test_metrics_not_gated_by_debug(serve) -> None:
    async with serve(enable_debug=False) as http:
        assert (await http.get("/metrics")).status_code == 200


async def test_health_ok(client: httpx.AsyncClient) -> None:
    response = await client.get("/health")
    running = {"state": "running", "reason": None, "restarts": 0}
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "engines": {TRACED: running, UNTRACED: running}}


async def test_stats_summarises_each_engine(client: httpx.AsyncClient) -> None:
    body = {"model": TRACED, "prompt": "hello", "max_tokens": 5, "debug_config": {"ignore_eos": True}}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    stats = (await client.get("/stats")).json()["engines"]
    assert set(stats) == {TRACED, UNTRACED}
    traced = stats[TRACED]
    assert traced["alive"] and traced["backend"] == "cpu"
    assert traced["prefill_tokens_per_s"] > 0 and traced["decode_tokens_per_s"] > 0
    assert traced["num_finished_requests"] >= 1 and traced["ttft_p50_s"] > 0
    assert stats[UNTRACED]["decode_tokens_per_s"] >= 0.0 and "kv_cache_usage" in stats[UNTRACED]


async def test_stats_needs_the_api_key(serve) -> None:
    async with serve(api_key="k-stats") as http:
        assert_error(await http.get("/stats"), 401)
        ok = await http.get("/stats", headers={"Authorization": "Bearer k-stats"})
        assert ok.status_code == 200


@pytest.fixture(scope="module")
def stopped_engine():
    """A demo engine that was started and then stopped: what a dead engine looks like from outside."""
    (engine,) = build_engines([ModelSpec("demo", "stopped")], EngineConfig(**SMALL_ENGINE), backend="cpu")
    engine.start()
    engine.shutdown()
    return engine


async def test_health_503_names_a_dead_engine(serve, engines, stopped_engine) -> None:
    async with serve(serving=[engines[TRACED], stopped_engine]) as http:
        response = await http.get("/health")
        assert response.status_code == 503
        assert response.json() == {"status": "unhealthy", "dead_engines": ["stopped"], "engines": {
            TRACED: {"state": "running", "reason": None, "restarts": 0},
            "stopped": {"state": "stopped", "reason": None, "restarts": 0}}}
        # Requests to it fail with 503 rather than hanging.
        body = {"model": "stopped", "prompt": "hi", "max_tokens": 1}
        assert_error(await http.post("/v1/completions", json=body), 503)


async def test_debug_routes_on_a_dead_engine_are_503_not_500(serve, stopped_engine) -> None:
    async with serve(enable_debug=True, serving=[stopped_engine]) as http:
        error = assert_error(await http.post("/debug/reset_engine", json={"model": "stopped"}), 503)
        assert "is not running" in error["message"]
        # Its metrics lived in its engine loop (perhaps another process): gone, and said so.
        error = assert_error(await http.post("/debug/dump_engine_metrics", json={"model": "stopped"}), 503)
        assert "is not running" in error["message"]
        stats = (await http.get("/stats")).json()["engines"]["stopped"]
        kv = stats.pop("kv_cache")  # what it had allocated, still said
        assert kv["tokens"] == stopped_engine.kv_cache.tokens and kv["rule"] == "max_total_tokens"
        assert stats == {"backend": "cpu", "weights": "safetensors", "weights_in_memory": "float32",
                         "model": "demo", "config": dataclasses.asdict(stopped_engine.config),
                         "alive": False, "state": "stopped",
                         "reason": None, "restarts": 0}
        exposition = (await http.get("/metrics")).text
        assert f'{P}up{{model="stopped",state="stopped"}} 0.0' in exposition
        assert f'{P}restarts_total{{model="stopped"}} 0.0' in exposition
        # Its life, and the watchdog's count of its stalls (a dead engine is not stalled: 0).
        assert [line.split("{")[0] for line in exposition.splitlines() if 'model="stopped"' in line] == \
            [f"{P}up", f"{P}restarts_total", f"{P}stalls_total", f"{P}stalled"]


async def test_health_says_draining_during_a_shutdown(serve, engines) -> None:
    """New requests get 503 while a shutdown drains: a load balancer must hear it from /health too."""
    from engines.registry import registry

    async with serve() as http:
        registry.draining = True
        try:
            response = await http.get("/health")
        finally:
            registry.draining = False
    assert response.status_code == 503 and response.json()["status"] == "draining"
    assert set(response.json()["engines"]) == set(engines)


async def test_token_counters_move_while_a_stream_runs_and_count_its_abort(client: httpx.AsyncClient) -> None:
    """prompt_tokens_total and generation_tokens_total count as tokens come, as vLLM's do: a dashboard's
    rate() of them moves during a stream, and a stream the client left still counts. (Streamed
    from the engine: httpx's ASGI transport hands a body over only once it is whole.)"""
    from engines.runtime import GenerationRequest, SamplingParams

    engine = registry.get(TRACED)
    stream = engine.generate(GenerationRequest("counted", list(range(300, 320)),
                                               SamplingParams(max_tokens=1500, ignore_eos=True)))
    received = 0
    async for output in stream:
        received += sum(len(c.token_ids) for c in output.choices)
        if received >= 5:
            break
    families = await scrape(client)
    assert sample(families, "request_success", "request_success_total", model=TRACED) == 0  # mid-stream
    assert sample(families, "prompt_tokens", "prompt_tokens_total", model=TRACED) == 20
    assert sample(families, "generation_tokens", "generation_tokens_total", model=TRACED) >= received
    await stream.aclose()  # the client left: the request is aborted
    for _ in range(500):
        metrics = await engine.metrics()
        if metrics["num_aborted_requests"] == 1:
            break
        await asyncio.sleep(0.02)
    assert metrics["num_aborted_requests"] == 1
    families = await scrape(client)
    produced = sample(families, "generation_tokens", "generation_tokens_total", model=TRACED)
    assert received <= produced < 1500 and produced == metrics["num_generation_tokens"]
    # MLC's sums are of finished requests: the aborted one is not in them.
    assert sample(families, "finished_completion_tokens", "finished_completion_tokens_total", model=TRACED) == 0
    assert sample(families, "finished_prompt_tokens", "finished_prompt_tokens_total", model=TRACED) == 0
