"""``AsyncEngine``: the asyncio front end of one engine, whose loop runs in a thread or a process.

The front end moves commands in and outputs out; it never touches model state. The
:class:`~engines.runtime.frontend.engine_core.EngineCore` behind it runs either

* on a thread of this process (``process=False``): cheapest to start, and the engine
  object stays reachable (``AsyncEngine.engine``) for tests and offline use; or
* in a child process (``process=True``, what ``manage.py serve`` uses): the engine's
  Python work then never waits on the server's GIL, nor the server on the engine's.

Both carry the same typed messages (``messages``) over a transport (``transports``), so
everything above this class (views, history, metrics) works the same with either.
"""
from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

from engines.runtime.core.engine import Engine, EngineConfig
from engines.runtime.core.kv_sizing import KVCacheSize
from engines.runtime.core.disagg.kv_http import KVListenSpec
from engines.runtime.core.disagg.transfer import KVBlock, KVReceipt
from engines.runtime.core.request import EngineRequestError, GenerationRequest, RequestOutput, \
    validate_request
from engines.runtime.frontend.engine_core import EngineCore, create_engine, engine_info, shorten_gil_switch
from engines.runtime.core.live_view import DEFAULT_KV_ENTRIES, DEFAULT_LIVE_LIMIT, KVCacheDump, LiveRequests
from engines.runtime.core.profile_trigger import ProfileTrigger
from engines.runtime.frontend.messages import (
    AbortCall,
    AbortRequest,
    Aborted,
    AddRequest,
    Call,
    CoreCommand,
    CoreMessage,
    CudaProfilerCall,
    Dead,
    DumpTraceCall,
    EngineCall,
    EngineInfo,
    DashboardReading,
    EngineSpec,
    KVCacheDumpCall,
    LiveRequestsCall,
    MetricsCall,
    PrepareReceiveCall,
    ProfileCall,
    ProfileStatusCall,
    DashboardCall,
    DumpWorkloadCall,
    ReceiveKVCall,
    Rejected,
    ReleaseReceiveCall,
    Reply,
    ResetCall,
    ResetPrefixCacheCall,
    ServerTraceEvent,
    ServerTraceEvents,
    StepOutputs,
    TraceSinceCall,
)
from engines.runtime.frontend.output_streams import OutputStreams
from engines.runtime.frontend.progress_board import ProgressBoard, ProgressCounts
from engines.runtime.frontend.supervision import EngineState, EngineStatus, RestartPolicy, Supervisor
from engines.runtime.frontend.transports import ProcessTransport, ThreadTransport
from engines.runtime.model.checkpoint import Checkpoint
from engines.runtime.telemetry import trace_recorder as trace_clock
from engines.runtime.telemetry.flight_recorder import Workload
from engines.runtime.telemetry.latency_distribution import HistogramSnapshot
from engines.runtime.telemetry.trace_recorder import TraceDelta
from engines.runtime.telemetry.profiler import ProfileResult, ProfileStatus

logger = logging.getLogger("engines.runtime")

__all__ = ["AsyncEngine", "EngineDeadError"]

