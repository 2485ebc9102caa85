"""Derive per-request summaries and per-phase statistics from a Chrome trace.

Input is the object the engine's ``TraceRecorder`` exports (see docs/interfaces.md,
"Event trace"): ``{"traceEvents": [...], "otherData": {...}}``, or the bare array form.
Output is plain data (:class:`TraceAnalysis`) that the history store turns into
database rows; nothing here touches Django, so it is unit-testable on its own.

The walk over the events is one tight Python loop (a million events take well under
a second): per event only a few dict look-ups, and everything else (sums, percentiles)
happens once per lane or once per phase afterwards, with numpy.

What a request lane yields (all times in microseconds, ``None`` when the trace lacks
the events needed, e.g. because the capture window cut the request):

- ``queue``: total time in ``queue`` spans (a preempted request queues again);
- ``ttft``: ``first token`` minus the request's arrival: the server's ``receive request`` or the
  start of its first ``queue`` span, both stamped when it reached the server (docs/metrics.md),
  else (a trace of an older server) ``request added to engine``;
- ``prefill`` / ``decode``: total time in ``prefill (n)`` / ``decode (n)`` spans
  (0 for a finished request that never had such a span, e.g. one-token outputs);
- ``e2e``: the ``finish`` instant minus the arrival;
- tokens and the finish reason from the ``finish`` instant's args (the prompt token
  count falls back to ``request added to engine``'s args);
- ``preemptions``: the number of ``preempt`` instants;
- ``time_breakdown`` / ``diagnosis``: the request's anatomy (seconds by phase, and the sentences
  that explain it; docs/metrics.md, "Anatomy of a request") from the ``finish`` instant's args,
  kept only when well formed (known phases, finite, not negative; a short list of short strings).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from engines.history.columns import STATISTIC_COLUMNS

# "prefill (3)" -> "prefill": the recorder numbers the nth span of a name per request.
_COUNTER_SUFFIX = re.compile(r" \(\d+\)$")

ENGINE_LANE_NAME = "engine"


class TraceFormatError(ValueError):
    """The value is not a Chrome trace this module can read; the message says why."""


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary statistics of a set of values (durations in microseconds, or counts)."""

    count: int
    total: float
    mean: float
    min: float
    p50: float
    p90: float
    p99: float
    max: float

    STATS = ("count", "total", "mean", "min", "p50", "p90", "p99", "max")

    @classmethod
    def of(cls, values: Sequence[float] | np.ndarray) -> "Distribution | None":
        """Statistics of ``values``, or ``None`` for an empty set."""
        arr = np.asarray(values, dtype=np.float64)
        if arr.size == 0:
            return None
        p50, p90, p99 = np.percentile(arr, (50, 90, 99))
        return cls(
            count=int(arr.size),
            total=float(arr.sum()),
            mean=float(arr.mean()),
            min=float(arr.min()),
            p50=float(p50),
            p90=float(p90),
            p99=float(p99),
            max=float(arr.max()),
        )

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.STATS}


@dataclass(frozen=True, slots=True)
class PhaseStats:
    """Durations of every span of one base name (``prefill``, ``decode``, ...) on one kind of lane.

    ``lane`` is ``"request"`` (one span per request per step) or ``"engine"`` (one span
    per batch-wide step); the two are kept apart because a decode step shows up once on
    the engine lane and once on every request lane of the batch.
    """

    lane: str
    phase: str
    durations: Distribution

    def as_dict(self) -> dict[str, Any]:
        return {"lane": self.lane, "phase": self.phase, **self.durations.as_dict()}


@dataclass(frozen=True, slots=True)
class RequestStats:
    """What one request lane of the trace says about that request."""

    request_id: str
    added_ts: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    queue_us: float | None
    ttft_us: float | None
    prefill_us: float | None
    decode_us: float | None
    e2e_us: float | None
    finish_reason: str
    preemptions: int
    time_breakdown: dict[str, float] | None = None
    diagnosis: tuple[str, ...] = ()


@dataclass(frozen=True)
class TraceAnalysis:
    """Everything the history store keeps about a trace besides the payload itself."""

    event_count: int
    first_ts: float | None
    last_ts: float | None
    dropped_events: int
    requests: list[RequestStats]
    phases: list[PhaseStats]
    # Distributions of the statistic columns (engines.history.columns), keyed by field name.
    request_distributions: dict[str, Distribution]
    other_data: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration_us(self) -> float | None:
        if self.first_ts is None or self.last_ts is None:
            return None
        return self.last_ts - self.first_ts

    def stats_json(self) -> dict[str, Any]:
        """The JSON kept on the trace record, so detail and compare pages never open the payload."""
        return {
            "phases": [p.as_dict() for p in self.phases],
            "requests": {name: d.as_dict() for name, d in self.request_distributions.items()},
        }


