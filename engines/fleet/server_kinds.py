"""What each kind of server is, one record a kind: how to tell it, what it calls the quantities
the fleet shows, and the controls it offers.

:data:`KINDS` holds a :class:`KindRecord` for every :class:`ServerKind`, in detection order:
``foreign.detect_kind`` takes the first whose predicate a ``/metrics`` body meets, and
``foreign.probe_kind``, for a server whose metrics are off, tries each record's probes in the same
order, then the ``owned_by`` of ``/v1/models``.

The alias table is the records' ``sources``, versioned as one (:data:`ALIAS_TABLE_VERSION`): for
every quantity (:data:`QUANTITIES`), the metric names to try, newest first: a server exports one of
them, an older one, or none, and "none" is shown as *not exported*, never as 0. Names are kept
without their prefix, and the prefix matches with either separator (``vllm:`` or ``vllm_``,
``sglang:`` or ``sglang_``): SGLang's separator flipped at least twice in 2025-26 and scrapers that
matched one spelling read zeros (``../shared/reference/fleet-anchors.md`` §3.3). Counters are named
as exposed, with ``_total``; histograms by their family name (``_bucket``/``_sum``/``_count`` are
added).

Where several label sets report one quantity (vLLM's data-parallel ``engine`` label, SGLang's
``is_streaming``), they are summed, except a usage fraction, which takes the largest.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, get_args

from engines.fleet.exposition import Exposition
from engines.prometheus_names import DEFAULT_METRICS_PREFIX, our_prefix

__all__ = ["ALIAS_TABLE_VERSION", "KINDS", "QUANTITIES", "Action", "Control", "KindRecord", "Probe", "ServerKind",
           "Source"]

#: Bumped whenever a name is added or retired, and shown with a server's coverage.
ALIAS_TABLE_VERSION = "2026-12-02"

#: What the fleet grid shows per engine (keys of a normalised reading).
QUANTITIES: tuple[str, ...] = (
    "running", "waiting", "kv_usage", "prefix_hit_rate", "prompt_tokens", "generation_tokens",
    "finished", "aborted", "preemptions", "ttft", "itl", "e2e", "queue_time",
)


#: What a fleet job may do to an engine (``controls.JobRequest``): each kind's record offers a
#: call for it or says why not.
Action = Literal["reset", "save_trace", "clear_trace", "profile_start", "profile_stop", "save_workload"]


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

    @classmethod
    def parse(cls, value: str) -> ServerKind:
        """The kind a stored or sent value names: :attr:`UNKNOWN` for "" and for a kind this
        version does not know (one a newer member wrote)."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


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
class Probe:
    """A GET that tells a server's kind when its ``/metrics`` does not: the answer is a JSON
    object holding any of ``keys``, and ``version`` names the key that holds its version."""

    path: str
    keys: tuple[str, ...]
    version: str


def _never(exposition: Exposition) -> bool:
    return False


def _named(prefixes: tuple[str, ...]) -> Callable[[Exposition], bool]:
    """The predicate "some metric starts with one of ``prefixes``"."""
    def detect(exposition: Exposition) -> bool:
        return any(name.startswith(prefixes) for name in exposition.names)
    return detect


@dataclass(frozen=True)
class KindRecord:
    """Everything the fleet knows of one kind of server.

    Telling it: ``detect`` (a ``/metrics`` body is of this kind), ``probes`` (the GETs that tell
    it when metrics are off) and ``owned_by`` (what its ``/v1/models`` says, lower-cased).
    Reading it: ``prefixes``, its ``model_label`` and each quantity's ``sources``. Acting on it:
    ``controls`` (our action name -> its HTTP call; ``body_names_engine``: the call takes
    ``{"model": <engine>}`` as its JSON body), and the reason for each action it lacks in
    ``missing_controls``.
    """

    prefixes: tuple[str, ...]
    model_label: str | None
    sources: dict[str, tuple[Source, ...]]
    detect: Callable[[Exposition], bool] = _never
    probes: tuple[Probe, ...] = ()
    owned_by: tuple[str, ...] = ()
    controls: dict[str, Control] = field(default_factory=dict)
    body_names_engine: bool = False
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
#: Every kind but ours: a workload is our flight recorder's (issue 62).
_NO_RECORDER = "no flight recorder on this server: workloads are saved from our servers (replay onto any)"
_VLLM_PREFIXES = ("vllm:", "vllm_")
_SGLANG_PREFIXES = ("sglang:", "sglang_")
_LLAMA_CPP_PREFIXES = ("llamacpp:", "llamacpp_")
#: What only production-stack's router exports (under vLLM's prefix, either separator, or none).
_ROUTER_NAMES = frozenset(prefix + name for prefix in (*_VLLM_PREFIXES, "")
                          for name in ("healthy_pods_total", "current_qps"))
