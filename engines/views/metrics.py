"""``GET /metrics`` (Prometheus exposition of every engine) and ``GET /health``.

MLC's ``/metrics`` is tab-separated text without TYPE/HELP lines, for the first
engine only. Ours is real Prometheus exposition built by ``prometheus_client``
from a custom collector that reads the registry at scrape time: every engine,
each sample labelled ``model="<served name>"``. It carries

- MLC's engine metric names as gauges (``engine_prefill_time_sum``, ...,
  ``prefill_tokens_per_s``, ``decode_tokens_per_s``), ``last_finished_request_*``
  and ``decode_time_by_batch_size_{mean,count}{batch_size=...}`` as MLC's own
  ``prometheus_text()`` names them;
- the serving series dashboards expect (vLLM's names, without its prefix):
  ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``,
  ``prompt_tokens_total``, ``generation_tokens_total``, ..., and the latency
  histograms the engine keeps (``time_to_first_token_seconds``,
  ``e2e_request_latency_seconds``, ...) with vLLM's bucket boundaries.

MLC's sums are gauges, not counters, because ``/debug/reset_engine`` zeroes them
(and a counter's ``_total`` suffix would rename them); they move at request finish, as
MLC's do. ``prompt_tokens_total`` and ``generation_tokens_total`` count as things happen,
as vLLM's do (a prompt once it is in the KV cache, each output token as it comes, aborted
requests included); ``*_tokens_processed_total`` count what each step computed.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest, HttpResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from engines.loop_lag import loop_lag
from engines.registry import registry
from engines.runtime import AsyncEngine, EngineDeadError, HistogramSnapshot
from engines.views.api import api_view, json_response
from engines.cancellation import within

logger = logging.getLogger(__name__)

# MLC's engine-wide scalars (reference §5), exposed under their own names.
MLC_GAUGES: dict[str, str] = {
    "engine_prefill_time_sum": "Seconds spent in prefill steps (MLC).",
    "engine_decode_time_sum": "Seconds spent in decode steps (MLC).",
    "engine_jump_forward_time_sum": "Seconds spent appending grammar-forced tokens (MLC).",
    "prompt_tokens_sum": "Prompt tokens of finished requests (MLC).",
    "completion_tokens_sum": "Completion tokens of finished requests (MLC).",
    "prefill_tokens_sum": "Tokens actually prefilled by finished requests, prefix-cache hits excluded (MLC).",
    "decode_tokens_sum": "Tokens processed in decode steps by finished requests (MLC).",
    "jump_forward_tokens_sum": "Grammar-forced tokens of finished requests (MLC).",
    "prefill_tokens_per_s": "prefill_tokens_sum / engine_prefill_time_sum (MLC; absent until defined).",
    "decode_tokens_per_s": "decode_tokens_sum / engine_decode_time_sum (MLC; absent until defined).",
}

# Standard serving gauges: exposed name -> (engine metrics key, help).
SERVING_GAUGES: dict[str, tuple[str, str]] = {
    "num_requests_running": ("num_running_requests", "Requests running in the engine's batch."),
    "num_requests_waiting": ("num_waiting_requests", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("kv_cache_usage", "Fraction of KV-cache pages in use (0-1)."),
    "kv_cache_pages_used": ("kv_pages_used", "KV-cache pages in use."),
    "kv_cache_pages_total": ("kv_pages_total", "KV-cache pages in the pool."),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache."),
}

# Counters: exposed name (prometheus_client appends _total) -> (engine metrics key, help).
SERVING_COUNTERS: dict[str, tuple[str, str]] = {
    "prompt_tokens": ("num_prompt_tokens", "Prompt tokens, counted when a request's prompt is in the KV cache "
                                           "(cached tokens included; aborted requests too)."),
    "generation_tokens": ("num_generation_tokens", "Output tokens, counted as each is generated (aborted and "
                                                   "failed requests too)."),
    "request_success": ("num_finished_requests", "Requests that finished (not aborted)."),
    "request_aborted": ("num_aborted_requests", "Requests ended by an abort (a client gone, a reset, a failure)."),
    "request_failed": ("num_failed_requests", "Aborted requests that failed on their own (grammar, tokenizer)."),
    "num_preemptions": ("num_preemptions", "Sequences preempted for lack of KV pages."),
    "prefill_tokens_processed": ("prefill_tokens_processed", "Prompt tokens prefilled, counted every step."),
    "decode_tokens_processed": ("decode_tokens_processed", "Tokens decoded, counted every step."),
    "jump_forward_tokens_processed": ("jump_forward_tokens_processed", "Grammar-forced tokens, counted as appended."),
    "engine_prefill_steps": ("num_prefill_steps", "Engine steps that prefilled."),
    "engine_decode_steps": ("num_decode_steps", "Decode-only engine steps."),
}

HISTOGRAM_HELP: dict[str, str] = {
    "time_to_first_token_seconds": "Time from arrival to the first generated token.",
    "request_time_per_output_token_seconds": "Per request, the mean gap between output tokens.",
    "e2e_request_latency_seconds": "Time from arrival to finish.",
    "request_queue_time_seconds": "Time from arrival to first scheduling.",
    "inter_token_latency_seconds": "Gap between consecutive output tokens of a request.",
}


@dataclass(frozen=True)
class EngineReading:
    """One engine's metrics, read once per scrape so every family agrees."""

    engine: AsyncEngine
    metrics: dict[str, Any]
    histograms: dict[str, HistogramSnapshot]

    @classmethod
    async def read(cls, engine: AsyncEngine) -> "EngineReading":
        """Ask the engine for its metrics and histograms (taken together, between two steps)."""
        metrics, histograms = await engine.metrics_with_histograms()
        return cls(engine, metrics, histograms)


