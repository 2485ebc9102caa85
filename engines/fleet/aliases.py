"""One versioned table of what each kind of server calls the quantities the fleet shows.

For every kind of server (:class:`ServerKind`) and every quantity (:data:`QUANTITIES`), the
metric names to try, newest first: a server exports one of them, an older one, or none, and
"none" is shown as *not exported*, never as 0. Names are kept without their prefix, and the
prefix matches with either separator (``vllm:`` or ``vllm_``, ``sglang:`` or ``sglang_``):
SGLang's separator flipped at least twice in 2025-26 and scrapers that matched one spelling read
zeros (``../shared/reference/fleet-anchors.md`` §3.3). Counters are named as exposed, with
``_total``; histograms by their family name (``_bucket``/``_sum``/``_count`` are added).

Where several label sets report one quantity (vLLM's data-parallel ``engine`` label, SGLang's
``is_streaming``), they are summed, except a usage fraction, which takes the largest.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from engines.prometheus_names import DEFAULT_METRICS_PREFIX

__all__ = ["ALIAS_TABLE_VERSION", "ALIASES", "QUANTITIES", "Control", "KindAliases", "ServerKind", "Source"]

#: Bumped whenever a name is added or retired, and shown with a server's coverage.
ALIAS_TABLE_VERSION = "2026-12-02"

#: What the fleet grid shows per engine (keys of a normalised reading).
QUANTITIES: tuple[str, ...] = (
    "running", "waiting", "kv_usage", "prefix_hit_rate", "prompt_tokens", "generation_tokens",
    "finished", "aborted", "preemptions", "ttft", "itl", "e2e", "queue_time",
)


class ServerKind(StrEnum):
    """What a server is, as detected (``foreign.detect_kind``)."""

    OURS = "ours"
    VLLM = "vllm"
    SGLANG = "sglang"
    MLC = "mlc"
    LLAMA_CPP = "llama.cpp"
    #: vLLM production-stack's router: it re-exports its backends' gauges under vLLM's names
    #: with a ``server`` label, so its series are never counted as an engine's.
    VLLM_ROUTER = "vllm-router"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Source:
    """One way a server may export a quantity.

    ``name`` is the metric without the kind's prefix. A ``ratio`` divides the rate of ``name``
    by the rate of ``denominator`` (both counters). ``labels`` keeps only samples with those
    label values; ``exclude`` drops samples with them. ``note`` says when the name came or went.
    """

    name: str
    type: Literal["gauge", "counter", "histogram", "ratio"]
    denominator: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    exclude: dict[str, str] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class Control:
    """A control the kind of server offers: our action name, the HTTP call, and when it exists."""

    method: str
    path: str
    note: str = ""


@dataclass(frozen=True)
class KindAliases:
    """A kind's prefixes, its model label, its quantities' sources and its controls (our action
    name -> call); an action it lacks has the reason in ``missing_controls``."""

    prefixes: tuple[str, ...]
    model_label: str | None
    sources: dict[str, tuple[Source, ...]]
    controls: dict[str, Control] = field(default_factory=dict)
    missing_controls: dict[str, str] = field(default_factory=dict)
    #: Why nothing at all may be exported (the flag that turns ``/metrics`` on).
    metrics_flag: str = ""


def _g(name: str, note: str = "", **labels: str) -> Source:
    return Source(name, "gauge", labels=labels, note=note)


def _c(name: str, note: str = "", **labels: str) -> Source:
    return Source(name, "counter", labels=labels, note=note)


def _h(name: str, note: str = "") -> Source:
    return Source(name, "histogram", note=note)


_NO_PROFILER = "no profiler on this server"

ALIASES: dict[ServerKind, KindAliases] = {
    # Ours name every family <prefix><name> (engines.prometheus_names): the reader takes the prefix
    # a body has (``--metrics-prefix``), and a server from before the prefix has none.
    ServerKind.OURS: KindAliases(
        prefixes=(DEFAULT_METRICS_PREFIX, ""), model_label="model",
        sources={
            "running": (_g("num_requests_running"),),
            "waiting": (_g("num_requests_waiting"),),
            "kv_usage": (_g("kv_cache_usage_perc"),),
            "prefix_hit_rate": (_g("prefix_cache_hit_rate"),),
            "prompt_tokens": (_c("prefill_tokens_processed_total"),),
            "generation_tokens": (_c("decode_tokens_processed_total"),),
            "finished": (_c("request_success_total"),),
            "aborted": (_c("request_aborted_total"),),
            "preemptions": (_c("num_preemptions_total"),),
            "ttft": (_h("time_to_first_token_seconds"),),
            "itl": (_h("inter_token_latency_seconds"),),
            "e2e": (_h("e2e_request_latency_seconds"),),
            "queue_time": (_h("request_queue_time_seconds"),),
        },
        controls={
            "reset": Control("POST", "/debug/reset_engine", "with --enable-debug"),
            "save_trace": Control("POST", "/debug/dump_event_trace", "with --enable-debug --enable-tracing"),
            "profile_start": Control("POST", "/debug/profile_start", "with --enable-debug"),
            "profile_stop": Control("POST", "/debug/profile_stop", "with --enable-debug"),
        }),
    ServerKind.VLLM: KindAliases(
        prefixes=("vllm:", "vllm_"), model_label="model_name",
        sources={
            "running": (_g("num_requests_running"),),
            "waiting": (_g("num_requests_waiting"),),
            "kv_usage": (_g("kv_cache_usage_perc", "since 0.9"),
                         _g("gpu_cache_usage_perc", "deprecated in 0.9, hidden after")),
            "prefix_hit_rate": (
                Source("prefix_cache_hits_total", "ratio", denominator="prefix_cache_queries_total", note="V1"),
                Source("gpu_prefix_cache_hits_total", "ratio", denominator="gpu_prefix_cache_queries_total",
                       note="deprecated"),
                _g("gpu_prefix_cache_hit_rate", "V0 only")),
            "prompt_tokens": (_c("prompt_tokens_total"),),
            "generation_tokens": (_c("generation_tokens_total"),),
            "finished": (Source("request_success_total", "counter", exclude={"finished_reason": "abort"}),),
            "aborted": (_c("request_success_total", finished_reason="abort"),),
            "preemptions": (_c("num_preemptions_total"),),
            "ttft": (_h("time_to_first_token_seconds"),),
            "itl": (_h("inter_token_latency_seconds", "since 0.10"),
                    _h("time_per_output_token_seconds", "before 0.10: the per-token gap under this name")),
            "e2e": (_h("e2e_request_latency_seconds"),),
            "queue_time": (_h("request_queue_time_seconds"),),
        },
        controls={
            "reset": Control("POST", "/reset_prefix_cache",
                             "frees the prefix cache; dev mode (VLLM_SERVER_DEV_MODE=1)"),
            "profile_start": Control("POST", "/start_profile", "with --profiler-config"),
            "profile_stop": Control("POST", "/stop_profile", "with --profiler-config; the trace stays on that server"),
        },
        missing_controls={"save_trace": "vLLM records no event trace", "clear_trace": "vLLM records no event trace"}),
    ServerKind.SGLANG: KindAliases(
        prefixes=("sglang:", "sglang_"), model_label="model_name", metrics_flag="--enable-metrics",
        sources={
            "running": (_g("num_running_reqs"),),
            "waiting": (_g("num_queue_reqs"),),
            "kv_usage": (_g("token_usage", "the largest of its pools"),),
            "prefix_hit_rate": (Source("cached_tokens_total", "ratio", denominator="prompt_tokens_total"),
                                _g("cache_hit_rate")),
            "prompt_tokens": (_c("prompt_tokens_total"),),
            "generation_tokens": (_c("generation_tokens_total"),),
            "finished": (_c("num_requests_total"),),
            "aborted": (_c("num_aborted_requests_total"),),
            "preemptions": (_c("num_retracted_requests_total"),),
            "ttft": (_h("time_to_first_token_seconds", "buckets from 0.1 s"),),
            "itl": (_h("inter_token_latency_seconds"),
                    _h("time_per_output_token_seconds", "the older name of the same histogram")),
            "e2e": (_h("e2e_request_latency_seconds"),),
            "queue_time": (_h("queue_time_seconds"),),
        },
        controls={
            "reset": Control("POST", "/flush_cache", "frees the radix cache; refused (400) unless idle"),
            "profile_start": Control("POST", "/start_profile"),
            "profile_stop": Control("POST", "/stop_profile", "the trace stays on that server"),
        },
        missing_controls={"save_trace": "SGLang records no event trace here (OpenTelemetry only)",
                          "clear_trace": "SGLang records no event trace here"}),
    ServerKind.LLAMA_CPP: KindAliases(
        prefixes=("llamacpp:", "llamacpp_"), model_label=None, metrics_flag="--metrics",
        sources={
            "running": (_g("requests_processing"),),
            "waiting": (_g("requests_deferred"),),
            "kv_usage": (_g("kv_cache_usage_ratio", "removed in later builds"),),
            "prompt_tokens": (_c("prompt_tokens_total"),),
            "generation_tokens": (_c("tokens_predicted_total"),),
        },
        missing_controls={"reset": "llama.cpp has no cache reset over HTTP", "profile_start": _NO_PROFILER,
                          "profile_stop": _NO_PROFILER, "save_trace": "llama.cpp records no event trace",
                          "clear_trace": "llama.cpp records no event trace"}),
    ServerKind.MLC: KindAliases(
        prefixes=("",), model_label=None,
        sources={
            "prompt_tokens": (_c("prompt_tokens_sum", "cumulative, counted as requests finish"),),
            "generation_tokens": (_c("completion_tokens_sum", "cumulative, counted as requests finish"),),
        },
        controls={
            "reset": Control("POST", "/debug/reset_engine", "with --enable-debug; fire and forget"),
            "save_trace": Control("POST", "/debug/dump_event_trace", "with --enable-debug --enable-tracing"),
            "profile_start": Control("POST", "/debug/cuda_profiler_start", "cudaProfilerStart, for Nsight Systems"),
            "profile_stop": Control("POST", "/debug/cuda_profiler_stop"),
        },
        missing_controls={"clear_trace": "MLC clears its trace only by dumping it"}),
    ServerKind.VLLM_ROUTER: KindAliases(prefixes=("vllm:", "vllm_"), model_label=None, sources={}),
    ServerKind.UNKNOWN: KindAliases(prefixes=("",), model_label=None, sources={}),
}
