"""Foreign servers' ``/metrics`` read through the alias table: every kind and version maps onto
the same quantities, what a server does not export says so, and hostile answers are errors."""
from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from engines.fleet.server_kinds import KINDS, QUANTITIES, ServerKind
from engines.fleet.exposition import ExpositionError, parse_exposition
from engines.fleet.foreign import ForeignReader, PollError, detect_kind, fetch_metrics, probe_kind, reading_rows
from tests.fleet import foreign_expositions as fx


def read_twice(first: str, second: str, gap_s: float = 10.0):
    reader = ForeignReader()
    reader.read(first, now=100.0)
    return reader.read(second, now=100.0 + gap_s)


@pytest.mark.parametrize("version", ["0.8", "0.11"])
def test_vllm_before_and_after_its_renames_gives_the_same_figures(version):
    body = fx.vllm(version, ttfts=[0.003] * 90 + [0.3] * 10, itls=[0.02] * 50)
    assert detect_kind(parse_exposition(body)) is ServerKind.VLLM
    later = fx.vllm(version, prompt_tokens=3000, generation_tokens=9000, ttfts=[0.003] * 180 + [0.3] * 20,
                    itls=[0.02] * 100)
    reading = read_twice(body, later)
    [(model, figures)] = reading.models.items()
    assert model == "meta-llama/Llama-3.1-8B-Instruct" and reading.kind is ServerKind.VLLM
    assert figures["running"] == 3 and figures["waiting"] == 1 and figures["kv_usage"] == pytest.approx(0.42)
    assert figures["prompt_tokens"] == pytest.approx(200.0) and figures["generation_tokens"] == pytest.approx(400.0)
    assert figures["prefix_hit_rate"] == pytest.approx(0.25)  # rate of hits over rate of queries
    # The last minute's TTFT: the 100 new observations, 90 of them at 3 ms.
    assert figures["ttft"]["count"] == 100 and figures["ttft"]["p50"] < 0.005 and 0.25 < figures["ttft"]["p99"] <= 0.5
    assert figures["itl"]["count"] == 50
    # And the histograms as read, since the server started, with their sums (for the rollups).
    assert figures["ttft"]["total"][-1][1] == 200 and figures["ttft"]["total_sum"] == pytest.approx(180 * 0.003 + 6.0)
    totals = reading_rows("v", reading).rows[0].totals
    assert totals["ttft"].cumulative[-1] == 200 and totals["ttft"].sum == pytest.approx(6.54)
    assert "kv_cache_usage_perc" in reading.sources["kv_usage"] if version == "0.11" else \
        "gpu_cache_usage_perc" in reading.sources["kv_usage"]
    assert reading.not_exported == ("queue_time",)  # the fixture has no queue-time histogram


def test_data_parallel_ranks_are_summed_and_usage_takes_the_fullest():
    reading = read_twice(fx.vllm("0.11", dp_ranks=2), fx.vllm("0.11", dp_ranks=2))
    [figures] = reading.models.values()
    assert figures["running"] == 6 and figures["kv_usage"] == pytest.approx(0.52)


def test_aborts_and_finishes_are_told_apart():
    reading = read_twice(fx.vllm("0.11", finished=10, aborted=0), fx.vllm("0.11", finished=30, aborted=5), gap_s=5)
    [figures] = reading.models.values()
    assert figures["finished"] == pytest.approx(4.0) and figures["aborted"] == pytest.approx(1.0)


@pytest.mark.parametrize("separator", [":", "_"])
@pytest.mark.parametrize("old_itl_name", [False, True])
def test_sglang_with_either_separator_and_either_itl_name(separator, old_itl_name):
    body = fx.sglang(separator, ttfts=[0.05] * 10, old_itl_name=old_itl_name)
    assert detect_kind(parse_exposition(body)) is ServerKind.SGLANG
    later = fx.sglang(separator, prompt_tokens=1800, cached_tokens=700, ttfts=[0.05] * 30, old_itl_name=old_itl_name)
    reading = read_twice(body, later)
    [figures] = reading.models.values()
    assert figures["running"] == 2 and figures["kv_usage"] == pytest.approx(0.3)
    assert figures["prefix_hit_rate"] == pytest.approx(0.5)  # (700-200) cached of (1800-800) prompt tokens
    assert figures["prompt_tokens"] == pytest.approx(100.0)
    # Its TTFT buckets start at 100 ms: every observation sits in the first, and the streaming
    # and non-streaming series are one distribution.
    assert figures["ttft"]["count"] == 20 and figures["ttft"]["p50"] <= 0.1
    assert figures["itl"]["count"] == 0  # no new ITL observation in the window