class _Lane:
    """Per-(pid, tid) accumulator while walking the events."""

    __slots__ = ("stack", "durations", "request_id", "added_ts", "arrival_ts", "first_token_ts", "finish_ts",
                 "finish_args", "added_args", "preemptions")

    def __init__(self) -> None:
        self.stack: list[tuple[Any, float]] = []
        self.durations: dict[str, list[float]] = {}
        self.request_id: str | None = None
        self.added_ts: float | None = None
        self.arrival_ts: float | None = None  # the earliest "receive request" or queue start
        self.first_token_ts: float | None = None
        self.finish_ts: float | None = None
        self.finish_args: Mapping[str, Any] | None = None
        self.added_args: Mapping[str, Any] | None = None
        self.preemptions = 0


def trace_events(trace: Any) -> list[Any]:
    """The event list of a trace in object or array form; raises :class:`TraceFormatError`."""
    if isinstance(trace, Mapping):
        events = trace.get("traceEvents")
        if not isinstance(events, list):
            raise TraceFormatError('a Chrome trace object needs a "traceEvents" list')
        return events
    if isinstance(trace, list):
        return trace
    raise TraceFormatError(
        f"a Chrome trace is a JSON object with \"traceEvents\" or a JSON array, not {type(trace).__name__}"
    )


def analyze_trace(trace: Any) -> TraceAnalysis:
    """Walk the trace once and derive request summaries, phase and latency statistics.

    Tolerates what real captures contain: events without ``ts``, ``E`` without a
    matching ``B`` (the window started mid-span), spans never closed, lanes without a
    ``thread_name``. Raises :class:`TraceFormatError` only when there is no event list.
    """
    events = trace_events(trace)
    other = trace.get("otherData") if isinstance(trace, Mapping) else None
    other = other if isinstance(other, Mapping) else {}

    lanes: dict[tuple[Any, Any], _Lane] = {}
    thread_names: dict[tuple[Any, Any], str] = {}
    base_names: dict[Any, str] = {}
    count = 0
    first = math.inf
    last = -math.inf

    dur: float | None  # a span's duration: a B-E pair's, or an X event's own (which may be missing)
    # The hot loop: locals only, no function calls beyond dict/list methods.
    for ev in events:
        if not isinstance(ev, dict):
            continue
        ph = ev.get("ph")
        if ph == "M":
            if ev.get("name") == "thread_name":
                args = ev.get("args")
                if isinstance(args, dict) and isinstance(args.get("name"), str):
                    thread_names[(ev.get("pid"), ev.get("tid"))] = args["name"]
            continue
        ts = ev.get("ts")
        if ts is None or ts.__class__ not in (int, float):
            continue
        count += 1
        if ts < first:
            first = ts
        if ts > last:
            last = ts
        key = (ev.get("pid"), ev.get("tid"))
        lane = lanes.get(key)
        if lane is None:
            lane = lanes[key] = _Lane()
        if lane.request_id is None:
            args = ev.get("args")
            if args.__class__ is dict:
                rid = args.get("request_id")
                if rid is not None:
                    lane.request_id = str(rid)
        if ph == "B":
            name = ev.get("name")
            lane.stack.append((name, ts))
            if name == "queue (0)" and (lane.arrival_ts is None or ts < lane.arrival_ts):
                lane.arrival_ts = ts
            continue
        if ph == "E":
            # E closes the latest open B on its lane, whatever its name (Chrome rules).
            if not lane.stack:
                continue
            name, start = lane.stack.pop()
            dur = ts - start
        elif ph == "X":
            name = ev.get("name")
            dur = ev.get("dur")
            if dur is None or dur.__class__ not in (int, float):
                continue
            # An X event ends at ts + dur: the window's end must cover it.
            if ts + dur > last:
                last = ts + dur
        elif ph == "i" or ph == "I":
            name = ev.get("name")
            if name == "first token":
                if lane.first_token_ts is None:
                    lane.first_token_ts = ts
            elif name == "finish":
                lane.finish_ts = ts
                lane.finish_args = ev.get("args")
            elif name == "request added to engine":
                if lane.added_ts is None:
                    lane.added_ts = ts
                    lane.added_args = ev.get("args")
            elif name == "receive request":
                if lane.arrival_ts is None or ts < lane.arrival_ts:
                    lane.arrival_ts = ts
            elif name == "preempt":
                lane.preemptions += 1
            continue
        else:
            continue
        base = base_names.get(name)
        if base is None:
            base = base_names[name] = _COUNTER_SUFFIX.sub("", str(name))
        bucket = lane.durations.get(base)
        if bucket is None:
            lane.durations[base] = [dur]
        else:
            bucket.append(dur)

    requests: list[RequestStats] = []
    phase_values: dict[tuple[str, str], list[list[float]]] = {}
    for key, lane in lanes.items():
        label = thread_names.get(key)
        request_id = lane.request_id if lane.request_id is not None else (
            label if label is not None and label != ENGINE_LANE_NAME else None)
        kind = "request" if request_id is not None else "engine"
        for base, durations in lane.durations.items():
            phase_values.setdefault((kind, base), []).append(durations)
        if request_id is not None:
            requests.append(_request_stats(request_id, lane))

    phases = []
    for (kind, base), chunks in sorted(phase_values.items()):
        dist = Distribution.of(np.concatenate([np.asarray(c, dtype=np.float64) for c in chunks]))
        if dist is not None:
            phases.append(PhaseStats(lane=kind, phase=base, durations=dist))

    return TraceAnalysis(
        event_count=count,
        first_ts=first if count else None,
        last_ts=last if count else None,
        dropped_events=_non_negative_int(other.get("dropped_events")) or 0,
        requests=requests,
        phases=phases,
        request_distributions=_request_distributions(requests),
        other_data=other,
    )


