"""The engine-core loop, and the ``main`` of an engine process.

``EngineCore`` owns one :class:`~engines.runtime.core.engine.Engine` and runs its step loop,
taking commands between steps and sending every step's outputs as one message. It knows
nothing of how messages travel: ``AsyncEngine`` runs it on a thread or in a child process
(``transports``), as vLLM's engine core does. The process keeps the model's Python work
(scheduling, sampling, detokenizing) off the server's GIL, so HTTP streaming and the engine
no longer slow each other down. The messages are the typed ones of ``messages``; the core
dispatches on their type.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import pickle
import queue
import signal
import sys
import threading
from typing import Any, Callable


from engines import __version__
from engines.runtime.core.disagg.kv_http import KVListener, KVListenSpec, deliver_block
from engines.runtime.core.disagg.transfer import KVDelivery, KVSend
from engines.runtime.core.engine import Engine, EngineConfig
from engines.runtime.core.request import RequestOutput
from engines.runtime.core.warm_up import warm_up
from engines.runtime.frontend.progress_board import ProgressBoard
from engines.runtime.frontend.step_hold import StepHold
from engines.runtime.frontend.messages import (
    MessageConnection,
    AbortRequest,
    Aborted,
    AddRequest,
    Call,
    CoreCommand,
    CoreMessage,
    Dead,
    EngineCall,
    EngineInfo,
    EngineSpec,
    Failed,
    LocalCall,
    ReceiveKVCall,
    ReleaseReceiveCall,
    Ready,
    Rejected,
    Reply,
    Send,
    ServerTraceEvents,
    Shutdown,
    StepOutputs,
)
from engines.runtime.model.checkpoint import Checkpoint, load_checkpoint
from engines.runtime.model.llama import LlamaModel
from engines.runtime.telemetry import trace_recorder as trace_clock
from engines.runtime.telemetry.trace_recorder import TraceRecorder

logger = logging.getLogger("engines.runtime")

__all__ = ["EngineCore", "ServerGone", "create_engine", "engine_info", "main", "portable_error",
           "run_engine_process", "start_kv_listener"]

#: How long the K/V listener waits for the engine loop to store a block (it runs between steps).
LOCAL_CALL_TIMEOUT_S = 60.0

# How long an idle core waits for a command before looking again. A wait never ends early for
# no reason, so this only bounds how late a stop flag set without a message is noticed.
_IDLE_WAIT_S = 0.5

# CPython hands the GIL to a waiting thread only after the holder has run this long (5 ms by
# default). Both sides of a served engine pair a busy thread with one that needs the GIL briefly
# and often: in the engine process the receiving thread (every command) beside the step loop, in
# the server the reader (every step's outputs) beside the event loop. At the default each of those
# waits up to a whole interval every time, which a closed-loop client sees as time to first token
# and the batch as empty slots (docs/perf-log/serving-and-tools.md#server-h100-engine-process).
# The interval costs nothing while no thread waits.
GIL_SWITCH_INTERVAL_S = 0.0005


def shorten_gil_switch() -> None:
    """Set this process's GIL switch interval to :data:`GIL_SWITCH_INTERVAL_S`, unless it is
    shorter already."""
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def create_engine(checkpoint: Checkpoint, name: str, config: EngineConfig, backend: str = "auto",
                  dtype: str = "float32", enable_tracing: bool = False) -> Engine:
    """Put the checkpoint's weights on a backend and build its engine (with a recorder if tracing)."""
    model = LlamaModel.from_checkpoint(checkpoint, backend=backend, dtype=dtype)
    tracer = (TraceRecorder(engine=name, model=checkpoint.name, backend=model.backend_name,
                            max_events=config.max_trace_events, version=__version__)
              if enable_tracing else None)
    return Engine(model, checkpoint, config, tracer)


def engine_info(engine: Engine) -> EngineInfo:
    """The :class:`EngineInfo` of a built engine."""
    return EngineInfo(engine.model.backend_name, engine.model.dtype, engine.vocab_size,
                      engine.max_seq_len, engine.tracer is not None, engine.model.kv_bytes_per_token,
                      kv_cache=engine.kv_size, source_format=engine.checkpoint.source_format,
                      weights_format=engine.model.weights_format)


class ServerGone(EOFError):
    """A send found the server's end of the socket closed: the server died (killed outright,
    say) while the engine was stepping. An EOF like the receiver's, so the loop stops with one
    line in the log rather than a ``BrokenPipeError`` traceback."""