# An engine that does not answer a metrics read in this long (a wedged process) is left out of
# the scrape rather than hanging it; Prometheus' own scrape timeout defaults to 10 s.
READ_TIMEOUT_S = 5.0


async def read_engines(engines: Iterable[AsyncEngine]) -> list[EngineReading]:
    """One reading per running engine, asked concurrently; a dead engine, or one that does not
    answer within ``READ_TIMEOUT_S``, has none (and a warning is logged)."""
    running = [engine for engine in engines if engine.is_alive]
    results = await asyncio.gather(
        *(within(EngineReading.read(engine), READ_TIMEOUT_S) for engine in running), return_exceptions=True)
    readings = []
    for engine, result in zip(running, results, strict=True):
        if isinstance(result, asyncio.TimeoutError):
            logger.warning("engine %s did not answer a metrics read in %.0f s", engine.name, READ_TIMEOUT_S)
            continue
        if isinstance(result, EngineDeadError):
            continue
        if isinstance(result, BaseException):
            raise result
        readings.append(result)
    return readings


class EngineCollector(Collector):
    """Prometheus families over the engine readings of one scrape, and every served engine's
    life (up or not, restarts), dead ones included."""

    def __init__(self, readings: list[EngineReading], engines: Iterable[AsyncEngine] = ()) -> None:
        self.readings = readings
        self.engines = list(engines)

    def collect(self) -> Iterator[Metric]:
        readings = self.readings
        yield from self._life(self.engines)
        yield self._info(readings)
        for name, help_text in MLC_GAUGES.items():
            yield self._family(GaugeMetricFamily(name, help_text, labels=["model"]), readings, name)
        yield from self._last_finished_request(readings)
        yield from self._decode_time_by_batch_size(readings)
        for name, (key, help_text) in SERVING_GAUGES.items():
            yield self._family(GaugeMetricFamily(name, help_text, labels=["model"]), readings, key)
        for name, (key, help_text) in SERVING_COUNTERS.items():
            yield self._family(CounterMetricFamily(name, help_text, labels=["model"]), readings, key)
        yield from self._histograms(readings)

    @staticmethod
    def _family(family: GaugeMetricFamily | CounterMetricFamily, readings: list[EngineReading], key: str) -> Metric:
        # A value MLC leaves out (a rate before anything ran) is left out here too, not faked as 0.
        for reading in readings:
            value = reading.metrics.get(key)
            if isinstance(value, (int, float)):
                family.add_metric([reading.engine.name], float(value))
        return family

    @staticmethod
    def _life(engines: list[AsyncEngine]) -> Iterator[Metric]:
        up = GaugeMetricFamily("engine_up", "1 while the engine runs; 0 while it restarts or is dead.",
                               labels=["model", "state"])
        restarts = CounterMetricFamily("engine_restarts", "Times the engine was restarted after it died.",
                                       labels=["model"])
        for engine in engines:
            status = engine.status
            up.add_metric([engine.name, status.state.value], 1.0 if engine.is_alive else 0.0)
            restarts.add_metric([engine.name], float(status.restarts))
        yield up
        yield restarts

    @staticmethod
    def _info(readings: list[EngineReading]) -> Metric:
        family = GaugeMetricFamily(
            "engine_info", "Served engines (value 1): backend, dtype and whether tracing is on.",
            labels=["model", "checkpoint", "backend", "dtype", "tracing"],
        )
        for r in readings:
            tracing = "true" if r.engine.tracing_enabled else "false"
            family.add_metric(
                [r.engine.name, r.engine.checkpoint.name, r.engine.backend_name, r.engine.dtype, tracing], 1)
        return family

    @staticmethod
    def _last_finished_request(readings: list[EngineReading]) -> Iterator[Metric]:
        """``last_finished_request_<key>`` gauges, as MLC's ``prometheus_text()`` flattens the dict."""
        keys: dict[str, None] = {}
        for r in readings:
            keys.update(dict.fromkeys(r.metrics.get("last_finished_request", {})))
        for key in keys:
            family = GaugeMetricFamily(f"last_finished_request_{key}", f"{key} of the last finished request (MLC).",
                                       labels=["model"])
            for r in readings:
                value = r.metrics.get("last_finished_request", {}).get(key)
                if isinstance(value, (int, float)):
                    family.add_metric([r.engine.name], float(value))
            yield family

    @staticmethod
    def _decode_time_by_batch_size(readings: list[EngineReading]) -> Iterator[Metric]:
        """MLC's ``mean{batch_size=N}`` / ``count{batch_size=N}`` keys as two labelled gauges."""
        families = {
            "mean": GaugeMetricFamily("decode_time_by_batch_size_mean",
                                      "Mean decode step time at this batch size, first step discarded (MLC).",
                                      labels=["model", "batch_size"]),
            "count": GaugeMetricFamily("decode_time_by_batch_size_count",
                                       "Decode steps timed at this batch size (MLC).",
                                       labels=["model", "batch_size"]),
        }
        for r in readings:
            for key, value in r.metrics.get("decode_time_by_batch_size", {}).items():
                stat, _, rest = key.partition("{batch_size=")
                if stat in families and rest.endswith("}"):
                    families[stat].add_metric([r.engine.name, rest[:-1]], float(value))
        yield from families.values()

    @staticmethod
    def _histograms(readings: list[EngineReading]) -> Iterator[Metric]:
        names: dict[str, None] = {}
        for r in readings:
            names.update(dict.fromkeys(r.histograms))
        for name in names:
            family = HistogramMetricFamily(name, HISTOGRAM_HELP.get(name, name.replace("_", " ")), labels=["model"])
            for r in readings:
                snap = r.histograms.get(name)
                if snap is not None:
                    buckets = [(floatToGoString(le), float(count)) for le, count in snap.cumulative()]
                    family.add_metric([r.engine.name], buckets, sum_value=snap.sum)
            yield family


