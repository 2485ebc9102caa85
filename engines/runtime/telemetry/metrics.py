"""Engine and request metrics: MLC's names and meanings, plus live gauges and latency distributions.

:class:`RequestMetrics` is one request's counts and time points; its :meth:`~RequestMetrics.as_usage_extra`
is the ``usage.extra`` object of the final response. :class:`EngineMetrics` accumulates over the
engine's life (until :meth:`~EngineMetrics.reset`); :meth:`~EngineMetrics.as_dict` is what
``/debug/dump_engine_metrics`` and the ``query_engine_metrics`` special request return.

MLC semantics kept on purpose (``docs/reference.md``, "Engine metrics"):

* The ``*_tokens_sum`` counters move only when a request finishes; the step times move every
  step. Our counters move as things happen: ``num_prompt_tokens`` when a request's prompt is in
  the KV cache (its prefill done, cached tokens included, once a request), ``num_generation_tokens``
  as each output token is appended (sampled or grammar-forced), aborted and failed requests
  included (vLLM's ``prompt_tokens_total`` and ``generation_tokens_total``); the
  ``*_tokens_processed`` counters count the tokens each step computed.
* ``now``: the rates of the last :data:`NOW_WINDOW_S` seconds of steps (tokens of the steps in the
  window, a step cut by its edge counted pro rata, over the window), and the decode batch size the
  steps actually ran; what every "now" figure on the pages shows.
* ``decode_time_by_batch_size``: MLC's ``TimeCost``, whose first update per batch size is
  discarded as warm-up; :meth:`EngineMetrics.reset` re-arms the warm-up. Batch sizes above
  ``max_tracked_batch_size`` (MLC: 64) are not tracked.
* ``inter_token_latency_s`` of a request is MLC's total time / completion tokens; we add
  ``inter_token_latency_standard_s`` = (e2e - ttft) / (n - 1), and the engine-wide
  ``inter_token_latency_s`` distribution uses the standard one.
* Ratios with a zero denominator are omitted (``*_tokens_per_s``) or 0.0 (latencies), never
  ``inf``/``nan``: those broke MLC's clients (#2519, #2959).

Fixed: a reset zeroes every field of ``last_finished_request`` (MLC left some stale).

Latency distributions (TTFT, inter-token latency, end-to-end, queue time) take bounded memory
(``telemetry.latency_distribution``), with vLLM's bucket boundaries (:data:`TTFT_BUCKETS`, ...), so
the server can expose real Prometheus histograms (:meth:`EngineMetrics.histograms`). A request's
TTFT is observed when its first token comes (:meth:`EngineMetrics.on_first_token`), as vLLM's
histogram is, not when it finishes: a burst's TTFTs count while its streams still run.

Times are ``time.perf_counter()`` seconds. Updates come from the engine thread and reads from
server threads; one lock, held for a few attribute updates, makes that safe.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engines.runtime.telemetry.latency_distribution import (DEFAULT_LATENCY_WINDOW, HistogramSnapshot,
                                                            LatencyDistribution, summarize)

__all__ = [
    "RequestMetrics", "EngineMetrics", "TimeCost", "StepRecord",
    "NOW_WINDOW_S", "now_rates", "TTFT_BUCKETS", "INTER_TOKEN_LATENCY_BUCKETS", "REQUEST_LATENCY_BUCKETS",
]

# vLLM's histogram boundaries (seconds), so dashboards and SLO thresholds carry over.
# time_to_first_token_seconds:
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# inter_token_latency_seconds and request_time_per_output_token_seconds:
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0)
# e2e_request_latency_seconds and request_{queue,inference,prefill,decode}_time_seconds:
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0)

DEFAULT_MAX_TRACKED_BATCH_SIZE = 64
#: Seconds of steps the ``now`` rates are over: a step takes 0.01-3 s, so a window of a few steps
#: would jump by a step's worth (a 0.5 s sample of 0.26 s steps read 0, 15 or 31 tok/s).
NOW_WINDOW_S = 5.0


def _span(start: float | None, end: float | None) -> float:
    """``end - start`` in seconds, 0.0 when either is unknown (never negative)."""
    if start is None or end is None:
        return 0.0
    return max(end - start, 0.0)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


# ---------------------------------------------------------------------- per request


@dataclass(frozen=True, slots=True)
class RecentRequest:
    """A request that ended, as the dashboard's table of recent requests shows it."""

    request_id: str
    finish_reason: str        # one reason, or the choices' several ("length,stop")
    prompt_tokens: int
    completion_tokens: int
    queue_s: float | None     # None: never scheduled (aborted while waiting)
    ttft_s: float | None      # None: no token came
    decode_tokens_per_s: float | None
    end_to_end_s: float
    finished_at: float        # Unix seconds
    #: Disaggregated serving: which half of a request this engine ran ("prefill, sent KV [0:39]",
    #: "decode, KV [0:39] received"); the other half has the same request id on its engine.
    disagg: str | None = None
    #: Where its time went (``usage.extra.time_breakdown``: seconds by phase) and why
    #: (``usage.extra.diagnosis``); docs/metrics.md, "Anatomy of a request".
    time_breakdown: dict[str, float] | None = None
    diagnosis: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: How many ended requests :meth:`EngineMetrics.recent_requests` keeps.