class EngineCore:
    """Runs an engine's step loop, taking commands between steps (see ``messages``).

    A ``remote_send`` request whose receiver is another server's engine (``KVSend.post_to``)
    ends in the engine like any other; its block then goes from a thread of this core straight
    to the receiver's listener, and its last output, carrying how that went (``KVDelivery``),
    follows once the receiver answered. An abort of such a request meanwhile is confirmed
    after that output, so nothing of it can reach a stream that reuses its id.
    """

    def __init__(self, engine: Engine, name: str = "engine", board: ProgressBoard | None = None) -> None:
        self.engine = engine
        self.name = name
        #: Where the loop says how far it got, for a watchdog that cannot ask (``progress_board``).
        self.board = board or ProgressBoard()
        self._hold = StepHold()  # a test's held step; none unless ENGINES_TEST_STEP_HOLD is set
        self._posts: dict[str, KVSend] = {}  # request id -> where its block goes (engine thread only)
        self._posting: dict[str, bool] = {}  # request id -> an abort waits for its post (under the lock)
        self._posting_lock = threading.Lock()

    def run(self, receive: Callable[[float | None], CoreCommand | None], send: Send) -> None:
        """Serve until a :class:`Shutdown`, or until ``receive`` raises ``EOFError`` (the front
        end is gone).

        ``receive(timeout)`` returns the next command, or None when none came within
        ``timeout`` seconds (0: don't wait). An internal error is logged and reported as
        :class:`Dead`; the loop then returns.
        """
        engine = self.engine
        try:
            while True:
                # Wait only when idle; otherwise take what is queued and step.
                timeout: float | None = _IDLE_WAIT_S if not engine.has_work else 0
                while (command := receive(timeout)) is not None:
                    if not self.handle(command, send):
                        return
                    timeout = 0
                engine.expire_receives()
                if engine.has_work:
                    board = self.board
                    board.step_started(len(engine.requests))
                    if self._hold.armed:
                        self._hold.before_step()
                    outputs = engine.step()
                    board.step_finished(len(engine.requests))
                    self._send_outputs(outputs, send)
                else:
                    self.board.idle()
        except EOFError:
            logger.info("engine %s: its front end went away; stopping", self.name)
        except Exception as e:  # noqa: BLE001 - a dead engine must fail its streams, not hang them
            logger.exception("engine %s stopped on an internal error", self.name)
            try:
                send(Dead(repr(e)))
            except (OSError, ValueError, EOFError):  # the front end is gone too
                pass

    @staticmethod
    def is_immediate(command: CoreCommand) -> bool:
        """Whether ``command`` is answered at once by the thread that receives it, even in the
        middle of a step (its call class says so: thread-safe reads that a scrape or a live
        timeline must never wait a long prefill for)."""
        return isinstance(command, Call) and command.call.immediate

    def handle(self, command: CoreCommand, send: Send) -> bool:
        """Carry out one command; False once it was :class:`Shutdown`."""
        engine = self.engine
        match command:
            case AddRequest(request):
                try:
                    engine.add_request(request)
                except Exception as e:  # noqa: BLE001 - add_request changed nothing: the request fails alone
                    send(Rejected(request.request_id, portable_error(e)))
                else:
                    if request.kv_send is not None and request.kv_send.post_to is not None:
                        self._posts[request.request_id] = request.kv_send
            case AbortRequest(request_id):
                output = engine.abort_request(request_id)
                if output is not None:
                    self._send_outputs([output], send)
                with self._posting_lock:
                    if request_id in self._posting:  # confirmed once its last output went out
                        self._posting[request_id] = True
                        return True
                send(Aborted(request_id))
            case ServerTraceEvents(events):
                if engine.tracer is not None:
                    for ev in events:
                        engine.tracer.add_event(ev.request_ids, ev.event, ev.args, at_ns=ev.at_ns)
            case Call(call_id, call):
                try:
                    value = self.call(call, send)
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    send(Reply(call_id, False, portable_error(e)))
                else:
                    send(Reply(call_id, True, value))
            case LocalCall(call, future):
                try:
                    future.set_result(self.call(call, send))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
            case Shutdown():
                self._send_outputs(engine.reset(), send)
                return False
            case _:
                raise TypeError(f"engine {self.name}: not an engine command: {command!r}")
        return True

    def call(self, call: EngineCall, send: Send) -> Any:
        """Carry out one call (its own ``run``) and return its reply's value."""
        if not isinstance(call, EngineCall):
            raise TypeError(f"not an engine call: {call!r}")
        return call.run(self.engine, send)

    def _send_outputs(self, outputs: list[RequestOutput], send: Send) -> None:
        """Send a step's outputs; the last output of a request whose block goes to another
        server's listener waits for that post, on a thread of its own."""
        if self._posts:
            kept = []
            for out in outputs:
                target = self._posts.pop(out.request_id, None) if out.finished else None
                if target is not None and out.kv_block is not None:
                    self._post(out, target, send)
                else:
                    kept.append(out)
            outputs = kept
        if outputs:
            send(StepOutputs(outputs))

    def _post(self, out: RequestOutput, target: KVSend, send: Send) -> None:
        block, url = out.kv_block, target.post_to
        assert block is not None and url is not None, "a finished output with a block, for a listener"
        with self._posting_lock:
            self._posting[out.request_id] = False

        def post() -> None:
            delivery: KVDelivery = deliver_block(block, url, target.api_key)
            if not delivery.ok:
                logger.warning("engine %s: the KV of request %s did not reach %s: %s", self.name, out.request_id,
                               delivery.url, delivery.error)
            with self._posting_lock:
                aborted = self._posting.pop(out.request_id)
            try:
                send(StepOutputs([dataclasses.replace(out, kv_block=None, kv_delivery=delivery)]))
                if aborted:
                    send(Aborted(out.request_id))
            except (OSError, ValueError, EOFError):  # the front end is gone
                pass

        threading.Thread(target=post, name=f"kv-post-{out.request_id[:16]}", daemon=True).start()


