"""The names ``GET /metrics`` gives its series: one namespace prefix, and vLLM's names as aliases.

Every family of ours is ``<prefix><name>``, the prefix :data:`DEFAULT_METRICS_PREFIX` unless
``serve --metrics-prefix`` says otherwise (``ENGINES_METRICS_PREFIX`` for a bare ASGI deployment).
Without one, ``num_requests_running`` and ``prompt_tokens_total`` meet other exporters' series of
those names in a shared Prometheus (issue 60). The default names the software, as vLLM's ``vllm:``
and llama.cpp's ``llamacpp:`` do theirs, and no known exporter uses it; it ends in ``_`` where theirs
end in ``:``, because Prometheus keeps colons for recording rules (``promtool check metrics`` flags
them).

``serve --metrics-vllm-aliases`` adds :data:`VLLM_ALIASES`: the families whose definition is
vLLM's, again under vLLM's own names and ``model_name`` label, so vLLM's Grafana dashboards and
inference-perf read us unchanged. Those names hold colons: the aliases are off by default, and
``promtool`` flags only them.

The fleet, the benches and the tests find the prefix of a body with :func:`our_prefix`.
"""
from __future__ import annotations

import re
from collections.abc import Collection

__all__ = ["DEFAULT_METRICS_PREFIX", "LEGACY_MARKER", "VLLM_ALIASES", "VLLM_MODEL_LABEL", "check_prefix",
           "our_prefix"]

#: The namespace of our series unless ``--metrics-prefix`` says otherwise.
DEFAULT_METRICS_PREFIX = "llm_engine_"

# A prefix is a metric name's start: it must end in "_" so the names stay words, and may not be
# empty (``up`` and ``info`` would be Prometheus' own series then).
_PREFIX = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*_")

#: Sample names that every body of ours has, prefixed, while it serves an engine (dead ones too).
_LIFE = ("up", "restarts_total")

#: A name only a server from before the prefix (issue 60) exports: its families are unprefixed.
LEGACY_MARKER = "engine_prefill_time_sum"

#: Our family (its name after the prefix, a counter's without ``_total``) -> vLLM's names for
#: the same definition (docs/metrics.md). Not aliased, because vLLM means something else:
#: ``request_success`` (vLLM's counts aborts too, under ``finished_reason``), ``request_queue_time_
#: seconds`` (vLLM's starts when its engine core takes the request, ours at the server's arrival),
#: the prefix cache (vLLM's are hit and query counters).
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    # gpu_cache_usage_perc: the name before vLLM 0.9, still what older dashboards read.
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "num_preemptions": ("vllm:num_preemptions",),
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "request_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    # time_per_output_token_seconds: the per-token gap's name before vLLM 0.10.
    "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}

#: The label vLLM names the served model with (ours: ``model``).
VLLM_MODEL_LABEL = "model_name"


def check_prefix(prefix: str) -> str:
    """``prefix`` when it can start our metric names, else :class:`ValueError` saying why."""
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(f"metrics prefix {prefix!r} must be letters, digits and underscores, not start with a "
                         f"digit and end with '_' (default {DEFAULT_METRICS_PREFIX!r})")
    return prefix


def our_prefix(names: Collection[str]) -> str | None:
    """The prefix of our families among a ``/metrics`` body's sample names: ``""`` for a server
    from before the prefix, None when the body is not ours (or serves no engine)."""
    if LEGACY_MARKER in names:
        return ""
    last = _LIFE[-1]
    for name in names:
        if name.endswith(last):
            prefix = name[:-len(last)]
            if _PREFIX.fullmatch(prefix) and all(prefix + life in names for life in _LIFE):
                return prefix
    return None