RECENT_REQUESTS = 20


@dataclass(slots=True)
class RequestMetrics:
    """One request's token counts and time points (summed over its ``n`` choices).

    Time points are ``time.perf_counter()`` seconds; ``None`` when the moment never came (a
    request aborted before its first token has no ``first_token_time``).
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_tokens: int = 0        # actually prefilled: prefix-cache hits excluded
    decode_tokens: int = 0         # processed in decode steps
    jump_forward_tokens: int = 0   # appended by the grammar without a model step
    add_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft_s(self) -> float:
        """Time to first token (MLC: also the prefill time), from the request's arrival."""
        return _span(self.add_time, self.first_token_time)

    @property
    def end_to_end_latency_s(self) -> float:
        return _span(self.add_time, self.finish_time)

    @property
    def queue_time_s(self) -> float:
        """Arrival to first scheduling."""
        return _span(self.add_time, self.first_scheduled_time)

    @property
    def decode_time_s(self) -> float:
        """First token to finish."""
        return _span(self.first_token_time, self.finish_time)

    @property
    def inter_token_latency_s(self) -> float:
        """MLC's definition: end-to-end time / completion tokens (0.0 without tokens)."""
        if self.completion_tokens <= 0:
            return 0.0
        return self.end_to_end_latency_s / self.completion_tokens

    @property
    def inter_token_latency_standard_s(self) -> float:
        """The usual definition, (e2e - ttft) / (n - 1): the mean gap between output tokens
        (0.0 with fewer than two tokens or no first token)."""
        if self.completion_tokens <= 1 or self.first_token_time is None:
            return 0.0
        return self.decode_time_s / (self.completion_tokens - 1)

    def as_usage_extra(self) -> dict[str, Any]:
        """MLC's ``usage.extra`` object (same keys, same order), plus
        ``inter_token_latency_standard_s`` and ``queue_time_s``. JSON-ready, always finite."""
        extra: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "jump_forward_tokens": self.jump_forward_tokens,
        }
        ttft = self.ttft_s
        decode_time = self.decode_time_s
        # MLC: prefill speed over (first token - arrival), decode speed over (finish - first
        # token); omitted when there is nothing to divide (or nothing to divide by).
        if self.prefill_tokens and ttft > 0.0:
            extra["prefill_tokens_per_s"] = self.prefill_tokens / ttft
        if self.decode_tokens and decode_time > 0.0:
            extra["decode_tokens_per_s"] = self.decode_tokens / decode_time
        extra["end_to_end_latency_s"] = self.end_to_end_latency_s
        extra["ttft_s"] = ttft
        extra["inter_token_latency_s"] = self.inter_token_latency_s
        extra["inter_token_latency_standard_s"] = self.inter_token_latency_standard_s
        extra["queue_time_s"] = self.queue_time_s
        return {k: _finite(v) if isinstance(v, float) else v for k, v in extra.items()}


# ---------------------------------------------------------------------- building blocks


