"""The typed messages between ``AsyncEngine`` and the engine core, one definition each.

Every message is a frozen dataclass of picklable values; both sides dispatch on its type,
never on a string. In an engine process they travel pickled over a socket pair; on a thread,
through a queue. ``docs/interfaces.md`` lists them with their order guarantees.

Front end to core (:data:`CoreCommand`):

* :class:`AddRequest`: queue a request. Answered only on failure, by :class:`Rejected`.
* :class:`AbortRequest`: abort one; answered by its last outputs, then :class:`Aborted`.
* :class:`ServerTraceEvents`: server-side trace events (``receive request``, tokenization),
  timestamped in the server; sent along before the next command.
* :class:`Call`: one :class:`EngineCall` (an operation, its handler beside it), answered by a
  :class:`Reply`.
* :class:`LocalCall`: the same from a thread of the engine's own process (its K/V listener),
  answered through a future; never pickled.
* :class:`Shutdown`: abort everything and stop.

Core to front end (:data:`CoreMessage`):

* :class:`Ready` / :class:`Failed`: an engine process's start-up.
* :class:`StepOutputs`: one step's outputs (or an abort's, or a reset's), in one message.
* :class:`Aborted`, :class:`Rejected`, :class:`Reply`.
* :class:`Dead`: the loop stopped on an internal error; nothing more will come.

The first message to an engine process is its :class:`EngineSpec`.
"""
from __future__ import annotations

import concurrent.futures
import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Union

from engines.runtime.core.engine import EngineConfig
from engines.runtime.core.kv_sizing import KVCacheSize
from engines.runtime.core.profile_trigger import ProfileTrigger
from engines.runtime.core.live_view import DEFAULT_KV_ENTRIES, DEFAULT_LIVE_LIMIT, KVCacheDump, LiveRequests
from engines.runtime.core.disagg.kv_http import KVListenSpec
from engines.runtime.core.disagg.transfer import KVBlock
from engines.runtime.core.request import GenerationRequest, RequestOutput

if TYPE_CHECKING:
    from engines.runtime.core.engine import Engine
    from engines.runtime.telemetry.flight_recorder import Workload

__all__ = [
    "AbortCall", "AbortRequest", "AddRequest", "Aborted", "KVCacheDumpCall", "LiveRequestsCall", "Call",
    "CoreCommand", "CoreMessage", "CudaProfilerCall", "Dead", "DumpWorkloadCall",
    "DumpTraceCall", "EngineCall", "EngineInfo", "DashboardReading", "EngineSpec", "Failed", "LocalCall",
    "MessageConnection", "MetricsCall", "PrepareReceiveCall", "ProfileCall", "ProfileStatusCall", "DashboardCall",
    "Ready", "ReceiveKVCall",
    "Rejected", "ReleaseReceiveCall", "Reply", "ResetCall", "ResetPrefixCacheCall", "Send", "ServerTraceEvent",
    "ServerTraceEvents", "Shutdown", "StepOutputs", "TraceSinceCall",
]


@dataclass(frozen=True)
class EngineInfo:
    """What a front end needs to know of its engine, fixed once the model is loaded."""

    backend_name: str
    dtype: str
    vocab_size: int
    max_seq_len: int
    tracing: bool
    #: K and V bytes one token takes in every layer (bounds what a KV transfer may announce).
    kv_bytes_per_token: int = 0
    #: The port of the engine's K/V listener (``kv_http``); None when it has none.
    kv_port: int | None = None
    #: The KV pool as allocated, and the rule that sized it.
    kv_cache: KVCacheSize | None = None
    #: What the weights were read from ("safetensors", "GGUF Q4_1 x210, ...").
    source_format: str = ""
    #: What they are held as: the dtype, or the ggml types kept quantized ("Q4_1 x210, Q8_0 x1").
    weights_format: str = ""

    @property
    def max_kv_transfer_bytes(self) -> int:
        """The most K/V bytes a block for this engine can hold (its whole context)."""
        return self.kv_bytes_per_token * self.max_seq_len


