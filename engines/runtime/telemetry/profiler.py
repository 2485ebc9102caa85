"""The built-in profiler: every kernel launch and every engine step timed, on any backend.

While a profile runs, the engine's model calls its kernels through a :class:`ProfiledBackend`
(host timers around each launch; on a GPU the launch is synchronised first and after, and the
step runs without its CUDA graph, so each kernel is timed alone), and the engine marks the
seams of its step (:meth:`StepProfiler.lap`). When no profile runs, the engine holds ``None``
and its model the plain backend: one ``is not None`` check per seam, as the trace recorder.

The result, :class:`ProfileResult`, is plain data (it crosses the engine's process boundary):
a per-kernel table with achieved GB/s and GFLOP/s from each launch's bytes and flops (the op's
``cost``, the napkin math beside its kernel: ``model.kernels.ops``), a
per-step breakdown, the launches and steps as Chrome-trace spans on the event trace's clock,
and, when asked, the engine thread's Python stacks (:mod:`.stack_sampler`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from numba import njit, prange

from engines.runtime.numba_cache import install_cache_locators
from engines.runtime.telemetry.stack_sampler import StackSampler
from engines.runtime.telemetry.trace_recorder import epoch_anchor_ns

install_cache_locators()  # before this module's compiled functions are decorated

__all__ = ["PHASES", "ProfileResult", "ProfileStatus", "ProfiledBackend", "ProfilerStateError",
           "StepProfiler", "measure_host_bandwidth"]

#: The seams of an engine step, in order (``Engine.step``); ``kernels`` and ``transfers`` are
#: the forward pass's launches and copies, ``forward other`` the rest of it (host-side
#: preparation inside the model, launch overhead).
PHASES = ("schedule", "prepare", "kernels", "transfers", "forward other", "commit", "grammar", "sampling",
          "detokenization", "outputs")
#: The profile's process id in its Chrome trace (the event trace's engine is 1).
PROFILE_PID = 2
#: Kernel launches kept as trace spans; past it only the table's totals grow.
MAX_SPANS = 200_000


class ProfilerStateError(RuntimeError):
    """A start while a profile runs, or a stop with none: the caller's 409."""


@dataclass(frozen=True)
class ProfileStatus:
    """Where the engine's profiler stands (answered at once, even mid-step)."""

    running: bool
    steps: int = 0              # steps profiled so far
    max_steps: int | None = None
    started_at_us: int | None = None
    finished: bool = False       # stopped by itself (max_steps, time limit): a result waits for stop
    stack_sampling: bool = False
    armed: bool = False          # waiting for its trigger (``core.profile_trigger``); not running yet
    trigger: str = ""            # the trigger, described (armed, or the profile it started)
    fired_by: str = ""           # what fired it, once it has


@dataclass(frozen=True)
class ProfileResult:
    """A finished profile (see :meth:`to_json` for the saved shape)."""

    engine: str
    model: str
    backend: str
    device: str
    started_at_us: int
    duration_us: int
    stopped_by: str              # "request" | "max_steps" | "time_limit"
    peak_gbs: float | None       # the memory bandwidth the kernels' GB/s is compared with
    peak_source: str             # "device" (a GPU's spec) | "measured" (this host's read rate) | ""
    kernels: list[dict[str, Any]]
    steps: list[list[float]]     # one row per step: STEP_FIELDS
    spans: list[tuple[str, int, int, int]]  # (name, lane, start µs since epoch, duration µs)
    spans_dropped: int
    stacks: dict[str, Any] | None
    config: dict[str, Any]
    #: For a profile that started itself: {"trigger": described, "fired_by": what fired it}.
    trigger: dict[str, str] | None = None

    STEP_FIELDS = ("index", "start_us", "total_us", "batch_size", "tokens", "prefill_tokens") + PHASES

    def to_json(self) -> dict[str, Any]:
        """The profile as saved and served: plain JSON types only."""
        lanes = ("steps", "phases", "kernels")
        # Process 2: the event trace's engine is process 1, so both open side by side in Perfetto.
        events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": PROFILE_PID, "tid": 0,
                                         "args": {"name": f"profile of {self.engine}"}}]
        events += [{"name": "thread_name", "ph": "M", "pid": PROFILE_PID, "tid": tid, "args": {"name": lane}}
                   for tid, lane in enumerate(lanes)]
        events += [{"name": name, "cat": lanes[lane], "ph": "X", "ts": start, "dur": dur, "pid": PROFILE_PID,
                    "tid": lane} for name, lane, start, dur in sorted(self.spans, key=lambda s: (s[1], s[2]))]
        return {
            "engine": self.engine, "model": self.model, "backend": self.backend, "device": self.device,
            "started_at_us": self.started_at_us, "duration_us": self.duration_us, "stopped_by": self.stopped_by,
            "steps": len(self.steps),
            "peak": {"bandwidth_gbs": self.peak_gbs, "source": self.peak_source},
            "kernels": self.kernels,
            "phases": list(PHASES),
            "step_rows": {"fields": list(self.STEP_FIELDS), "rows": self.steps},
            "trace": {"traceEvents": events, "displayTimeUnit": "ms",
                      "otherData": {"engine": self.engine, "spans_dropped": self.spans_dropped}},
            "stacks": self.stacks,
            "config": self.config,
            "trigger": self.trigger,
        }