class TimeCost:
    """MLC's ``TimeCost``: a mean of step times whose first update is discarded (warm-up:
    compilation and first-touch allocations make the first step of a shape unrepresentative)."""

    __slots__ = ("sum", "count", "warmed_up")

    def __init__(self) -> None:
        self.sum = 0.0
        self.count = 0
        self.warmed_up = False

    def update(self, seconds: float) -> None:
        if self.warmed_up:
            self.sum += seconds
            self.count += 1
        else:
            self.warmed_up = True

    def as_dict(self) -> dict[str, Any]:
        """``{"count", "mean"}``, ``mean`` only when ``count > 0`` (as MLC)."""
        out: dict[str, Any] = {"count": self.count}
        if self.count:
            out["mean"] = _finite(self.sum / self.count)
        return out


# ---------------------------------------------------------------------- engine-wide


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as the ``now`` rates count it."""

    ended_at: float          # perf_counter seconds
    seconds: float
    prefill_tokens: int
    decode_seqs: int         # sequences that decoded one token each (the step's decode batch size)


def now_rates(steps: Sequence[StepRecord], now: float, window_s: float = NOW_WINDOW_S,
              since: float | None = None) -> dict[str, Any]:
    """The ``now`` figures over the steps that overlap ``[now - window_s, now]``: prefill and
    decode tokens/s (a step cut by the window's edge counts pro rata to its overlap), the share of
    the window spent in steps (``busy``), and the mean and largest decode batch size of the steps
    that decoded. ``since``: when counting began (the engine started or was reset), so a window
    that reaches back before it is that much shorter."""
    start = now - window_s if since is None else max(now - window_s, since)
    span = now - start
    prefill = decode = busy = 0.0
    batch_sum = batch_steps = batch_max = count = 0
    for step in steps:
        if step.ended_at < start:
            continue
        overlap = min(step.ended_at, now) - max(step.ended_at - step.seconds, start)
        share = min(overlap / step.seconds, 1.0) if step.seconds > 0.0 else 1.0
        count += 1
        busy += overlap
        prefill += step.prefill_tokens * share
        decode += step.decode_seqs * share
        if step.decode_seqs:
            batch_sum += step.decode_seqs
            batch_steps += 1
            batch_max = max(batch_max, step.decode_seqs)
    return {"window_s": span, "steps": count,
            "prefill_tokens_per_s": prefill / span if span > 0 else 0.0,
            "decode_tokens_per_s": decode / span if span > 0 else 0.0,
            "busy": min(busy / span, 1.0) if span > 0 else 0.0,
            "decode_batch_size": batch_sum / batch_steps if batch_steps else None,
            "decode_batch_size_max": batch_max if batch_steps else None}


# Engine-wide distributions: as_dict key, Prometheus family name (vLLM's), bounds.
_DISTRIBUTIONS: tuple[tuple[str, str, tuple[float, ...]], ...] = (
    ("ttft_s", "time_to_first_token_seconds", TTFT_BUCKETS),
    # per request: the standard ITL, i.e. vLLM's time per output token (not per-gap samples)
    ("inter_token_latency_s", "request_time_per_output_token_seconds", INTER_TOKEN_LATENCY_BUCKETS),
    ("end_to_end_latency_s", "e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
    ("queue_time_s", "request_queue_time_seconds", REQUEST_LATENCY_BUCKETS),
    # per token: the gap between a request's consecutive steps that produced output (vLLM's ITL)
    ("token_gap_s", "inter_token_latency_seconds", INTER_TOKEN_LATENCY_BUCKETS),
)


class EngineMetrics:
    """Engine-wide metrics: MLC's ``EngineMetrics`` plus live gauges and latency distributions.

    The engine thread calls the ``on_*`` methods and :meth:`set_gauges`; any thread may call
    :meth:`as_dict` and :meth:`histograms`.
    """

    def __init__(self, max_tracked_batch_size: int = DEFAULT_MAX_TRACKED_BATCH_SIZE,
                 latency_window: int = DEFAULT_LATENCY_WINDOW) -> None:
        """``max_tracked_batch_size``: largest batch size with a decode timer (MLC: 64).
        ``latency_window``: how many recent requests the percentiles cover."""
        self.max_tracked_batch_size = max_tracked_batch_size
        self._lock = threading.Lock()
        self._distributions = {key: LatencyDistribution(bounds, latency_window)
                               for key, _, bounds in _DISTRIBUTIONS}
        self.kv_pages_total = 0  # capacity: set by the engine, kept by reset()
        # The steps of the last NOW_WINDOW_S (pruned as steps come; bounded for tiny steps).
        self._steps: deque[StepRecord] = deque(maxlen=8192)
        self._zero()

    def _zero(self) -> None:
        # MLC's fields.
        self.engine_prefill_time_sum = 0.0
        self.engine_decode_time_sum = 0.0
        self.engine_jump_forward_time_sum = 0.0
        self.prompt_tokens_sum = 0
        self.completion_tokens_sum = 0
        self.prefill_tokens_sum = 0
        self.decode_tokens_sum = 0
        self.jump_forward_tokens_sum = 0
        self.last_finished_request = RequestMetrics()
        self.decode_time_by_batch_size: dict[int, TimeCost] = {}
        self._recent: deque[RecentRequest] = deque(maxlen=RECENT_REQUESTS)
        # Ours: live counters (move every step) and gauges.
        self.num_prefill_steps = 0
        self.num_decode_steps = 0
        self.num_prompt_tokens = 0      # as prompts reach the KV cache (vLLM's prompt_tokens_total)
        self.num_generation_tokens = 0  # as output tokens are appended (vLLM's generation_tokens_total)
        self.prefill_tokens_processed = 0
        self.decode_tokens_processed = 0
        self.jump_forward_tokens_processed = 0
        self.num_finished_requests = 0
        self.num_aborted_requests = 0  # ended by an abort (a client gone, a reset, a failure)
        self.num_failed_requests = 0   # of those, ended by a failure of their own (grammar, tokenizer)
        self.num_preemptions = 0
        self.num_kv_evictions = 0  # the pool's count, mirrored by set_gauges (zeroed with it on reset)
        self.num_running_requests = 0
        self.num_waiting_requests = 0
        self.kv_pages_used = 0
        self.prefix_cache_hit_rate = 0.0
        self._steps.clear()
        self._counting_since = time.perf_counter()
        for dist in self._distributions.values():
            dist.reset()

    # ------------------------------------------------------------------ engine thread

    def on_prefill_step(self, seconds: float, tokens: int) -> None:
        """A step that prefilled ``tokens`` prompt tokens (decodes riding along included)."""
        with self._lock:
            self.engine_prefill_time_sum += seconds
            self.prefill_tokens_processed += tokens
            self.num_prefill_steps += 1

    def on_decode_step(self, seconds: float, batch_size: int, tokens: int | None = None) -> None:
        """A decode-only step over ``batch_size`` sequences (``tokens`` processed, default one
        per sequence)."""
        with self._lock:
            self.engine_decode_time_sum += seconds
            self.decode_tokens_processed += batch_size if tokens is None else tokens
            self.num_decode_steps += 1
            if 1 <= batch_size <= self.max_tracked_batch_size:
                cost = self.decode_time_by_batch_size.get(batch_size)
                if cost is None:
                    cost = self.decode_time_by_batch_size[batch_size] = TimeCost()
                cost.update(seconds)

    def on_step(self, seconds: float, *, prefill_tokens: int, decode_seqs: int, generated_tokens: int = 0,
                prompt_tokens: int = 0, ended_at: float | None = None) -> None:
        """One engine step as the scheduler shaped it, ended at ``ended_at`` (default now). A step
        with any prefill is a prefill step (MLC times hybrid steps as prefill, and they don't feed
        the per-batch-size decode timers); otherwise it is a decode step of ``decode_seqs``
        sequences. ``generated_tokens``: output tokens the step appended (sampled and forced);
        ``prompt_tokens``: prompt tokens of the requests whose prefill it completed."""
        ended_at = time.perf_counter() if ended_at is None else ended_at
        record = StepRecord(ended_at, seconds, prefill_tokens, decode_seqs)
        with self._lock:
            self.num_generation_tokens += generated_tokens
            self.num_prompt_tokens += prompt_tokens
            steps = self._steps
            steps.append(record)
            while steps and steps[0].ended_at < ended_at - NOW_WINDOW_S:
                steps.popleft()
            if prefill_tokens:
                self.engine_prefill_time_sum += seconds
                self.prefill_tokens_processed += prefill_tokens
                self.decode_tokens_processed += decode_seqs
                self.num_prefill_steps += 1
        if not prefill_tokens and decode_seqs:
            self.on_decode_step(seconds, decode_seqs)

    def on_scheduled(self, queue_s: float) -> None:
        """A request was first scheduled ``queue_s`` after it arrived: its queue time counts now."""
        with self._lock:
            self._distributions["queue_time_s"].observe(queue_s)

    def on_jump_forward(self, seconds: float, tokens: int) -> None:
        """Tokens the grammar forced (appended without a model step)."""
        with self._lock:
            self.engine_jump_forward_time_sum += seconds
            self.jump_forward_tokens_processed += tokens

    def on_token_gaps(self, gaps: Sequence[float]) -> None:
        """Seconds since each request's previous output token, for the tokens of one step."""
        if not gaps:
            return
        with self._lock:
            dist = self._distributions["token_gap_s"]
            for gap in gaps:
                dist.observe(gap)

    def on_first_token(self, ttft_s: float) -> None:
        """A request's first token came ``ttft_s`` after it arrived: its TTFT counts now."""
        with self._lock:
            self._distributions["ttft_s"].observe(ttft_s)

    def on_preemption(self, count: int = 1) -> None:
        with self._lock:
            self.num_preemptions += count

    def on_request_finished(self, request: RequestMetrics) -> None:
        """Fold a finished request in: MLC's token sums, ``last_finished_request``, latencies."""
        snapshot = dataclasses.replace(request)  # the caller may keep mutating its object
        dist = self._distributions
        with self._lock:
            self.prompt_tokens_sum += request.prompt_tokens
            self.completion_tokens_sum += request.completion_tokens
            self.prefill_tokens_sum += request.prefill_tokens
            self.decode_tokens_sum += request.decode_tokens
            self.jump_forward_tokens_sum += request.jump_forward_tokens
            self.last_finished_request = snapshot
            self.num_finished_requests += 1
            if request.add_time is not None and request.finish_time is not None:
                dist["end_to_end_latency_s"].observe(snapshot.end_to_end_latency_s)
            if request.completion_tokens > 1 and request.first_token_time is not None \
                    and request.finish_time is not None:
                dist["inter_token_latency_s"].observe(snapshot.inter_token_latency_standard_s)

    def on_request_ended(self, request: RecentRequest) -> None:
        """Remember a request that ended (aborted ones too) for :meth:`recent_requests`."""
        with self._lock:
            self._recent.append(request)
            if "abort" in request.finish_reason.split(","):
                self.num_aborted_requests += 1

    def on_request_failed(self) -> None:
        """A request failed on its own (its grammar or its detokenizer raised) and is aborted."""
        with self._lock:
            self.num_failed_requests += 1

    def recent_requests(self) -> list[dict[str, Any]]:
        """The last :data:`RECENT_REQUESTS` requests that ended, newest first (JSON-ready)."""
        with self._lock:
            recent = list(self._recent)
        return [r.as_dict() for r in reversed(recent)]

    def set_gauges(self, *, num_running_requests: int | None = None,
                   num_waiting_requests: int | None = None, kv_pages_used: int | None = None,
                   kv_pages_total: int | None = None,
                   prefix_cache_hit_rate: float | None = None, num_kv_evictions: int | None = None) -> None:
        """Update the live gauges given (``None`` leaves one as it is)."""
        with self._lock:
            if num_kv_evictions is not None:
                self.num_kv_evictions = num_kv_evictions
            if num_running_requests is not None:
                self.num_running_requests = num_running_requests
            if num_waiting_requests is not None:
                self.num_waiting_requests = num_waiting_requests
            if kv_pages_used is not None:
                self.kv_pages_used = kv_pages_used
            if kv_pages_total is not None:
                self.kv_pages_total = kv_pages_total
            if prefix_cache_hit_rate is not None:
                self.prefix_cache_hit_rate = prefix_cache_hit_rate

    def reset(self) -> None:
        """Zero every metric, ``last_finished_request`` included, and re-arm the decode timers'
        warm-up (as MLC). ``kv_pages_total`` is capacity, not a measurement: it stays."""
        with self._lock:
            self._zero()

    # ------------------------------------------------------------------ readers

    def as_dict(self) -> dict[str, Any]:
        """MLC's engine metrics JSON (same keys, same conditions) followed by ours.

        JSON-ready and never ``inf``/``nan``. MLC's ``spec_decode``, ``draft_time_by_batch_size``
        and ``verify_time_by_batch_size`` are absent: this engine has no speculative decoding.
        """
        with self._lock:
            out: dict[str, Any] = {
                "engine_prefill_time_sum": self.engine_prefill_time_sum,
                "engine_decode_time_sum": self.engine_decode_time_sum,
                "engine_jump_forward_time_sum": self.engine_jump_forward_time_sum,
                "prompt_tokens_sum": self.prompt_tokens_sum,
                "completion_tokens_sum": self.completion_tokens_sum,
                "prefill_tokens_sum": self.prefill_tokens_sum,
                "decode_tokens_sum": self.decode_tokens_sum,
                "jump_forward_tokens_sum": self.jump_forward_tokens_sum,
            }
            # MLC guards prefill on the token sum only (time 0 gave inf); we guard both.
            if self.prefill_tokens_sum and self.engine_prefill_time_sum > 0.0:
                out["prefill_tokens_per_s"] = self.prefill_tokens_sum / self.engine_prefill_time_sum
            if self.engine_decode_time_sum > 0.0:
                out["decode_tokens_per_s"] = self.decode_tokens_sum / self.engine_decode_time_sum
            out["last_finished_request"] = self.last_finished_request.as_usage_extra()
            by_batch: dict[str, Any] = {}
            for size in sorted(self.decode_time_by_batch_size):
                cost = self.decode_time_by_batch_size[size]
                if cost.count:
                    by_batch[f"mean{{batch_size={size}}}"] = cost.sum / cost.count
                    by_batch[f"count{{batch_size={size}}}"] = cost.count
            out["decode_time_by_batch_size"] = by_batch
            total = self.kv_pages_total
            out.update({
                "num_running_requests": self.num_running_requests,
                "num_waiting_requests": self.num_waiting_requests,
                "kv_pages_used": self.kv_pages_used,
                "kv_pages_total": total,
                "kv_cache_usage": self.kv_pages_used / total if total else 0.0,
                "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
                "num_preemptions": self.num_preemptions,
                "num_kv_evictions": self.num_kv_evictions,
                "num_finished_requests": self.num_finished_requests,
                "num_aborted_requests": self.num_aborted_requests,
                "num_failed_requests": self.num_failed_requests,
                "num_prefill_steps": self.num_prefill_steps,
                "num_decode_steps": self.num_decode_steps,
                "num_prompt_tokens": self.num_prompt_tokens,
                "num_generation_tokens": self.num_generation_tokens,
                "prefill_tokens_processed": self.prefill_tokens_processed,
                "decode_tokens_processed": self.decode_tokens_processed,
                "jump_forward_tokens_processed": self.jump_forward_tokens_processed,
            })
            snapshots = {key: d.snapshot() for key, d in self._distributions.items()}
            steps, since = list(self._steps), self._counting_since
        now = time.perf_counter()
        out["now"] = now_rates(steps, now, since=since)
        # Percentiles outside the lock: the engine thread shouldn't wait on numpy.
        for key, snap in snapshots.items():
            out[key] = summarize(*snap, now=now)
        return _sanitize(out)

    def histograms(self) -> dict[str, HistogramSnapshot]:
        """Bucket counts per distribution, keyed by vLLM's Prometheus family name
        (``time_to_first_token_seconds``, ``request_time_per_output_token_seconds``,
        ``e2e_request_latency_seconds``, ``request_queue_time_seconds``)."""
        with self._lock:
            return {family: self._distributions[key].histogram() for key, family, _ in _DISTRIBUTIONS}


def _sanitize(value: Any) -> Any:
    """Replace any non-finite float (from a caller passing one in) by 0.0, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else 0.0
    if isinstance(value, dict):
        return {k: _sanitize(v) for k, v in value.items()}
    return value