@dataclass(frozen=True)
class EngineSpec:
    """Everything a child process needs to build the engine its parent asked for."""

    checkpoint_path: Path
    name: str
    config: EngineConfig
    backend: str = "auto"
    dtype: str = "float32"
    enable_tracing: bool = False
    epoch_anchor_ns: int = 0
    #: Listen for K/V other servers send (disaggregated serving); None: no listener.
    kv_listen: KVListenSpec | None = None
    #: Keep a GGUF's matrices quantized (``load_checkpoint(keep_quantized=...)``).
    keep_quantized: bool = False
    #: The file of the engine's ``ProgressBoard`` (the parent made it); None: the child keeps none.
    progress_path: str | None = None


# ----------------------------------------------------------------- calls (answered by Reply)
#
# One class per engine operation, its handler (``run``) beside it: ``EngineCore`` runs
# ``call.run(engine, send)`` on the engine thread, or at once on the receiving thread when the
# class says ``immediate`` (thread-safe reads a scrape or a live viewer must get mid-step).


@dataclass(frozen=True)
class EngineCall:
    """An operation on the engine, answered by a :class:`Reply` (or a :class:`LocalCall`'s future)."""

    #: Answered at once by the thread that receives it, even in the middle of a step.
    immediate: ClassVar[bool] = False

    def run(self, engine: "Engine", send: "Send") -> Any:
        """Carry the call out on ``engine`` and return the reply's value; outputs it causes go
        through ``send`` first, so they reach their streams before the caller hears back."""
        raise NotImplementedError  # every call class defines its own; a base instance is never sent


@dataclass(frozen=True)
class ResetCall(EngineCall):
    """Abort every request, free the KV cache and prefix cache, zero the metrics; replies None."""

    clear_trace: bool = False

    def run(self, engine: "Engine", send: "Send") -> None:
        outputs = engine.reset(self.clear_trace)
        if outputs:
            send(StepOutputs(outputs))


@dataclass(frozen=True)
class ResetPrefixCacheCall(EngineCall):
    """Empty the prefix cache but its pinned pages (``Engine.reset_prefix_cache``); replies its counts."""

    def run(self, engine: "Engine", send: "Send") -> dict[str, int]:
        return engine.reset_prefix_cache()


@dataclass(frozen=True)
class MetricsCall(EngineCall):
    """The engine metrics (``EngineMetrics.as_dict()``), or with ``with_histograms`` the pair
    ``(as_dict(), histograms())``."""

    immediate: ClassVar[bool] = True
    with_histograms: bool = False

    def run(self, engine: "Engine", send: "Send") -> Any:
        metrics = engine.metrics.as_dict()
        return (metrics, engine.metrics.histograms()) if self.with_histograms else metrics


@dataclass(frozen=True)
class DashboardReading:
    """One read of what the dashboard shows of an engine: its ``metrics``
    (``EngineMetrics.as_dict()``), the requests in it now (``live``, oldest first, bounded), the
    last that ended (``ended``, newest first, JSON-ready dicts) and its KV cache (``kv``)."""

    metrics: dict[str, Any]
    live: LiveRequests
    ended: list[dict[str, Any]]
    kv: KVCacheDump


@dataclass(frozen=True)
class DashboardCall(EngineCall):
    """A :class:`DashboardReading`: a dashboard sample in one round trip."""

    immediate: ClassVar[bool] = True
    #: The live rows' text too (``serve --capture-text``).
    with_text: bool = False

    def run(self, engine: "Engine", send: "Send") -> DashboardReading:
        return DashboardReading(engine.metrics.as_dict(), engine.live_requests(with_text=self.with_text),
                                engine.metrics.recent_requests(), engine.dump_kv_cache(with_text=self.with_text))


@dataclass(frozen=True)
class LiveRequestsCall(EngineCall):
    """The requests in the engine now (``Engine.live_requests``), a :class:`LiveRequests` of at
    most ``limit``; answered at once, even mid-step."""

    immediate: ClassVar[bool] = True
    limit: int = DEFAULT_LIVE_LIMIT
    with_text: bool = False

    def run(self, engine: "Engine", send: "Send") -> LiveRequests:
        return engine.live_requests(self.limit, self.with_text)


@dataclass(frozen=True)
class DumpWorkloadCall(EngineCall):
    """The flight recorder's window (``Engine.dump_workload``), a ``Workload``; answered at once."""

    immediate: ClassVar[bool] = True
    engine_name: str = "engine"
    with_text: bool = False

    def run(self, engine: "Engine", send: "Send") -> "Workload":
        return engine.dump_workload(self.engine_name, self.with_text)