# How long a request waits for the abort of an abandoned request with the same id.
ABORT_WAIT_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an internal error, or its process died); the server reports 503."""


class AsyncEngine:
    """Serves asyncio callers from one engine; ``generate``, ``abort``, ``reset`` and the
    metrics and trace calls are safe from any event loop (and the ``*_blocking`` ones from
    any thread).

    Args:
        checkpoint: the model. With ``process=True`` its weights are not needed here
            (``load_checkpoint(path, load_weights=False)``): the child loads them.
        name: the served model name.
        config: engine sizing.
        backend, dtype: where and how the model computes (``LlamaModel.from_checkpoint``).
        enable_tracing: record the event trace.
        process: run the engine loop in a child process instead of a thread.
        restart: when the engine dies, restart it per this policy (``RestartPolicy()``: after
            0.5 s, 1 s, 2 s, ... at most 30 s; left dead after 5 deaths in 10 minutes);
            ``RestartPolicy(enabled=False)`` leaves a dead engine dead.
        kv_listen: run a K/V listener for this engine (disaggregated serving across servers).
        keep_quantized: an engine process loads a GGUF's matrices quantized (a
            thread engine uses ``checkpoint`` as loaded: load it with ``keep_quantized`` too).
    """

    def __init__(self, checkpoint: Checkpoint, name: str, config: EngineConfig | None = None,
                 backend: str = "auto", dtype: str = "float32", enable_tracing: bool = False,
                 *, process: bool = False, restart: RestartPolicy | None = None,
                 kv_listen: KVListenSpec | None = None, keep_quantized: bool = False) -> None:
        self.name = name
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.config = config or EngineConfig()
        self.process = process
        self.error: BaseException | None = None
        self._streams = OutputStreams()
        # Ids of abandoned streams whose abort the engine has not confirmed yet: a new request with
        # the same id waits, or the old request's last output would land in its stream.
        self._aborting: set[str] = set()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._server_events: list[ServerTraceEvent] = []
        self._tracing_requested = enable_tracing
        #: How far the engine loop got, read by the server's watchdog without asking the engine.
        self.board = ProgressBoard.create_file(name) if process else ProgressBoard()
        # Its file outlives a shutdown (a restart maps it again) and goes with the engine, or at exit.
        weakref.finalize(self, self.board.remove)
        self._spec = EngineSpec(checkpoint.path, name, self.config, backend, dtype, enable_tracing,
                                trace_clock.epoch_anchor_ns(), kv_listen, keep_quantized=keep_quantized,
                                progress_path=self.board.path)
        self._supervisor = Supervisor(name, restart or RestartPolicy(), self.restart)
        self._restart_lock = threading.Lock()
        self._generation = 0  # which transport's messages count; a stale one's death is old news
        self._info: EngineInfo | None = None
        #: The engine itself, reachable only when it runs on a thread of this process.
        self.engine: Engine | None = None
        self._transport: ThreadTransport | ProcessTransport = self._new_transport()

    # ------------------------------------------------------------- life cycle

    def _new_transport(self) -> ThreadTransport | ProcessTransport:
        """A fresh transport (and, on a thread, a fresh engine), its messages tagged with a new
        generation so that a replaced transport's last words are ignored."""
        self._generation += 1
        generation = self._generation

        def on_message(message: CoreMessage) -> None:
            self._on_message(message, generation)

        if self.process:
            return ProcessTransport(self._spec, on_message)
        spec = self._spec
        self.engine = create_engine(self.checkpoint, spec.name, spec.config, spec.backend, spec.dtype,
                                    spec.enable_tracing)
        self._info = engine_info(self.engine)
        return ThreadTransport(EngineCore(self.engine, self.name, self.board), on_message, spec.kv_listen)

    def start(self) -> None:
        """Warm the kernels up and start the engine loop (idempotent). A process engine has
        loaded its model when this returns; a model that fails to load raises here.

        Shortens this process's GIL switch interval (``shorten_gil_switch``): the thread that
        carries the engine's outputs to the event loop, or the engine thread itself, shares it
        with a busy loop."""
        if self._transport.started:
            return
        shorten_gil_switch()
        self._supervisor.stopping.clear()
        self._info = self._transport.start(self._info)
        self._supervisor.set(EngineState.RUNNING)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort live requests and stop the engine loop (and its process); no restart follows."""
        self._supervisor.stopping.set()
        with self._restart_lock:  # a restart under way finishes first, then is stopped here
            self._supervisor.set(EngineState.STOPPED)
            if not self._transport.started:
                return
            with self._send_lock:
                self._transport.stop(timeout)
        # A graceful stop answered everything; a stuck engine that had to be killed did not.
        self._fail_pending(EngineDeadError(f"engine {self.name!r} was shut down"))

    def restart(self) -> None:
        """Replace the engine (its process) with a fresh one now, whatever state it is in.

        Blocks while the model loads; raises what a failed start raises. The requests and calls
        in flight on the old engine fail with :class:`EngineDeadError`.
        """
        with self._restart_lock:
            if self._supervisor.stopping.is_set():
                raise EngineDeadError(f"engine {self.name!r} was shut down")
            old = self._transport
            with self._send_lock:
                if old.started:
                    old.stop(5.0)
                self._transport = self._new_transport()
            self._fail_pending(EngineDeadError(f"engine {self.name!r} was restarted"))
            self._info = self._transport.start(self._info)
            self._aborting.clear()
            self.error = None
            self._supervisor.restarted()

    async def arestart(self) -> None:
        """:meth:`restart` off the event loop."""
        await asyncio.to_thread(self.restart)

    @property
    def status(self) -> EngineStatus:
        """State, the reason it is not running, and the restart count (``Supervisor``)."""
        return self._supervisor.status

    @property
    def restarts(self) -> int:
        """How many times the engine was restarted after dying (or by hand, once dead)."""
        return self._supervisor.restarts

    @property
    def is_alive(self) -> bool:
        return self._transport.alive and self.error is None

    @property
    def pid(self) -> int | None:
        """The engine process's pid; None for an engine thread or one not started."""
        transport = self._transport
        process = transport.process if isinstance(transport, ProcessTransport) else None
        return process.pid if process is not None else None

    def stream_ids(self) -> list[str]:
        """The ids of the requests whose outputs this server waits on (from any thread)."""
        return self._streams.ids()

    def progress(self) -> ProgressCounts:
        """How far the engine loop got (its board), from any thread, whatever state the engine
        is in; ``work`` counts the streams this server waits on too, which a stopped engine
        never took in."""
        counts = self.board.read()
        waiting = len(self._streams)
        return counts if waiting <= counts.work else dataclasses.replace(counts, work=waiting)

    @property
    def backend_name(self) -> str:
        """``cpu`` or ``cuda`` (an ``auto`` engine process knows it once started)."""
        return self._info.backend_name if self._info else "pending"

    @property
    def dtype(self) -> str:
        return self._info.dtype if self._info else "pending"

    @property
    def max_seq_len(self) -> int:
        """The most tokens one sequence may hold, prompt and output (the KV pool or the model's
        positions, the smaller; vLLM's ``max_model_len``); the model's positions until started."""
        return self._info.max_seq_len if self._info else self.checkpoint.config.max_position_embeddings

    @property
    def tracing_enabled(self) -> bool:
        """Whether the engine records an event trace (``dump_trace`` answers)."""
        return self._tracing_requested

    @property
    def num_streams(self) -> int:
        """How many ``generate`` calls are in flight."""
        return len(self._streams)

    def is_streaming(self, request_id: str) -> bool:
        """Whether a ``generate`` with this request id is in flight."""
        return request_id in self._streams

    # ---------------------------------------------------------------- requests

    def validate(self, request: GenerationRequest) -> None:
        """Raise :class:`EngineRequestError` for a request this engine cannot serve (cheap, here)."""
        if self._info is not None:
            validate_request(request, self._info.vocab_size, self._info.max_seq_len)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Run one request; yields outputs as tokens arrive, the last one carrying usage.

        Raises :class:`EngineRequestError` before the first output for a bad request,
        :class:`EngineDeadError` if the engine loop has died. Cancelling the
        iteration (a client that went away) aborts the request and frees its pages.
        """
        self._check_alive()
        self.validate(request)
        if request.arrival_time is None:  # a caller without a server's stamp: it arrives now
            request.arrival_time = time.perf_counter()
        loop = asyncio.get_running_loop()
        rid = request.request_id
        deadline = loop.time() + ABORT_WAIT_S
        while rid in self._aborting and self.is_alive and loop.time() < deadline:
            await asyncio.sleep(0.002)
        self._check_alive()
        if rid in self._aborting:
            raise EngineRequestError(f"request id {rid!r} is still being aborted")
        if rid in self._streams:
            raise EngineRequestError(f"request id {rid!r} is already running")
        outputs = self._streams.open(rid)
        try:
            # Again, now that a dying engine would see this stream and fail it.
            self._check_alive()
        except EngineDeadError:
            self._streams.release(rid, outputs)
            raise
        finished = False
        try:
            # A rejection arrives on the stream, before any output: the same path as the engine
            # dying, so the caller can never wait on an add that will not happen.
            self._send(AddRequest(request))
            while True:
                # A consumer that fell behind (a busy event loop, a slow client) gets what is
                # waiting as one merged output: one SSE chunk instead of one per token.
                item, error = await self._streams.next_batch(outputs)
                if item is not None:
                    if item.finished:
                        # The id is free once the request is over, not only once the
                        # consumer closes this generator (it may hold it for a while).
                        finished = True
                        self._streams.release(rid, outputs)
                    yield item
                    if finished:
                        return
                if error is not None:
                    finished = True
                    raise error
        finally:
            self._streams.release(rid, outputs)
            if not finished:
                self._aborting.add(rid)
                self._abort_quietly(rid)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish reason ``abort``. A no-op on a dead engine."""
        self._abort_quietly(request_id)

    def _abort_quietly(self, request_id: str) -> None:
        if self.is_alive:
            try:
                self._send(AbortRequest(request_id))
            except EngineDeadError:  # died meanwhile: nothing is left to abort
                pass

    def record_server_event(self, request_id: str, event: str, args: dict | None = None,
                            at_ns: int | None = None) -> None:
        """Record a server-side trace event (``receive request``, tokenization) on the request's
        lane, timestamped now or at ``at_ns`` (``perf_counter_ns``); no-op when tracing is off.
        Sent along with the next command."""
        if self._tracing_requested and self.error is None:
            at_ns = time.perf_counter_ns() if at_ns is None else at_ns
            with self._send_lock:
                self._server_events.append(ServerTraceEvent((request_id,), event, args, at_ns))

    # ------------------------------------------------------------------ calls

    async def reset(self, clear_trace: bool = False) -> None:
        """Reset the engine and return once the reset has completed (MLC's is fire-and-forget).

        An engine that died (and is not being restarted already) is restarted instead: a fresh
        engine is a reset one.
        """
        if self.error is not None and self._supervisor.state is not EngineState.RESTARTING:
            try:
                await self.arestart()
            except EngineDeadError:
                raise
            except Exception as e:  # noqa: BLE001 - the model failed to load again: still a dead engine
                raise EngineDeadError(f"engine {self.name!r} could not be restarted: {e}") from e
            return
        await self._acall(ResetCall(clear_trace))

    async def reset_prefix_cache(self) -> dict[str, int]:
        """Empty the prefix cache but its pinned pages, between two steps; requests run on
        (``Engine.reset_prefix_cache``: the pages dropped and kept)."""
        return await self._acall(ResetPrefixCacheCall())

    async def metrics(self) -> dict[str, Any]:
        """MLC's engine metrics plus our gauges and latency distributions (JSON-ready), as of now."""
        return await self._acall(MetricsCall())

    async def dashboard_reading(self, with_text: bool = False) -> DashboardReading:
        """The metrics, the requests in the engine now and the last that ended, in one read
        (``DashboardReading``); answered even mid-step. ``with_text``: the live rows' text too."""
        return await self._acall(DashboardCall(with_text))

    async def live_requests(self, limit: int = DEFAULT_LIVE_LIMIT, with_text: bool = False) -> LiveRequests:
        """The requests in the engine now, oldest first, at most ``limit`` (``Engine.live_requests``);
        answered even mid-step. ``with_text``: with their text (``serve --capture-text``)."""
        return await self._acall(LiveRequestsCall(limit, with_text))

    async def dump_workload(self, with_text: bool = False) -> "Workload":
        """The last requests that ended, as a replayable workload (``FlightRecorder``); answered even
        mid-step. ``with_text``: with their token ids and outputs (``serve --capture-text``)."""
        return await self._acall(DumpWorkloadCall(self.name, with_text))

    async def dump_kv_cache(self, max_entries: int = DEFAULT_KV_ENTRIES, with_text: bool = False) -> KVCacheDump:
        """The KV cache opened (``Engine.dump_kv_cache``); answered even mid-step."""
        return await self._acall(KVCacheDumpCall(max_entries, with_text))

    async def abort_request(self, request_id: str) -> bool:
        """Abort the request ``request_id`` as a client's disconnect does (its stream ends with
        finish reason ``abort``); answers once it is done, whether the engine had it (False: unknown
        or ended already)."""
        return await self._acall(AbortCall(request_id))

    async def metrics_with_histograms(self) -> tuple[dict[str, Any], dict[str, HistogramSnapshot]]:
        """``metrics()`` and the latency histograms, read one after the other (possibly mid-step)."""
        return await self._acall(MetricsCall(with_histograms=True))

    async def dump_trace(self, clear: bool = False, skip_empty: bool = False) -> bytes | None:
        """The Chrome trace as JSON bytes (``TraceRecorder.dump_json``); ``clear`` takes the window
        and empties the recorder in one step; ``skip_empty`` answers None when nothing is recorded.
        Raises ValueError when tracing is off."""
        return await self._acall(DumpTraceCall(clear, skip_empty))

    async def trace_since(self, cursor: int = 0) -> TraceDelta:
        """The trace calls recorded since ``cursor`` (``TraceRecorder.read_since``): a live
        viewer's read. Raises ValueError when tracing is off or the cursor is not this engine's."""
        return await self._acall(TraceSinceCall(cursor))

    async def profile_start(self, max_steps: int | None = None, max_seconds: float = 60.0,
                            stack_sampling: bool = False, trigger: ProfileTrigger | None = None) -> ProfileStatus:
        """Start the built-in profiler (``Engine.start_profile``) between two steps, or arm it to
        start itself when ``trigger`` fires; a ``ProfilerStateError`` when one runs or is armed already."""
        return await self._acall(ProfileCall("start", max_steps, max_seconds, stack_sampling, trigger=trigger))

    async def profile_stop(self) -> ProfileResult:
        """Stop the profile (or take the one that stopped by itself) and return its result; a
        ``ProfilerStateError`` when there is none."""
        return await self._acall(ProfileCall("stop", engine_name=self.name))

    async def profile_status(self) -> ProfileStatus:
        """Where the profiler stands (answered at once, even mid-step)."""
        return await self._acall(ProfileStatusCall())

    async def cuda_profiler(self, start: bool) -> None:
        """``cudaProfilerStart`` (or ``Stop``) in the engine's process, between two steps."""
        await self._acall(CudaProfilerCall(start))

    @property
    def kv_cache(self) -> KVCacheSize | None:
        """The engine's KV pool as allocated and the rule that sized it (None until it has started)."""
        return self._info.kv_cache if self._info else None

    @property
    def source_format(self) -> str:
        """What the weights were read from ("safetensors", "GGUF Q4_1 x210, ..."); the checkpoint's own
        until the engine has started."""
        return self._info.source_format if self._info and self._info.source_format else self.checkpoint.source_format

    @property
    def weights_format(self) -> str:
        """What the weights are held as: the dtype, or the ggml types kept quantized
        ("Q4_1 x210, Q8_0 x1"); "pending" until the engine has started."""
        return self._info.weights_format if self._info and self._info.weights_format else "pending"

    @property
    def kv_port(self) -> int | None:
        """The port of this engine's K/V listener (None: it has none, or has not started)."""
        return self._info.kv_port if self._info else None

    async def prepare_receive(self, request_id: str, prompt: list[int], end: int,
                              timeout_s: float = 60.0) -> KVReceipt:
        """Reserve pages for K/V another engine will send (``Engine.prepare_receive``)."""
        return await self._acall(PrepareReceiveCall(request_id, tuple(prompt), end, timeout_s))

    async def receive_kv(self, block: KVBlock) -> None:
        """Store K/V another engine sent into its reservation (``Engine.receive_kv``)."""
        await self._acall(ReceiveKVCall(block))

    async def release_receive(self, request_id: str, ticket: str | None = None) -> bool:
        """Give up a reservation whose K/V will not come; whether there was one."""
        return await self._acall(ReleaseReceiveCall(request_id, ticket))

    def metrics_blocking(self, timeout: float | None = None) -> dict[str, Any]:
        """``metrics()`` for code without an event loop (blocks until the engine answers)."""
        return self._call(MetricsCall()).result(timeout)

    def dashboard_reading_blocking(self, timeout: float | None = None, with_text: bool = False) -> DashboardReading:
        """``dashboard_reading()`` for code without an event loop (the watchdog's evidence)."""
        return self._call(DashboardCall(with_text)).result(timeout)

    def dump_trace_blocking(self, clear: bool = False, skip_empty: bool = False,
                            timeout: float | None = None) -> bytes | None:
        """``dump_trace()`` for code without an event loop."""
        return self._call(DumpTraceCall(clear, skip_empty)).result(timeout)

    async def _acall(self, call: EngineCall) -> Any:
        return await asyncio.wrap_future(self._call(call))

    def _call(self, call: EngineCall) -> concurrent.futures.Future:
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            self._send(Call(call_id, call))
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        if self.error is not None:  # died in between: the death may have missed this call
            self._fail_calls()
        elif not self._transport.started:  # shut down in between: nobody will answer
            self._fail_pending(EngineDeadError(f"engine {self.name!r} was shut down"))
        return future

    def _check_alive(self) -> None:
        if self.error is not None:
            if self._supervisor.state is EngineState.RESTARTING:
                raise EngineDeadError(f"engine {self.name!r} is restarting after it stopped ({self.error}); "
                                      "retry in a few seconds")
            raise EngineDeadError(f"engine {self.name!r} stopped on an internal error: {self.error}")
        if not self._transport.started:
            raise EngineDeadError(f"engine {self.name!r} is not running")

    def _send(self, command: CoreCommand) -> None:
        with self._send_lock:
            try:
                if self._server_events:
                    events, self._server_events = self._server_events, []
                    self._transport.send(ServerTraceEvents(tuple(events)))
                self._transport.send(command)
            except (OSError, EOFError, ValueError) as e:  # the process is gone; the reader reports it
                raise EngineDeadError(f"engine {self.name!r} is not running: {e}") from None

    # --------------------------------------------------- messages from the core

    def _on_message(self, message: CoreMessage, generation: int) -> None:
        """Handle one message from the core (on the engine thread, or the socket's reader thread)."""
        if generation != self._generation:
            return  # from a transport already replaced: its streams and calls were failed then
        match message:
            case StepOutputs(outputs):
                self._streams.deliver(outputs)
            case Reply(call_id, ok, value):
                future = self._calls.pop(call_id, None)
                if future is not None and not future.done():
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(value)
            case Aborted(request_id):
                self._aborting.discard(request_id)
            case Rejected(request_id, error):
                self._streams.fail(request_id, error)
            case Dead(reason):
                self._die(reason)
            case _:
                logger.error("engine %s: ignored a message it does not know: %r", self.name, message)

    def _die(self, reason: str) -> None:
        """The core is gone: fail every stream and call, now and later (``error`` is set first),
        once the supervisor has settled whether a restart comes."""
        if self.error is None:
            self.error = EngineDeadError(reason)
        self._supervisor.on_death(reason)
        self._fail_pending(EngineDeadError(f"engine {self.name!r} stopped on an internal error: {reason}"))

    def _fail_pending(self, err: EngineDeadError) -> None:
        """End every open stream and pending call with ``err``."""
        self._streams.fail_all(err)
        self._fail_calls(err)

    def _fail_calls(self, err: EngineDeadError | None = None) -> None:
        err = err or EngineDeadError(f"engine {self.name!r} stopped on an internal error: {self.error}")
        for call_id in list(self._calls):
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(err)