def exposition_registry(readings: list[EngineReading], engines: Iterable[AsyncEngine] = ()) -> CollectorRegistry:
    """A ``prometheus_client`` registry that exposes these readings (one per scrape: the engines
    are asked asynchronously first, since they may run in other processes) and the life of
    ``engines``."""
    exposition = CollectorRegistry(auto_describe=False)
    exposition.register(EngineCollector(readings, engines))
    exposition.register(ServerCollector())
    return exposition


class ServerCollector(Collector):
    """The serving process's own figures: its event loop's lag (:mod:`engines.loop_lag`), once probed."""

    def collect(self) -> Iterator[Metric]:
        snap = loop_lag.histogram()
        if snap.count:
            family = HistogramMetricFamily("event_loop_lag_seconds",
                                           "How late the server's event loop ran a 100 ms timer.")
            family.add_metric([], [(floatToGoString(le), float(n)) for le, n in snap.cumulative()], sum_value=snap.sum)
            yield family


@api_view("GET")
async def prometheus_metrics(request: HttpRequest) -> HttpResponse:
    """Every engine's metrics in the exposition format the scraper asks for (0.0.4 text by default)."""
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    engines = list(registry)
    return HttpResponse(encode(exposition_registry(await read_engines(engines), engines)), content_type=content_type)


