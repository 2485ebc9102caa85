"""The engine loop and the messages a front end exchanges with it, in a thread or in a process.

``EngineCore`` owns one :class:`~engines.runtime.core.engine.Engine` and runs its step loop,
taking commands between steps and sending every step's outputs as one message. It knows
nothing of how messages travel: ``AsyncEngine`` runs it on a thread with queues, or in a
child process over a pipe (:func:`run_engine_process`), as vLLM's engine core does. The
process keeps the model's Python work (scheduling, sampling, detokenizing) off the server's
GIL, so HTTP streaming and the engine no longer slow each other down.

Messages are plain tuples of picklable values.

Front end to core:

* ``("add", GenerationRequest)``
* ``("abort", request_id)``
* ``("trace", [(request_ids, event, args, at_ns), ...])``: server-side events, timestamped there
* ``("call", call_id, method, args)``: one of :data:`EngineCore.CALLS`, answered by a ``reply``
* ``("shutdown",)``: abort everything and stop

Core to front end:

* ``("ready", EngineInfo)`` / ``("failed", exception)``: a child process's start-up
* ``("outputs", [RequestOutput, ...])``: one step's outputs (or an abort's, or a reset's)
* ``("aborted", request_id)``: an ``abort`` was carried out (after its outputs, if any)
* ``("rejected", request_id, exception)``: an ``add`` that changed nothing (``EngineRequestError``
  for a bad request)
* ``("reply", call_id, ok, value)``: a call's result, or the exception it raised
* ``("dead", message)``: the loop stopped on an internal error; nothing more will come
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from engines import __version__
from engines.runtime.telemetry import trace_recorder as trace_clock
from engines.runtime.model.checkpoint import Checkpoint, load_checkpoint
from engines.runtime.core.engine import Engine, EngineConfig
from engines.runtime.frontend.messages import EngineInfo, EngineSpec
from engines.runtime.model.llama import LlamaModel
from engines.runtime.telemetry.trace_recorder import TraceRecorder

logger = logging.getLogger("engines.runtime")

__all__ = ["EngineCore", "EngineInfo", "EngineSpec", "create_engine", "main", "run_engine_process"]

Message = tuple

# How long an idle core waits for a command before looking again. A wait never ends early for
# no reason, so this only bounds how late a stop flag set without a message is noticed.
_IDLE_WAIT_S = 0.5


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
                      engine.max_seq_len, engine.tracer is not None)


class EngineCore:
    """Runs an engine's step loop, taking commands between steps (see the module docstring)."""

    #: The methods a ``call`` message may name.
    CALLS = frozenset({"reset", "metrics", "metrics_with_histograms", "dump_trace", "cuda_profiler"})
    #: Calls answered at once from the thread that receives them, even in the middle of a step
    #: (``EngineMetrics`` reads are thread-safe): a metrics scrape never waits for a long prefill.
    IMMEDIATE_CALLS = frozenset({"metrics", "metrics_with_histograms"})

    def __init__(self, engine: Engine, name: str = "engine") -> None:
        self.engine = engine
        self.name = name

    def run(self, receive: Callable[[float | None], Message | None], send: Callable[[Message], None]) -> None:
        """Serve until a ``shutdown`` command, or until ``receive`` raises ``EOFError`` (the
        front end is gone).

        ``receive(timeout)`` returns the next command, or None when none came within
        ``timeout`` seconds (0: don't wait). An internal error is logged and reported as a
        ``dead`` message; the loop then returns.
        """
        engine = self.engine
        try:
            while True:
                # Wait only when idle; otherwise take what is queued and step.
                timeout: float | None = _IDLE_WAIT_S if not engine.has_work else 0
                while (message := receive(timeout)) is not None:
                    if not self.handle(message, send):
                        return
                    timeout = 0
                if engine.has_work:
                    outputs = engine.step()
                    if outputs:
                        send(("outputs", outputs))
        except EOFError:
            logger.info("engine %s: its front end went away; stopping", self.name)
        except Exception as e:  # noqa: BLE001 - a dead engine must fail its streams, not hang them
            logger.exception("engine %s stopped on an internal error", self.name)
            try:
                send(("dead", repr(e)))
            except (OSError, ValueError):  # the front end is gone too
                pass

    def answer_immediately(self, message: Message, send: Callable[[Message], None]) -> bool:
        """Answer ``message`` now if it is one of :data:`IMMEDIATE_CALLS` (from any thread); False
        if it must wait for the loop."""
        if message[0] != "call" or message[2] not in self.IMMEDIATE_CALLS:
            return False
        self.handle(message, send)
        return True

    def handle(self, message: Message, send: Callable[[Message], None]) -> bool:
        """Carry out one command; False once it was ``shutdown``."""
        kind = message[0]
        engine = self.engine
        if kind == "add":
            request = message[1]
            try:
                engine.add_request(request)
            except Exception as e:  # noqa: BLE001 - add_request changed nothing: the request fails alone
                send(("rejected", request.request_id, portable_error(e)))
        elif kind == "abort":
            output = engine.abort_request(message[1])
            if output is not None:
                send(("outputs", [output]))
            send(("aborted", message[1]))
        elif kind == "trace":
            if engine.tracer is not None:
                for ids, event, args, at_ns in message[1]:
                    engine.tracer.add_event(ids, event, args, at_ns=at_ns)
        elif kind == "call":
            _, call_id, method, args = message
            try:
                if method not in self.CALLS:
                    raise ValueError(f"unknown engine call {method!r}")
                value = getattr(self, "_call_" + method)(send, *args)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                send(("reply", call_id, False, portable_error(e)))
            else:
                send(("reply", call_id, True, value))
        elif kind == "shutdown":
            send(("outputs", engine.reset()))
            return False
        else:
            raise ValueError(f"unknown engine command {kind!r}")
        return True

    # The calls. Each gets ``send`` so that outputs it causes go out before its reply.

    def _call_reset(self, send: Callable[[Message], None], clear_trace: bool = False) -> None:
        outputs = self.engine.reset(clear_trace)
        if outputs:
            send(("outputs", outputs))

    def _call_metrics(self, send: Callable[[Message], None]) -> dict[str, Any]:
        return self.engine.metrics.as_dict()

    def _call_metrics_with_histograms(self, send: Callable[[Message], None]) -> tuple[dict[str, Any], dict]:
        return self.engine.metrics.as_dict(), self.engine.metrics.histograms()

    def _call_dump_trace(self, send: Callable[[Message], None], clear: bool = False,
                         skip_empty: bool = False) -> bytes | None:
        tracer = self.engine.tracer
        if tracer is None:
            raise ValueError("tracing is off for this engine")
        if skip_empty and tracer.event_count == 0:
            return None
        return tracer.dump_json(clear)


    def _call_cuda_profiler(self, send: Callable[[Message], None], start: bool) -> None:
        if self.engine.model.backend_name != "cuda":
            raise ValueError("the CUDA profiler needs the cuda backend")
        from numba import cuda

        # Runs on the engine's own thread, where the device's primary context is current.
        (cuda.profile_start if start else cuda.profile_stop)()