def test_llama_cpp_says_what_it_does_not_export():
    reading = read_twice(fx.llama_cpp(), fx.llama_cpp(prompt_tokens=34065))
    assert reading.kind is ServerKind.LLAMA_CPP
    [(model, figures)] = reading.models.items()
    assert model == "" and figures["running"] == 1 and figures["prompt_tokens"] == pytest.approx(100.0)
    assert set(reading.not_exported) == {"kv_usage", "prefix_hit_rate", "finished", "aborted", "preemptions", "ttft",
                                         "itl", "e2e", "queue_time"}
    assert "ttft" not in figures  # absent, never a 0


def test_mlc_text_is_read_with_its_own_parser():
    exposition = parse_exposition(fx.mlc())
    assert exposition.format == "mlc" and detect_kind(exposition) is ServerKind.MLC
    assert exposition.samples["decode_time_by_batch_size_mean"][0].labels == {"batch_size": "1"}
    reading = read_twice(fx.mlc(prompt_tokens=100), fx.mlc(prompt_tokens=300), gap_s=4)
    assert reading.models[""]["prompt_tokens"] == pytest.approx(50.0)
    assert "running" in reading.not_exported and "ttft" in reading.not_exported


def test_the_production_stack_router_is_not_counted_as_an_engine():
    reading = read_twice(fx.production_stack_router(), fx.production_stack_router())
    assert reading.kind is ServerKind.VLLM_ROUTER and reading.models == {}
    assert reading.not_exported == QUANTITIES


def test_a_servers_rates_are_over_the_polls_of_the_window_and_hold_still():
    """Polled every second while its tokens come in lumps (a 0.26 s step's worth, 3 or 4 steps a
    poll): a rate between two polls jumps between 12 and 16 tok/s; over the polls of the last
    5 s or more it stays within a step's worth of the true 15.4."""
    from engines.fleet.windows import RATE_WINDOW_S

    reader = ForeignReader()
    rates = []
    for second in range(20):
        tokens = 4 * int(second / 0.26)  # 4 tokens a step, the steps ended by then
        reading = reader.read(fx.vllm("0.11", generation_tokens=1 + tokens), now=100.0 + second)
        rates.append(reading.models["meta-llama/Llama-3.1-8B-Instruct"]["generation_tokens"])
    steady = rates[int(RATE_WINDOW_S) + 1:]
    step_worth = 4 / RATE_WINDOW_S
    assert all(abs(rate - 4 / 0.26) <= step_worth for rate in steady), steady


def test_a_counter_that_goes_back_is_a_restart_not_a_negative_rate():
    reading = read_twice(fx.vllm("0.11", prompt_tokens=5000), fx.vllm("0.11", prompt_tokens=100))
    [figures] = reading.models.values()
    assert figures["prompt_tokens"] is None


@pytest.mark.parametrize("body", ["<html><body>Login</body></html>", '{"detail": "Not Found"}',
                                  "vllm:num_requests_running{model_name=\"m\" 3\n"])
def test_what_is_not_metrics_text_is_an_error_reading(body):
    with pytest.raises(ExpositionError):
        parse_exposition(body)
    reading = ForeignReader().read(body)
    assert reading.error and "not metrics text" in reading.error and reading.models == {}


def test_every_kind_names_a_source_or_a_reason_for_each_control():
    assert set(KINDS) == set(ServerKind)
    for kind in ServerKind:
        record = KINDS[kind]
        assert set(record.sources) <= set(QUANTITIES)
        for action in ("reset", "profile_start", "profile_stop"):
            assert action in record.controls or action in record.missing_controls, (kind, action)


def test_a_stored_kind_this_version_does_not_know_parses_as_unknown():
    assert ServerKind.parse("llama.cpp") is ServerKind.LLAMA_CPP
    assert ServerKind.parse("") is ServerKind.UNKNOWN
    assert ServerKind.parse("trt-llm") is ServerKind.UNKNOWN


# ------------------------------------------------------------------------------ fetching