def start_kv_listener(spec: KVListenSpec, engine: Engine, put: Callable[[CoreCommand], None]) -> KVListener:
    """The engine's K/V listener, storing what it receives through ``put`` (the loop's inbox)."""

    def call(engine_call: EngineCall) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        put(LocalCall(engine_call, future))
        return future.result(LOCAL_CALL_TIMEOUT_S)

    return KVListener(spec, engine_info(engine).max_kv_transfer_bytes, lambda block: call(ReceiveKVCall(block)),
                      lambda request_id, ticket: call(ReleaseReceiveCall(request_id, ticket)))


# ----------------------------------------------------------------------- child process


def run_engine_process(conn: Any, spec: EngineSpec) -> None:
    """A child process's main: build the engine, send :class:`Ready`, and serve over ``conn``.

    Ctrl-C reaches the whole process group, and a service manager may send SIGTERM to every
    process of the service; the child ignores both and stops when its server says so (after
    the server has saved what it needs from it, such as the last trace window), or when the
    socket closes because the server died.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [engine {spec.name} pid {os.getpid()}] %(message)s")
    trace_clock.set_epoch_anchor_ns(spec.epoch_anchor_ns)
    shorten_gil_switch()
    try:
        checkpoint = load_checkpoint(spec.checkpoint_path, keep_quantized=spec.keep_quantized)
        engine = create_engine(checkpoint, spec.name, spec.config, spec.backend, spec.dtype, spec.enable_tracing)
        warm_up(engine)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        logger.exception("engine %s could not start", spec.name)
        conn.send(Failed(portable_error(e)))
        return
    # A receiving thread answers metrics calls at once and queues the rest for the loop; it
    # holds the GIL only between the model's kernels, which release it.
    inbox: queue.SimpleQueue[CoreCommand | None] = queue.SimpleQueue()
    info = engine_info(engine)
    if spec.kv_listen is not None:
        try:
            listener = start_kv_listener(spec.kv_listen, engine, inbox.put)
        except OSError as e:  # the port is taken, the address is not ours
            conn.send(Failed(RuntimeError(f"engine {spec.name}: its K/V listener cannot listen on "
                                          f"{spec.kv_listen.host}:{spec.kv_listen.port}: {e}")))
            return
        info = dataclasses.replace(info, kv_port=listener.port)
    conn.send(Ready(info))
    core = EngineCore(engine, spec.name, ProgressBoard(spec.progress_path) if spec.progress_path else None)
    send_lock = threading.Lock()

    def send(message: CoreMessage) -> None:
        with send_lock:
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError) as e:
                raise ServerGone(f"engine {spec.name}: its server went away") from e

    def receive_all() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                inbox.put(None)  # the server went away
                return
            except Exception:  # noqa: BLE001 - one message that does not unpickle here; the stream is intact
                logger.exception("engine %s: dropped a command it could not read", spec.name)
                continue
            if core.is_immediate(message):
                try:
                    core.handle(message, send)
                except ServerGone:  # the loop stops at the next look, with one line
                    inbox.put(None)
                    return
            else:
                inbox.put(message)

    threading.Thread(target=receive_all, name="engine-receiver", daemon=True).start()

    def receive(timeout: float | None) -> CoreCommand | None:
        try:
            message = inbox.get(timeout=timeout) if timeout else inbox.get_nowait()
        except queue.Empty:
            return None
        if message is None:
            raise EOFError
        return message

    core.run(receive, send)
    conn.close()


def portable_error(error: BaseException) -> BaseException:
    """``error`` itself if it survives a trip through pickle, else a RuntimeError that tells it."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - anything that does not round-trip
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def main() -> None:
    """Entry point of an engine process: ``python -c "...engine_core import main; main()" FD``, where
    FD is its end of a socket pair; the first message on it is the :class:`EngineSpec`."""
    conn = MessageConnection(int(sys.argv[1]))
    try:
        spec = conn.recv()
    except EOFError:  # the server went away before asking for anything
        return
    run_engine_process(conn, spec)