@dataclass(frozen=True)
class KVCacheDumpCall(EngineCall):
    """The KV cache opened (``Engine.dump_kv_cache``), a :class:`KVCacheDump` listing at most
    ``max_entries`` prefix-cache entries; answered at once, even mid-step."""

    immediate: ClassVar[bool] = True
    max_entries: int = DEFAULT_KV_ENTRIES
    with_text: bool = False

    def run(self, engine: "Engine", send: "Send") -> KVCacheDump:
        return engine.dump_kv_cache(self.max_entries, self.with_text)


@dataclass(frozen=True)
class AbortCall(EngineCall):
    """Abort one request by id, between two steps (``Engine.abort_request``, the path a client's
    disconnect takes): its last outputs (finish reason ``abort``) go to its stream first. A
    disaggregated request still waiting for its K/V (``prep_recv``'s reservation: the live table's
    "kv_transfer" row) has no stream yet: its reservation is released, its pages freed. Replies
    whether it was in the engine (False: unknown, or already ended)."""

    request_id: str

    def run(self, engine: "Engine", send: "Send") -> bool:
        output = engine.abort_request(self.request_id)
        if output is not None:
            send(StepOutputs([output]))
            return True
        return engine.release_receive(self.request_id, why="aborted")


@dataclass(frozen=True)
class DumpTraceCall(EngineCall):
    """The Chrome trace as JSON bytes; ``clear`` takes the window and empties the recorder;
    ``skip_empty`` replies None when nothing is recorded. A ValueError when tracing is off."""

    clear: bool = False
    skip_empty: bool = False

    def run(self, engine: "Engine", send: "Send") -> bytes | None:
        tracer = _tracer(engine)
        if self.skip_empty and tracer.event_count == 0:
            return None
        return tracer.dump_json(self.clear)


@dataclass(frozen=True)
class TraceSinceCall(EngineCall):
    """The trace calls recorded since ``cursor`` (``TraceRecorder.read_since``), a
    ``TraceDelta``; a ValueError when tracing is off."""

    immediate: ClassVar[bool] = True
    cursor: int = 0

    def run(self, engine: "Engine", send: "Send") -> Any:
        return _tracer(engine).read_since(self.cursor)


def _tracer(engine: "Engine") -> Any:
    if engine.tracer is None:
        raise ValueError("tracing is off for this engine")
    return engine.tracer


@dataclass(frozen=True)
class ProfileCall(EngineCall):
    """Start or stop the built-in profiler (``Engine.start_profile`` / ``stop_profile``): ``start``
    replies a ``ProfileStatus``, ``stop`` a ``ProfileResult``. A start while one runs, or a stop
    with none, is a ``ProfilerStateError``. Where it stands: :class:`ProfileStatusCall`."""

    action: Literal["start", "stop"]
    max_steps: int | None = None
    max_seconds: float = 60.0
    stack_sampling: bool = False
    #: The engine's served name, for the result of a stop.
    engine_name: str = "engine"
    #: ``start`` arms a profile that starts itself when this fires (``core.profile_trigger``).
    trigger: ProfileTrigger | None = None

    def run(self, engine: "Engine", send: "Send") -> Any:
        if self.action == "start":
            return engine.start_profile(self.max_steps, self.max_seconds, self.stack_sampling, self.trigger)
        return engine.stop_profile(self.engine_name)


@dataclass(frozen=True)
class ProfileStatusCall(EngineCall):
    """Where the built-in profiler stands (``ProfilerControl.status``); replies a ``ProfileStatus``."""

    immediate: ClassVar[bool] = True

    def run(self, engine: "Engine", send: "Send") -> Any:
        return engine.profiling.status()


@dataclass(frozen=True)
class CudaProfilerCall(EngineCall):
    """``cudaProfilerStart`` (``start``) or ``Stop`` on the engine's thread; replies None (a
    ValueError off the cuda backend)."""

    start: bool

    def run(self, engine: "Engine", send: "Send") -> None:
        engine.model.backend.cuda_profiler(self.start)