def client_for(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_a_good_answer_is_read_whole():
    body = fx.vllm("0.11")

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer k"
        return httpx.Response(200, text=body, headers={"content-type": "text/plain; version=0.0.4"})

    async with client_for(handler) as client:
        assert await fetch_metrics(client, "http://vllm:8000/", api_key="k") == body


@pytest.mark.parametrize("response, message", [
    (httpx.Response(302, headers={"location": "http://elsewhere/metrics"}), "redirects to http://elsewhere"),
    (httpx.Response(404), "not enabled"),
    (httpx.Response(401), "API key"),
    (httpx.Response(500), "answers 500"),
    (httpx.Response(200, text="<html></html>", headers={"content-type": "text/html"}), "text/html"),
    (httpx.Response(200, content=b"x" * 5000, headers={"content-type": "text/plain"}), "more than the 4,096"),
])
async def test_hostile_answers_are_errors_that_say_why(response, message):
    async with client_for(lambda request: response) as client:
        with pytest.raises(PollError, match=message):
            await fetch_metrics(client, "http://x:1", max_bytes=4096)


async def test_a_huge_body_without_a_length_is_cut_at_the_limit():
    async def chunks():
        for _ in range(1000):
            yield b"y" * 1024

    async with client_for(lambda request: httpx.Response(200, content=chunks(),
                                                         headers={"content-type": "text/plain"})) as client:
        with pytest.raises(PollError, match="more than the 65,536 bytes"):
            await fetch_metrics(client, "http://x:1", max_bytes=65536)


async def test_a_server_that_stalls_is_given_up_on_in_bounded_time():
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(10)
        return httpx.Response(200)

    async with client_for(handler) as client:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(PollError, match="did not answer in 0.2 s"):
            await fetch_metrics(client, "http://x:1", timeout_s=0.2)
        assert loop.time() - began < 1.0


@pytest.mark.parametrize("routes, kind, version", [
    ({"/version": {"version": "0.11.2"}}, ServerKind.VLLM, "0.11.2"),
    ({"/server_info": {"tp_size": 1, "model_path": "q", "version": "0.5.4"}}, ServerKind.SGLANG, "0.5.4"),
    ({"/props": {"default_generation_settings": {}, "build_info": "b6500"}}, ServerKind.LLAMA_CPP, "b6500"),
    ({"/v1/models": {"data": [{"id": "m", "owned_by": "MLC-LLM"}]}}, ServerKind.MLC, ""),
    ({}, ServerKind.UNKNOWN, ""),
])
async def test_a_server_without_metrics_is_named_by_its_other_routes(routes, kind, version):
    def handler(request: httpx.Request) -> httpx.Response:
        answer = routes.get(request.url.path)
        return httpx.Response(200, json=answer) if answer is not None else httpx.Response(404)

    async with client_for(handler) as client:
        assert await probe_kind(client, "http://x:1") == (kind, version)


def test_nan_gauges_read_as_unknown():
    series = 'vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"}'
    body = fx.vllm("0.11").replace(f"{series} 0.42", f"{series} NaN")
    [figures] = ForeignReader().read(body).models.values()
    assert figures["kv_usage"] is None and not math.isnan(figures["running"])


@pytest.mark.parametrize("prefix, aliases, stored", [
    ("llm_engine_", False, False), ("llm_engine_", True, False), ("acme_", True, False), ("acme_", False, True),
    ("", False, False), ("", False, True)])
def test_ours_are_read_under_any_prefix_and_from_before_the_prefix(prefix, aliases, stored):
    """Another of our servers: under the default prefix or its own (--metrics-prefix), with vLLM's
    names beside ours (--metrics-vllm-aliases: still ours, not vLLM), or from before the prefix;
    detected from the body, or attached earlier (its kind stored)."""
    body = fx.ours(prefix, vllm_aliases=aliases, ttfts=[0.02] * 10)
    assert detect_kind(parse_exposition(body)) is ServerKind.OURS
    later = fx.ours(prefix, vllm_aliases=aliases, prompt_tokens=600, finished=14, ttfts=[0.02] * 30)
    reader = ForeignReader(ServerKind.OURS if stored else None)
    reader.read(body, now=100.0)
    reading = reader.read(later, now=110.0)
    assert reading.kind is ServerKind.OURS and reading.error is None
    [(model, figures)] = reading.models.items()
    assert model == "demo" and figures["running"] == 2
    assert figures["prompt_tokens"] == pytest.approx(50.0) and figures["finished"] == pytest.approx(1.0)
    assert figures["ttft"]["count"] == 20
    assert {"running", "prompt_tokens", "finished", "ttft"} <= set(reading.sources)