def _request_stats(request_id: str, lane: _Lane) -> RequestStats:
    finished = lane.finish_ts is not None
    finish_args = lane.finish_args if isinstance(lane.finish_args, Mapping) else {}
    added_args = lane.added_args if isinstance(lane.added_args, Mapping) else {}

    def span_total(base: str) -> float | None:
        values = lane.durations.get(base)
        if values:
            return float(sum(values))
        return 0.0 if finished else None

    prompt_tokens = _non_negative_int(finish_args.get("prompt_tokens"))
    if prompt_tokens is None:
        prompt_tokens = _non_negative_int(added_args.get("prompt_tokens"))
    added = lane.added_ts
    arrival = lane.arrival_ts if lane.arrival_ts is not None else added
    return RequestStats(
        request_id=request_id,
        added_ts=added,
        prompt_tokens=prompt_tokens,
        completion_tokens=_non_negative_int(finish_args.get("completion_tokens")),
        queue_us=float(sum(lane.durations["queue"])) if "queue" in lane.durations else None,
        ttft_us=(lane.first_token_ts - arrival) if arrival is not None and lane.first_token_ts is not None else None,
        prefill_us=span_total("prefill"),
        decode_us=span_total("decode"),
        e2e_us=(lane.finish_ts - arrival) if arrival is not None and lane.finish_ts is not None else None,
        finish_reason=str(finish_args.get("finish_reason") or ""),
        preemptions=lane.preemptions,
        time_breakdown=_time_breakdown(finish_args.get("time_breakdown")),
        diagnosis=_diagnosis(finish_args.get("diagnosis")),
    )


# A diagnosis is a few rule sentences (engines/runtime/core/diagnosis.py); a trace from elsewhere
# may hold anything, so what is kept is bounded.
MAX_DIAGNOSIS_SENTENCES = 16
MAX_SENTENCE_CHARS = 500


def _time_breakdown(value: Any) -> dict[str, float] | None:
    """The phases in engine order, or None unless ``value`` maps only known phases to seconds."""
    if not isinstance(value, Mapping) or not value:
        return None
    from engines.runtime import PHASES  # the anatomy module alone: no numba, no model

    out: dict[str, float] = {}
    for name in PHASES:
        seconds = value.get(name, 0.0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or seconds < 0:
            return None
        out[name] = float(seconds)
    if any(name not in out for name in value):
        return None
    return out


def _diagnosis(value: Any) -> tuple[str, ...]:
    """The sentences, or () unless ``value`` is a short list of strings."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_DIAGNOSIS_SENTENCES:
        return ()
    if not all(isinstance(s, str) for s in value):
        return ()
    return tuple(s[:MAX_SENTENCE_CHARS] for s in value)


def _request_distributions(requests: Iterable[RequestStats]) -> dict[str, Distribution]:
    out: dict[str, Distribution] = {}
    for column in STATISTIC_COLUMNS:
        dist = Distribution.of([v for r in requests if (v := getattr(r, column.field)) is not None])
        if dist is not None:
            out[column.field] = dist
    return out


def _non_negative_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value != value or value < 0 or value in (math.inf, -math.inf):
        return None
    return int(value)
