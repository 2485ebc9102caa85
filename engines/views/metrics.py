"""``GET /metrics`` (Prometheus exposition of every engine) and ``GET /health``.

MLC's ``/metrics`` is tab-separated text without TYPE/HELP lines, for the first
engine only. Ours is real Prometheus exposition built by ``prometheus_client``
from a custom collector that reads the registry at scrape time: every engine,
each sample labelled ``model="<served name>"``, every name ``<prefix><name>``
(:mod:`engines.prometheus_names`: ``llm_engine_`` unless ``--metrics-prefix`` says
otherwise), and clean under ``promtool check metrics``. It carries

- MLC's engine-wide sums as counters named for what they count
  (``prefill_time_seconds_total``, ``finished_prompt_tokens_total``, ...), MLC's
  ``last_finished_request`` as ``last_finished_request_*`` gauges (units spelled out:
  ``_seconds``, ``_per_second``) and its ``decode_time_by_batch_size`` as a summary,
  ``decode_step_time_seconds{batch_size=...}``. ``/debug/dump_engine_metrics`` keeps
  MLC's own names;
- the serving series dashboards expect, under vLLM's names after the prefix:
  ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``,
  ``prompt_tokens_total``, ``generation_tokens_total``, ..., and the latency
  histograms the engine keeps (``time_to_first_token_seconds``,
  ``e2e_request_latency_seconds``, ...) with vLLM's bucket boundaries; with
  ``--metrics-vllm-aliases``, those of vLLM's definition again under vLLM's own
  names (``vllm:num_requests_running{model_name=...}``).

``/debug/reset_engine`` zeroes every counter: Prometheus reads that as a counter reset,
as it reads a restart. MLC's token sums move at request finish, as MLC's do;
``prompt_tokens_total`` and ``generation_tokens_total`` count as things happen, as vLLM's
do (a prompt once it is in the KV cache, each output token as it comes, aborted requests
included); ``*_tokens_processed_total`` count what each step computed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
                                    SummaryMetricFamily)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

import engines as engines_package
from engines.server.loop_lag import loop_lag
from engines.prometheus_names import DEFAULT_METRICS_PREFIX, VLLM_ALIASES, VLLM_MODEL_LABEL
from engines.registry import registry
from engines.server.server_identity import source_commit
from engines.watchdog.stall_watch import stall_watch
from engines.runtime import AsyncEngine, EngineDeadError, HistogramSnapshot
from engines.views.api import api_view, json_response
from engines.server.cancellation import within

logger = logging.getLogger(__name__)

# MLC's engine-wide sums (reference §5) as counters: exposed name (the prefix before it,
# _total after it) -> (MLC's key, help). MLC's two ratios of them (prefill_tokens_per_s,
# decode_tokens_per_s) are not exported: PromQL divides the counters.
MLC_COUNTERS: dict[str, tuple[str, str]] = {
    "prefill_time_seconds": ("engine_prefill_time_sum", "Seconds spent in steps with any prefill (MLC)."),
    "decode_time_seconds": ("engine_decode_time_sum", "Seconds spent in decode-only steps (MLC)."),
    "jump_forward_time_seconds": ("engine_jump_forward_time_sum",
                                  "Seconds spent appending grammar-forced tokens (MLC)."),
    "finished_prompt_tokens": ("prompt_tokens_sum", "Prompt tokens of finished requests, counted as each "
                                                    "finishes (MLC's prompt_tokens_sum)."),
    "finished_completion_tokens": ("completion_tokens_sum", "Completion tokens of finished requests, counted "
                                                            "as each finishes (MLC's completion_tokens_sum)."),
    "finished_prefill_tokens": ("prefill_tokens_sum", "Tokens actually prefilled by finished requests, "
                                                      "prefix-cache hits excluded (MLC's prefill_tokens_sum)."),
    "finished_decode_tokens": ("decode_tokens_sum", "Tokens processed in decode steps by finished requests "
                                                    "(MLC's decode_tokens_sum)."),
    "finished_jump_forward_tokens": ("jump_forward_tokens_sum", "Grammar-forced tokens of finished requests "
                                                                "(MLC's jump_forward_tokens_sum)."),
}

# Standard serving gauges: exposed name -> (engine metrics key, help).
SERVING_GAUGES: dict[str, tuple[str, str]] = {
    "num_requests_running": ("num_running_requests", "Requests running in the engine's batch."),
    "num_requests_waiting": ("num_waiting_requests", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("kv_cache_usage", "Fraction of KV-cache pages in use (0-1)."),
    "kv_cache_pages_used": ("kv_pages_used", "KV-cache pages in use."),
    "kv_cache_pages_capacity": ("kv_pages_total", "KV-cache pages in the pool."),
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
    "kv_cache_evictions": ("num_kv_evictions", "Prefix-cache pages evicted to make room for new K/V."),
    "prefill_tokens_processed": ("prefill_tokens_processed", "Prompt tokens prefilled, counted every step."),
    "decode_tokens_processed": ("decode_tokens_processed", "Tokens decoded, counted every step."),
    "jump_forward_tokens_processed": ("jump_forward_tokens_processed", "Grammar-forced tokens, counted as appended."),
    "prefill_steps": ("num_prefill_steps", "Engine steps that prefilled."),
    "decode_steps": ("num_decode_steps", "Decode-only engine steps."),
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
        """Ask the engine for its metrics and histograms, in one call it answers at once, mid-step
        if a step is running (``MetricsCall`` is immediate): a scrape never waits for a step."""
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
    life (up or not, restarts), dead ones included: each named ``prefix`` + its name, and with
    ``vllm_aliases`` those of vLLM's definition again under vLLM's names."""

    def __init__(self, readings: list[EngineReading], engines: Iterable[AsyncEngine] = (),
                 prefix: str = DEFAULT_METRICS_PREFIX, vllm_aliases: bool = False) -> None:
        self.readings = readings
        self.engines = list(engines)
        self.prefix = prefix
        self.vllm_aliases = vllm_aliases

    def collect(self) -> Iterator[Metric]:
        for family in self._families():
            yield family
            if self.vllm_aliases:
                for alias in VLLM_ALIASES.get(family.name.removeprefix(self.prefix), ()):
                    yield vllm_alias(family, alias)

    def _families(self) -> Iterator[Metric]:
        readings, p = self.readings, self.prefix
        yield from self._life(self.engines)
        yield self._info(readings)
        for name, (key, help_text) in MLC_COUNTERS.items():
            yield self._family(CounterMetricFamily(p + name, help_text, labels=["model"]), readings, key)
        yield from self._last_finished_request(readings)
        yield self._decode_time_by_batch_size(readings)
        for name, (key, help_text) in SERVING_GAUGES.items():
            yield self._family(GaugeMetricFamily(p + name, help_text, labels=["model"]), readings, key)
        for name, (key, help_text) in SERVING_COUNTERS.items():
            yield self._family(CounterMetricFamily(p + name, help_text, labels=["model"]), readings, key)
        yield from self._histograms(readings)

    @staticmethod
    def _family(family: GaugeMetricFamily | CounterMetricFamily, readings: list[EngineReading], key: str) -> Metric:
        # A value the engine leaves out is left out here too, not faked as 0.
        for reading in readings:
            value = reading.metrics.get(key)
            if isinstance(value, (int, float)):
                family.add_metric([reading.engine.name], float(value))
        return family

    def _life(self, engines: list[AsyncEngine]) -> Iterator[Metric]:
        up = GaugeMetricFamily(self.prefix + "up", "1 while the engine runs; 0 while it restarts or is dead.",
                               labels=["model", "state"])
        restarts = CounterMetricFamily(self.prefix + "restarts", "Times the engine was restarted after it died.",
                                       labels=["model"])
        # The watchdog's (engines.watchdog.stall_watch): incidents opened, and whether one is open now.
        stalls = CounterMetricFamily(self.prefix + "stalls", "Times the engine was seen up but not progressing "
                                     "(the watchdog's incidents).", labels=["model"])
        stalled = GaugeMetricFamily(self.prefix + "stalled", "1 while a stall incident of the engine is open.",
                                    labels=["model"])
        for engine in engines:
            status = engine.status
            up.add_metric([engine.name, status.state.value], 1.0 if engine.is_alive else 0.0)
            restarts.add_metric([engine.name], float(status.restarts))
            stalls.add_metric([engine.name], float(stall_watch.stalls_total(engine.name)))
            stalled.add_metric([engine.name], 1.0 if stall_watch.open_incident(engine.name) else 0.0)
        yield up
        yield restarts
        yield stalls
        yield stalled

    def _info(self, readings: list[EngineReading]) -> Metric:
        family = GaugeMetricFamily(
            self.prefix + "info", "Served engines (value 1): backend, dtype and whether tracing is on.",
            labels=["model", "checkpoint", "backend", "dtype", "tracing"],
        )
        for r in readings:
            tracing = "true" if r.engine.tracing_enabled else "false"
            family.add_metric(
                [r.engine.name, r.engine.checkpoint.name, r.engine.backend_name, r.engine.dtype, tracing], 1)
        return family

    def _last_finished_request(self, readings: list[EngineReading]) -> Iterator[Metric]:
        """``last_finished_request_<key>`` gauges, as MLC's ``prometheus_text()`` flattens the dict,
        its abbreviated units spelled out."""
        keys: dict[str, None] = {}
        for r in readings:
            keys.update(dict.fromkeys(r.metrics.get("last_finished_request", {})))
        for key in keys:
            family = GaugeMetricFamily(f"{self.prefix}last_finished_request_{spelled_units(key)}",
                                       f"{key} of the last finished request (MLC).", labels=["model"])
            for r in readings:
                value = r.metrics.get("last_finished_request", {}).get(key)
                if isinstance(value, (int, float)):
                    family.add_metric([r.engine.name], float(value))
            yield family

    def _decode_time_by_batch_size(self, readings: list[EngineReading]) -> Metric:
        """MLC's ``mean{batch_size=N}`` / ``count{batch_size=N}`` keys as one summary (a sum and a
        count per batch size): a ``rate()`` of each gives the mean step time of a recent window."""
        family = SummaryMetricFamily(
            self.prefix + "decode_step_time_seconds",
            "Decode-only step time by batch size, each size's first step discarded (MLC's decode_time_by_batch_size).",
            labels=["model", "batch_size"])
        for r in readings:
            stats: dict[str, dict[str, float]] = {}
            for key, value in r.metrics.get("decode_time_by_batch_size", {}).items():
                stat, _, rest = key.partition("{batch_size=")
                if stat in ("mean", "count") and rest.endswith("}"):
                    stats.setdefault(rest[:-1], {})[stat] = float(value)
            for size, stat in stats.items():
                if "count" in stat and "mean" in stat:  # MLC gives the mean as sum / count: its product is the sum
                    family.add_metric([r.engine.name, size], count_value=int(stat["count"]),
                                      sum_value=stat["mean"] * stat["count"])
        return family

    def _histograms(self, readings: list[EngineReading]) -> Iterator[Metric]:
        names: dict[str, None] = {}
        for r in readings:
            names.update(dict.fromkeys(r.histograms))
        for name in names:
            family = HistogramMetricFamily(self.prefix + name, HISTOGRAM_HELP.get(name, name.replace("_", " ")),
                                           labels=["model"])
            for r in readings:
                snap = r.histograms.get(name)
                if snap is not None:
                    buckets = [(floatToGoString(le), float(count)) for le, count in snap.cumulative()]
                    family.add_metric([r.engine.name], buckets, sum_value=snap.sum)
            yield family