@njit(nogil=True, cache=True, parallel=True, fastmath={"reassoc"})
def streams_sum(streams: np.ndarray) -> np.float32:
    """The sum of ``streams`` (``[8, n]``), each thread's share of ``i`` read as eight sequential
    streams at once: one core keeps more reads in flight over eight streams than over one, as the
    decode matmuls' blocks of weight rows do (docs/perf-log/code-comments.md#streams-sum)."""
    total = np.float32(0.0)  # float32, as the values: the loop vectorises
    for i in prange(streams.shape[1]):
        total += (streams[0, i] + streams[1, i] + streams[2, i] + streams[3, i]
                  + streams[4, i] + streams[5, i] + streams[6, i] + streams[7, i])
    return total


def measure_host_bandwidth(nbytes: int = 128 << 20, repeats: int = 5) -> float:
    """This host's memory read bandwidth in GB/s: the best of ``repeats`` reads of ``nbytes``
    (by default about what a batch-1 step of bench/cpu_anchors.py's checkpoint streams, and more
    than most last-level caches; where one reports more, a core may read it no faster than memory:
    docs/perf-log/cpu-anchors.md#2026-11-26-emerald-rapids) on numba's threads, the ones the CPU
    kernels run on, eight streams a thread (:func:`streams_sum`). A decode step streams its weights
    read-only, so this, not a copy (whose rate moved widely from run to run, with its writes and the
    C library's choice of stores), is the ceiling to compare it with."""
    streams = np.ones(nbytes // 4, np.float32).reshape(8, -1)
    streams_sum(streams)  # compiled (or loaded from the cache), pages touched
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        streams_sum(streams)
        best = min(best, time.perf_counter() - began)
    return nbytes / best / 1e9


class ProfiledBackend:
    """A backend whose kernel launches and copies are timed for a :class:`StepProfiler`;
    everything else goes to the backend it wraps.

    On a GPU each launch is bracketed by two CUDA events, read once the step's results are back
    on the host (the kernels run back to back, as unprofiled, but one at a time: no graph). On
    the CPU, and in the simulator (whose events do not time), host timers around each call,
    after synchronising on a simulated device.
    """

    def __init__(self, backend: Any, profiler: "StepProfiler", *, events: Any = None) -> None:
        self._backend = backend
        self._profiler = profiler
        self._sync: Callable[[], None] = _noop
        self._event: Callable[[], Any] | None = None  # makes a CUDA event, when launches are timed by them
        self._pending: list[tuple[tuple[str, int, int], Any, Any, int]] = []
        if backend.name == "cuda":
            from numba import cuda

            if events is not None or not getattr(backend, "simulated", True):
                self._event = events or cuda.event
            else:
                self._sync = cuda.synchronize
        self._attention_work = (0, 0)
        # The backend's ops (``model.kernels.ops``), each with its cost beside its kernel.
        for op in backend.ops:
            setattr(self, op.name, self._timed(op.cost, getattr(backend, op.name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def _timed(self, cost: Callable[[tuple[Any, ...], int, int], tuple[str, int, int]],
               launch: Callable[..., None]) -> Callable[..., None]:
        profiler, sync, event = self._profiler, self._sync, self._event
        if event is not None:
            def timed_by_events(*args: Any) -> None:
                began, ended = event(), event()
                host = time.perf_counter_ns()
                began.record()
                launch(*args)
                ended.record()
                self._pending.append((cost(args, *self._attention_work), began, ended, host))
            return timed_by_events

        def timed(*args: Any) -> None:
            sync()
            began = time.perf_counter_ns()
            launch(*args)
            sync()
            ended = time.perf_counter_ns()
            profiler.on_kernel(cost(args, *self._attention_work), began, ended)
        return timed

    def _read_events(self) -> None:
        """The step's kernels, from their events (complete once its results reached the host):
        start times follow the first launch's host clock reading by the device's own clock."""
        if not self._pending:
            return
        _, anchor_event, _, anchor_ns = self._pending[0]
        for cost, began, ended, _ in self._pending:
            start = anchor_ns + int(anchor_event.elapsed_time(began) * 1e6)
            self._profiler.on_kernel(cost, start, start + int(began.elapsed_time(ended) * 1e6))
        self._pending.clear()

    def upload_step(self, host: Any) -> Any:
        # The host copy of the batch tells attention what it reads: each sequence's keys and
        # values once (bytes), each new token against every position up to its own (flops).
        positions, seqs = np.asarray(host.positions, np.int64), np.asarray(host.token_seq, np.int64)
        context = np.zeros(int(seqs.max()) + 1 if seqs.size else 0, np.int64)
        np.maximum.at(context, seqs, positions + 1)
        self._attention_work = (int(context.sum()), int(positions.sum()) + positions.size)
        began = time.perf_counter_ns()
        step = self._backend.upload_step(host)
        self._sync()
        self._profiler.on_transfer(time.perf_counter_ns() - began)
        return step

    def to_host(self, array: Any) -> np.ndarray:
        if self._pending:  # the kernels' own time is their events': wait for them outside the copy
            self._pending[-1][2].synchronize()
            self._read_events()
        began = time.perf_counter_ns()
        host = self._backend.to_host(array)
        self._profiler.on_transfer(time.perf_counter_ns() - began)
        return host

    def run_step(self, buffers: tuple[Any, ...], num_tokens: int, launches: Callable[[], None]) -> None:
        # Launched one by one, never recorded into (or replayed from) a CUDA graph: a graph
        # would capture the timers, and its kernels cannot be timed apart.
        launches()


def _noop() -> None:
    return None


@dataclass
class _KernelStats:
    durations: list[int] = field(default_factory=list)  # ns
    bytes: int = 0
    flops: int = 0


class StepProfiler:
    """One profile: the engine calls :meth:`begin_step`, :meth:`lap` at each seam, and
    :meth:`end_step`; the :class:`ProfiledBackend` reports each launch and copy."""

    def __init__(self, *, max_steps: int | None = None, max_seconds: float = 60.0,
                 stack_sampling: bool = False, stack_interval_s: float = 0.005) -> None:
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        if not max_seconds > 0:
            raise ValueError(f"max_seconds must be positive, got {max_seconds}")
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.started_ns = time.perf_counter_ns()
        self.started_at_us = (self.started_ns + epoch_anchor_ns()) // 1000
        self.steps: list[list[float]] = []
        self.kernels: dict[str, _KernelStats] = {}
        self.spans: list[tuple[str, int, int, int]] = []
        self.spans_dropped = 0
        self.stopped_by: str | None = None
        self.ended_us = 0
        self._stacks: dict[str, Any] | None = None
        self.stack_sampling = stack_sampling
        self._sampler = StackSampler(stack_interval_s) if stack_sampling else None
        self._phase_ns = dict.fromkeys(PHASES, 0)
        self._step_began = self._lap_at = 0
        self._forward_kernel_ns = self._forward_transfer_ns = 0

    # -- the engine's side

    def begin_step(self) -> None:
        """A step starts (on the engine's thread: the one the stack sampler watches)."""
        if self._sampler is not None and not self._sampler.running:
            self._sampler.start(threading.get_ident())
        self._phase_ns = dict.fromkeys(PHASES, 0)
        self._forward_kernel_ns = self._forward_transfer_ns = 0
        self._step_began = self._lap_at = time.perf_counter_ns()

    def lap(self, phase: str) -> None:
        """The time since the previous seam was spent on ``phase``. The forward pass's lap
        (``"forward"``) is split into its kernels, its copies and the rest."""
        now = time.perf_counter_ns()
        spent = now - self._lap_at
        self._lap_at = now
        if phase == "forward":
            kernels, transfers = self._forward_kernel_ns, self._forward_transfer_ns
            self._phase_ns["kernels"] += kernels
            self._phase_ns["transfers"] += transfers
            self._phase_ns["forward other"] += max(0, spent - kernels - transfers)
        else:
            self._phase_ns[phase] += spent

    def end_step(self, batch_size: int, tokens: int, prefill_tokens: int) -> bool:
        """The step ended (its last seam was lapped); True once the profile is over (``max_steps``
        or the time limit), and then :meth:`result` is ready."""
        now = time.perf_counter_ns()
        start_us = (self._step_began + epoch_anchor_ns()) // 1000
        total = now - self._step_began
        phases = [self._phase_ns[p] / 1000 for p in PHASES]
        self.steps.append([len(self.steps), start_us, total / 1000, batch_size, tokens, prefill_tokens, *phases])
        self._span("decode step" if not prefill_tokens else "prefill step", 0, self._step_began, now)
        at = self._step_began
        for name, spent in zip(PHASES, phases, strict=True):  # the phases laid end to end, in order, on their lane
            if spent:
                self._span(name, 1, at, at + int(spent * 1000))
                at += int(spent * 1000)
        if self.max_steps is not None and len(self.steps) >= self.max_steps:
            self.finish("max_steps")
        elif now - self.started_ns >= self.max_seconds * 1e9:
            self.finish("time_limit")
        return self.stopped_by is not None

    def finish(self, stopped_by: str) -> None:
        """End the profile (``"request"``, ``"max_steps"``, ``"time_limit"``); the stack sampler stops."""
        if self.stopped_by is None:
            self.stopped_by = stopped_by
            self.ended_us = (time.perf_counter_ns() + epoch_anchor_ns()) // 1000
            self._stacks = self._sampler.stop() if self._sampler is not None else None

    # -- the backend's side

    def on_kernel(self, cost: tuple[str, int, int], began: int, ended: int) -> None:
        name, nbytes, flops = cost
        stats = self.kernels.get(name)
        if stats is None:
            stats = self.kernels[name] = _KernelStats()
        stats.durations.append(ended - began)
        stats.bytes += nbytes
        stats.flops += flops
        self._forward_kernel_ns += ended - began
        self._span(name, 2, began, ended)

    def on_transfer(self, spent_ns: int) -> None:
        self._forward_transfer_ns += spent_ns

    def _span(self, name: str, lane: int, began: int, ended: int) -> None:
        if len(self.spans) >= MAX_SPANS:
            self.spans_dropped += 1
            return
        anchor = epoch_anchor_ns()
        self.spans.append((name, lane, (began + anchor) // 1000, max(0, (ended - began) // 1000)))

    # -- the result

    def status(self) -> ProfileStatus:
        return ProfileStatus(running=self.stopped_by is None, steps=len(self.steps), max_steps=self.max_steps,
                             started_at_us=self.started_at_us, finished=self.stopped_by is not None,
                             stack_sampling=self.stack_sampling)

    def result(self, *, engine: str, model: str, backend: str, device: str, peak_gbs: float | None,
               peak_source: str, config: dict[str, Any]) -> ProfileResult:
        """Stop (if still running) and summarise."""
        self.finish("request")
        step_us = sum(row[2] for row in self.steps) or 1.0
        kernels: list[dict[str, Any]] = []
        for name, stats in self.kernels.items():
            durations = np.array(stats.durations, np.float64) / 1000  # µs
            total = float(durations.sum())
            seconds = total / 1e6 or 1e-12
            gbs = stats.bytes / seconds / 1e9
            kernels.append({
                "name": name, "calls": int(durations.size), "total_us": total,
                "mean_us": total / durations.size, "p50_us": float(np.percentile(durations, 50)),
                "p99_us": float(np.percentile(durations, 99)), "bytes": stats.bytes, "flops": stats.flops,
                "gbs": gbs, "gflops": stats.flops / seconds / 1e9, "share_of_steps": total / step_us,
                "peak_fraction": gbs / peak_gbs if peak_gbs else None,
            })
        kernels.sort(key=lambda k: -k["total_us"])
        return ProfileResult(engine=engine, model=model, backend=backend, device=device,
                             started_at_us=self.started_at_us, duration_us=self.ended_us - self.started_at_us,
                             stopped_by=self.stopped_by or "request", peak_gbs=peak_gbs, peak_source=peak_source,
                             kernels=kernels, steps=self.steps, spans=self.spans, spans_dropped=self.spans_dropped,
                             stacks=self._stacks, config=config)