@dataclass(frozen=True)
class PrepareReceiveCall(EngineCall):
    """Disaggregated serving's receive side (``Engine.prepare_receive``): reserve pages for the
    K/V of ``prompt[:end]``; replies a ``KVReceipt``, or raises ``KVTransferError``."""

    request_id: str
    prompt: tuple[int, ...]
    end: int
    timeout_s: float = 60.0

    def run(self, engine: "Engine", send: "Send") -> Any:
        return engine.prepare_receive(self.request_id, list(self.prompt), self.end, self.timeout_s)


@dataclass(frozen=True)
class ReceiveKVCall(EngineCall):
    """Store a ``KVBlock`` another engine sent into its reservation (``Engine.receive_kv``);
    replies None, or raises ``KVTransferError`` (and the reservation is released)."""

    block: KVBlock

    def run(self, engine: "Engine", send: "Send") -> None:
        engine.receive_kv(self.block)


@dataclass(frozen=True)
class ReleaseReceiveCall(EngineCall):
    """Give up the reservation of ``request_id`` (only if it is ``ticket``'s, when given); replies
    whether there was one."""

    request_id: str
    ticket: str | None = None

    def run(self, engine: "Engine", send: "Send") -> bool:
        return engine.release_receive(self.request_id, self.ticket)


# ---------------------------------------------------------------- front end -> core


@dataclass(frozen=True)
class AddRequest:
    """Queue ``request``; answered only if it fails, by :class:`Rejected`."""

    request: GenerationRequest


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request; answered by its last outputs (if it was running), then :class:`Aborted`."""

    request_id: str


@dataclass(frozen=True)
class ServerTraceEvent:
    """A trace event recorded in the server, ``at_ns`` on its ``perf_counter_ns`` clock."""

    request_ids: tuple[str, ...]
    event: str
    args: dict[str, Any] | None
    at_ns: int


@dataclass(frozen=True)
class ServerTraceEvents:
    """Server-side trace events, in the order they happened; ignored when tracing is off."""

    events: tuple[ServerTraceEvent, ...]


@dataclass(frozen=True)
class Call:
    """One :data:`EngineCall`; ``call_id`` pairs it with its :class:`Reply`."""

    call_id: int
    call: EngineCall


@dataclass(frozen=True)
class LocalCall:
    """One :data:`EngineCall` from a thread of the engine's own process, answered by setting
    ``future`` (its result or its exception); it never crosses the process boundary."""

    call: EngineCall
    future: concurrent.futures.Future


@dataclass(frozen=True)
class Shutdown:
    """Abort every request (their last outputs are sent) and stop the loop."""


CoreCommand = Union[AddRequest, AbortRequest, ServerTraceEvents, Call, LocalCall, Shutdown]


# ---------------------------------------------------------------- core -> front end


@dataclass(frozen=True)
class Ready:
    """An engine process loaded its model and serves from now on."""

    info: EngineInfo


@dataclass(frozen=True)
class Failed:
    """An engine process could not start; ``error`` is raised in the server."""

    error: BaseException


@dataclass(frozen=True)
class StepOutputs:
    """Outputs of one step (or of an abort or a reset), sent together so each loop wakes once."""

    outputs: list[RequestOutput]


@dataclass(frozen=True)
class Aborted:
    """An :class:`AbortRequest` is done: nothing more comes for ``request_id``, which is free again."""

    request_id: str


@dataclass(frozen=True)
class Rejected:
    """An :class:`AddRequest` that changed nothing; ``error`` is for the client."""

    request_id: str
    error: BaseException


@dataclass(frozen=True)
class Reply:
    """A call's result (``ok``) or the exception it raised."""

    call_id: int
    ok: bool
    value: Any


@dataclass(frozen=True)
class Dead:
    """The loop stopped on an internal error; nothing more will come."""

    reason: str


CoreMessage = Union[Ready, Failed, StepOutputs, Aborted, Rejected, Reply, Dead]

#: How the core hands a message to its front end.
Send = Callable[[CoreMessage], None]


class MessageConnection(Connection):
    """The socket pair's end in an engine process and in its server: messages pickled with
    protocol 5, whose in-band buffers copy a NumPy array once (a disaggregation ``KVBlock`` of
    tens of MB crosses in about half the time of multiprocessing's default protocol)."""

    def send(self, obj: Any) -> None:
        self.send_bytes(pickle.dumps(obj, protocol=5))

    def recv(self) -> Any:
        return pickle.loads(self.recv_bytes())