def spelled_units(key: str) -> str:
    """An MLC key with its abbreviated unit spelled out, as Prometheus names units:
    ``ttft_s`` -> ``ttft_seconds``, ``decode_tokens_per_s`` -> ``decode_tokens_per_second``."""
    if key.endswith("_per_s"):
        return key.removesuffix("_s") + "_second"
    if key.endswith("_s"):
        return key.removesuffix("_s") + "_seconds"
    return key


def vllm_alias(family: Metric, alias: str) -> Metric:
    """``family`` again as vLLM names it: ``alias`` for its name, ``model_name`` for its model label."""
    ours = family.name + ("_total" if family.type == "counter" else "")
    out = Metric(alias, f"{family.documentation} (vLLM's name for {ours}.)", family.type)
    for sample in family.samples:
        labels = {VLLM_MODEL_LABEL if k == "model" else k: v for k, v in sample.labels.items()}
        out.samples.append(sample._replace(name=alias + sample.name.removeprefix(family.name), labels=labels))
    return out


def exposition_registry(readings: list[EngineReading], engines: Iterable[AsyncEngine] = (),
                        prefix: str = DEFAULT_METRICS_PREFIX, vllm_aliases: bool = False) -> CollectorRegistry:
    """A ``prometheus_client`` registry that exposes these readings (one per scrape: the engines
    are asked asynchronously first, since they may run in other processes) and the life of
    ``engines``, named with ``prefix`` (and vLLM's names too with ``vllm_aliases``)."""
    exposition = CollectorRegistry(auto_describe=False)
    exposition.register(EngineCollector(readings, engines, prefix, vllm_aliases))
    exposition.register(ServerCollector(prefix))
    return exposition


