"""The typed messages between ``AsyncEngine`` and the engine core, one definition each.

Every message is a frozen dataclass of picklable values; both sides dispatch on its type,
never on a string. In an engine process they travel pickled over a socket pair; on a thread,
through a queue. ``docs/interfaces.md`` lists them with their order guarantees.

Front end to core (:data:`CoreCommand`):

* :class:`AddRequest`: queue a request. Answered only on failure, by :class:`Rejected`.
* :class:`AbortRequest`: abort one; answered by its last outputs, then :class:`Aborted`.
* :class:`ServerTraceEvents`: server-side trace events (``receive request``, tokenization),
  timestamped in the server; sent along before the next command.
* :class:`Call`: one of the :data:`EngineCall` operations, answered by a :class:`Reply`.
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
from typing import Any, Literal, Union

from engines.runtime.core.engine import EngineConfig
from engines.runtime.core.kv_sizing import KVCacheSize
from engines.runtime.core.kv_transfer import KVBlock
from engines.runtime.core.request import GenerationRequest, RequestOutput

__all__ = [
    "AbortRequest", "AddRequest", "Aborted", "Call", "CoreCommand", "CoreMessage", "CudaProfilerCall", "Dead",
    "DumpTraceCall", "TraceSinceCall", "ProfileCall", "EngineCall", "EngineInfo", "EngineSpec", "Failed", "KVListenSpec",
    "LocalCall", "MessageConnection",
    "MetricsCall", "Ready", "Rejected",
    "PrepareReceiveCall", "ReceiveKVCall", "RecentRequestsCall", "ReleaseReceiveCall", "RequestsView", "Reply", "ResetCall", "ServerTraceEvent", "ServerTraceEvents", "Shutdown", "StepOutputs",
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

    @property
    def max_kv_transfer_bytes(self) -> int:
        """The most K/V bytes a block for this engine can hold (its whole context)."""
        return self.kv_bytes_per_token * self.max_seq_len


@dataclass(frozen=True)
class KVListenSpec:
    """Where an engine's K/V listener binds (port 0: any free one) and the API key it requires."""

    host: str
    port: int = 0
    api_key: str | None = None


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


# ----------------------------------------------------------------- calls (answered by Reply)


@dataclass(frozen=True)
class ResetCall:
    """Abort every request, free the KV cache and prefix cache, zero the metrics; replies None."""

    clear_trace: bool = False


@dataclass(frozen=True)
class MetricsCall:
    """The engine metrics (``EngineMetrics.as_dict()``), or with ``with_histograms`` the pair
    ``(as_dict(), histograms())``. Answered at once, even mid-step."""

    with_histograms: bool = False


@dataclass(frozen=True)
class RecentRequestsCall:
    """The requests in the engine now (``Engine.live_requests``) and the last that ended, newest
    first (``EngineMetrics.recent_requests``), as a :class:`RequestsView`. Answered at once, even
    mid-step."""


@dataclass(frozen=True)
class RequestsView:
    """What the dashboard's request tables show: ``live`` (in the engine now, oldest first) and
    ``ended`` (the last that ended, newest first), each a list of JSON-ready dicts."""

    live: list[dict[str, Any]]
    ended: list[dict[str, Any]]


@dataclass(frozen=True)
class DumpTraceCall:
    """The Chrome trace as JSON bytes; ``clear`` takes the window and empties the recorder;
    ``skip_empty`` replies None when nothing is recorded. A ValueError when tracing is off."""

    clear: bool = False
    skip_empty: bool = False


@dataclass(frozen=True)
class TraceSinceCall:
    """The trace calls recorded since ``cursor`` (``TraceRecorder.read_since``), a
    ``TraceDelta``; a ValueError when tracing is off. Answered at once, even mid-step."""

    cursor: int = 0


@dataclass(frozen=True)
class ProfileCall:
    """The built-in profiler (``Engine.start_profile`` / ``stop_profile`` / ``profile_status``):
    ``start`` replies a ``ProfileStatus``, ``stop`` a ``ProfileResult``, ``status`` a
    ``ProfileStatus`` (answered at once, even mid-step). A start while one runs, or a stop
    with none, is a ``ProfilerStateError``."""

    action: Literal["start", "stop", "status"]
    max_steps: int | None = None
    max_seconds: float = 60.0
    stack_sampling: bool = False


@dataclass(frozen=True)
class CudaProfilerCall:
    """``cudaProfilerStart`` (``start``) or ``Stop`` on the engine's thread; replies None."""

    start: bool


@dataclass(frozen=True)
class PrepareReceiveCall:
    """Disaggregated serving's receive side (``Engine.prepare_receive``): reserve pages for the
    K/V of ``prompt[:end]``; replies a ``KVReceipt``, or raises ``KVTransferError``."""

    request_id: str
    prompt: tuple[int, ...]
    end: int
    timeout_s: float = 60.0


@dataclass(frozen=True)
class ReceiveKVCall:
    """Store a ``KVBlock`` another engine sent into its reservation (``Engine.receive_kv``);
    replies None, or raises ``KVTransferError`` (and the reservation is released)."""

    block: KVBlock


@dataclass(frozen=True)
class ReleaseReceiveCall:
    """Give up the reservation of ``request_id`` (only if it is ``ticket``'s, when given); replies
    whether there was one."""

    request_id: str
    ticket: str | None = None


EngineCall = Union[ResetCall, MetricsCall, RecentRequestsCall, DumpTraceCall, TraceSinceCall,
                   ProfileCall, CudaProfilerCall, PrepareReceiveCall, ReceiveKVCall, ReleaseReceiveCall]


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


class MessageConnection(Connection):
    """The socket pair's end in an engine process and in its server: messages pickled with
    protocol 5, whose in-band buffers copy a NumPy array once (a disaggregation ``KVBlock`` of
    tens of MB crosses in about half the time of multiprocessing's default protocol)."""

    def send(self, obj: Any) -> None:
        self.send_bytes(pickle.dumps(obj, protocol=5))

    def recv(self) -> Any:
        return pickle.loads(self.recv_bytes())