_SGLANG_INFO_KEYS = ("tp_size", "model_path")


def _is_mlc(exposition: Exposition) -> bool:
    return exposition.format == "mlc"


def _is_ours(exposition: Exposition) -> bool:
    return our_prefix(exposition.names) is not None


def _is_vllm_router(exposition: Exposition) -> bool:
    return not _ROUTER_NAMES.isdisjoint(exposition.names)


# In detection order. Ours and the router come before vLLM: both carry vLLM's names (ours with
# --metrics-vllm-aliases, the router re-exporting its backends'). SGLang's probes, which look for
# keys only it sends, come before vLLM's ``/version``, whose ``version`` key many servers send.
KINDS: dict[ServerKind, KindRecord] = {
    ServerKind.MLC: KindRecord(
        prefixes=("",), model_label=None, detect=_is_mlc, owned_by=("mlc-llm",),
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
        body_names_engine=True,
        missing_controls={"clear_trace": "MLC clears its trace only by dumping it", "save_workload": _NO_RECORDER}),
    # Ours name every family <prefix><name> (engines.prometheus_names): the reader takes the prefix
    # a body has (``--metrics-prefix``), and a server from before the prefix has none.
    ServerKind.OURS: KindRecord(
        prefixes=(DEFAULT_METRICS_PREFIX, ""), model_label="model", detect=_is_ours,
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
            "save_workload": Control("POST", "/debug/dump_workload", "with --enable-debug; kept here"),
        },
        body_names_engine=True),
    ServerKind.VLLM_ROUTER: KindRecord(
        prefixes=_VLLM_PREFIXES, model_label=None, sources={}, detect=_is_vllm_router,
        missing_controls=dict.fromkeys(get_args(Action), "a router serves no model itself: act on its backends")),
    ServerKind.SGLANG: KindRecord(
        prefixes=_SGLANG_PREFIXES, model_label="model_name", metrics_flag="--enable-metrics",
        detect=_named(_SGLANG_PREFIXES), owned_by=("sglang",),
        probes=(Probe("/server_info", _SGLANG_INFO_KEYS, "version"),
                Probe("/get_server_info", _SGLANG_INFO_KEYS, "version")),
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
                          "clear_trace": "SGLang records no event trace here", "save_workload": _NO_RECORDER}),
    ServerKind.VLLM: KindRecord(
        prefixes=_VLLM_PREFIXES, model_label="model_name",
        detect=_named(_VLLM_PREFIXES), probes=(Probe("/version", ("version",), "version"),), owned_by=("vllm",),
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
        missing_controls={"save_trace": "vLLM records no event trace", "clear_trace": "vLLM records no event trace",
                          "save_workload": _NO_RECORDER}),
    ServerKind.LLAMA_CPP: KindRecord(
        prefixes=_LLAMA_CPP_PREFIXES, model_label=None, metrics_flag="--metrics",
        detect=_named(_LLAMA_CPP_PREFIXES), owned_by=("llamacpp",),
        probes=(Probe("/props", ("default_generation_settings",), "build_info"),),
        sources={
            "running": (_g("requests_processing"),),
            "waiting": (_g("requests_deferred"),),
            "kv_usage": (_g("kv_cache_usage_ratio", "removed in later builds"),),
            "prompt_tokens": (_c("prompt_tokens_total"),),
            "generation_tokens": (_c("tokens_predicted_total"),),
        },
        missing_controls={"reset": "llama.cpp has no cache reset over HTTP", "profile_start": _NO_PROFILER,
                          "profile_stop": _NO_PROFILER, "save_trace": "llama.cpp records no event trace",
                          "clear_trace": "llama.cpp records no event trace", "save_workload": _NO_RECORDER}),
    ServerKind.UNKNOWN: KindRecord(
        prefixes=("",), model_label=None, sources={},
        missing_controls=dict.fromkeys(get_args(Action), "this server's kind is not known, nor so its controls")),
}