# ----------------------------------------------------------------------- child process


def run_engine_process(conn: Any, spec: EngineSpec) -> None:
    """A child process's main: build the engine, say ``ready``, and serve over ``conn``.

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
    try:
        checkpoint = load_checkpoint(spec.checkpoint_path)
        engine = create_engine(checkpoint, spec.name, spec.config, spec.backend, spec.dtype, spec.enable_tracing)
        engine.warm_up()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        logger.exception("engine %s could not start", spec.name)
        conn.send(("failed", portable_error(e)))
        return
    conn.send(("ready", engine_info(engine)))
    core = EngineCore(engine, spec.name)
    send_lock = threading.Lock()

    def send(message: Message) -> None:
        with send_lock:
            conn.send(message)

    # A receiving thread answers metrics calls at once and queues the rest for the loop; it
    # holds the GIL only between the model's kernels, which release it.
    inbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()

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
            if not core.answer_immediately(message, send):
                inbox.put(message)

    threading.Thread(target=receive_all, name="engine-receiver", daemon=True).start()

    def receive(timeout: float | None) -> Message | None:
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
    conn = Connection(int(sys.argv[1]))
    try:
        spec = conn.recv()
    except EOFError:  # the server went away before asking for anything
        return
    run_engine_process(conn, spec)
