"""What watches a step: the event trace recorder and the built-in profiler, behind one object.

The engine holds a :class:`StepObserver` only while tracing is on or a profile runs (None
otherwise), so a step that nobody watches pays one ``is None`` check a seam. At each seam the
observer records the trace's events (MLC's names, on the requests' lanes and the engine's) and
laps the profiler (the time since the previous seam, charged to a phase of
``telemetry.profiler.PHASES``). Request-level events outside the step go through
:meth:`StepObserver.event` too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engines.runtime.core.kv_pool import KVCachePool
    from engines.runtime.core.scheduler import SchedulerOutput
    from engines.runtime.telemetry.profiler import StepProfiler
    from engines.runtime.telemetry.trace_recorder import TraceRecorder

__all__ = ["StepObserver"]


class StepObserver:
    """The trace recorder and the running profiler at the step's seams (either may be None)."""

    def __init__(self, tracer: "TraceRecorder | None", profiler: "StepProfiler | None") -> None:
        self.tracer = tracer
        self.profiler = profiler
        self._prefill_ids: list[str] = []
        self._decode_ids: list[str] = []
        self._engine_lane_prefills = False

    @classmethod
    def watching(cls, tracer: "TraceRecorder | None", profiler: "StepProfiler | None") -> "StepObserver | None":
        """An observer of what is on, or None when neither is."""
        return None if tracer is None and profiler is None else cls(tracer, profiler)

    # -------------------------------------------------------------- the profiler's seams

    def begin_step(self) -> None:
        """A step starts."""
        if self.profiler is not None:
            self.profiler.begin_step()

    def lap(self, phase: str) -> None:
        """The time since the previous seam went to ``phase``."""
        if self.profiler is not None:
            self.profiler.lap(phase)

    def end_step(self, batch_size: int, tokens: int, prefill_tokens: int) -> bool:
        """The step ended; True when that ended the profile too (its step or time limit)."""
        return self.profiler is not None and self.profiler.end_step(batch_size, tokens, prefill_tokens)

    # ------------------------------------------------------------------ the trace's events

    def event(self, request_ids: str | list[str], name: str, args: dict[str, Any] | None = None,
              at: float | None = None) -> None:
        """A trace event on the lanes of ``request_ids`` (no-op while tracing is off), now or ``at``
        (``perf_counter`` seconds: a moment the server stamped, such as a request's arrival)."""
        if self.tracer is not None:
            self.tracer.add_event(request_ids, name, args, at_ns=None if at is None else round(at * 1e9))

    def scheduled(self, sched: "SchedulerOutput", kv_pool: "KVCachePool") -> None:
        """The schedule seam's events: queue spans that close, what each admission got,
        preemptions. Called before the engine stamps first admissions (it tells them apart)."""
        tracer = self.tracer
        if tracer is None:
            return
        dequeued: set[str] = set()  # the choices of one request leave its queue span once
        for seq in sched.admitted:
            rid = seq.request.request_id
            if seq.request.first_scheduled_time is None and rid not in dequeued:
                dequeued.add(rid)
                tracer.add_event(rid, "finish queue")
            # What the prefix cache gave back and what the pool handed out.
            tracer.add_event(rid, "kv cache admit", {"cached_tokens": seq.num_cached_prefix_tokens,
                                                     "pages": len(kv_pool.pages(seq.seq_id))})
        for seq in sched.preempted:
            tracer.add_event(seq.request.request_id, "preempt")

    def forward_starting(self, sched: "SchedulerOutput") -> None:
        """The forward pass is about to run: its prefill and decode spans open, and the batch's
        preparation is lapped."""
        tracer = self.tracer
        if tracer is not None:
            # Each request's lane gets its own chunk's phase (a decode riding along a prefill step is
            # a decode there); the engine lane gets the step's (prefill if any chunk prefills).
            chunks = sched.chunks
            self._engine_lane_prefills = bool(sched.num_prefill_tokens)
            self._prefill_ids = [c.seq.request.request_id for c in chunks if c.prefills]
            self._decode_ids = [c.seq.request.request_id for c in chunks if not c.prefills]
            args = {"batch_size": len(chunks)}
            tracer.add_event(self._prefill_ids, "start prefill", args, engine_lane=self._engine_lane_prefills)
            tracer.add_event(self._decode_ids, "start decode", args, engine_lane=not self._engine_lane_prefills)
        self.lap("prepare")

    def forward_done(self, sched: "SchedulerOutput") -> None:
        """The forward pass returned: lapped, and its spans close."""
        self.lap("forward")
        tracer = self.tracer
        if tracer is not None:
            args = {"tokens": sched.num_tokens}
            tracer.add_event(self._prefill_ids, "finish prefill", args, engine_lane=self._engine_lane_prefills)
            tracer.add_event(self._decode_ids, "finish decode", args, engine_lane=not self._engine_lane_prefills)