class ServerCollector(Collector):
    """The serving process's own figures: its event loop's lag (:mod:`engines.server.loop_lag`), once probed."""

    def __init__(self, prefix: str = DEFAULT_METRICS_PREFIX) -> None:
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        snap = loop_lag.histogram()
        if snap.count:
            family = HistogramMetricFamily(self.prefix + "event_loop_lag_seconds",
                                           "How late the server's event loop ran a 100 ms timer.")
            family.add_metric([], [(floatToGoString(le), float(n)) for le, n in snap.cumulative()], sum_value=snap.sum)
            yield family


@api_view("GET")
async def prometheus_metrics(request: HttpRequest) -> HttpResponse:
    """Every engine's metrics in the exposition format the scraper asks for (0.0.4 text by default),
    named as ``serve --metrics-prefix`` and ``--metrics-vllm-aliases`` say."""
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    engines = list(registry)
    options = registry.options
    exposition = exposition_registry(await read_engines(engines), engines, options.metrics_prefix,
                                     options.metrics_vllm_aliases)
    return HttpResponse(encode(exposition), content_type=content_type)


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
    # Up but not progressing (the watchdog, engines.watchdog.stall_watch): 503 so a load balancer moves
    # traffic, unless serve --stall-health-ok keeps 200; the reason either way.
    stalled = {engine.name: {"reason": i.reason, "detail": i.detail, "since": i.opened_wall}
               for engine in registry if (i := stall_watch.open_incident(engine.name)) is not None}
    if stalled:
        return json_response({"status": "stalled", "stalled": stalled, "engines": statuses},
                             status=200 if stall_watch.health_ok else 503)
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
                 "weights_in_memory": engine.weights_format, "model": engine.checkpoint.name,
                 "config": dataclasses.asdict(engine.config),
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
    # What a replay's run keeps of its target (engines.workloads.run_job): the report's configuration diff.
    server = {"version": engines_package.__version__, "commit": await sync_to_async(source_commit)(),
              "capture_text": registry.options.capture_text}
    return json_response({"engines": engines, "server": server, "event_loop_lag": loop_lag.summary()})