@api_view("GET")
async def health(request: HttpRequest) -> HttpResponse:
    """200 ``{"status": "ok"}`` while every engine runs; 503 naming the others (vLLM's contract),
    or ``{"status": "draining"}`` while a shutdown lets the requests in flight finish (new ones
    are refused then: a load balancer should stop sending them here).

    ``engines`` gives each engine's state (``running``, ``restarting``, ``dead``), the reason
    it is not running, and its restart count.
    """
    statuses = {engine.name: engine.status.as_dict() for engine in registry}
    if registry.draining:
        return json_response({"status": "draining", "engines": statuses}, status=503)
    dead = [engine.name for engine in registry if not engine.is_alive]
    if dead:
        return json_response({"status": "unhealthy", "dead_engines": dead, "engines": statuses}, status=503)
    return json_response({"status": "ok", "engines": statuses})


@api_view("GET")
async def stats(request: HttpRequest) -> HttpResponse:
    """A JSON summary per engine: prefill and decode tokens/s, load and KV use.

    What MLC users ask for when serving (mlc-llm #3052: the sample client's ``/stats`` is a 404
    there): the numbers a person checks first, without a Prometheus server.
    """
    engines: dict[str, dict[str, Any]] = {}
    readings = {reading.engine.name: reading for reading in await read_engines(registry)}
    for engine in registry:
        reading = readings.get(engine.name)
        life = engine.status.as_dict()
        fixed = {"backend": engine.backend_name, "weights": engine.source_format,
                 "weights_in_memory": engine.weights_format,
                 "kv_cache": engine.kv_cache.as_dict() if engine.kv_cache else None}
        if reading is None:  # dead or restarting: nothing to read
            engines[engine.name] = {**fixed, "alive": False, **life}
            continue
        m = reading.metrics
        engines[engine.name] = {
            **fixed,
            "alive": engine.is_alive,
            **life,
            "prefill_tokens_per_s": m.get("prefill_tokens_per_s", 0.0),
            "decode_tokens_per_s": m.get("decode_tokens_per_s", 0.0),
            "num_running_requests": m["num_running_requests"],
            "num_waiting_requests": m["num_waiting_requests"],
            "kv_cache_usage": m["kv_cache_usage"],
            "prefix_cache_hit_rate": m["prefix_cache_hit_rate"],
            "num_finished_requests": m["num_finished_requests"],
            "ttft_p50_s": m["ttft_s"]["p50"],
            "ttft_p99_s": m["ttft_s"]["p99"],
        }
    return json_response({"engines": engines, "event_loop_lag": loop_lag.summary()})
