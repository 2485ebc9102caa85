"""How commands reach an engine core and its messages come back: on a thread, or in a process.

Both transports take :data:`~engines.runtime.frontend.messages.CoreCommand` objects and hand
every :data:`~engines.runtime.frontend.messages.CoreMessage` to ``on_message`` (on the engine
thread, or on a reader thread), so ``AsyncEngine`` works the same over either.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

from engines.runtime.frontend.engine_core import EngineCore, start_kv_listener
from engines.runtime.core.disagg.kv_http import KVListener, KVListenSpec
from engines.runtime.core.warm_up import warm_up
from engines.runtime.frontend.messages import (
    MessageConnection,
    CoreCommand,
    CoreMessage,
    Dead,
    EngineInfo,
    EngineSpec,
    Failed,
    Ready,
    Shutdown,
)

logger = logging.getLogger("engines.runtime")

__all__ = ["PROCESS_START_TIMEOUT_S", "ProcessTransport", "ThreadTransport"]

# The folder that holds the ``engines`` package, for the engine process's import path.
_PROJECT_ROOT = Path(__file__).resolve().parents[3]

# What an engine process runs; its end of the socket pair is passed as argv[1], and the engine's
# name as argv[2], unread: it tells the engine processes apart in ps and top.
_CHILD_MAIN = "from engines.runtime.frontend.engine_core import main; main()"

# How long start() waits for an engine process to load its model and compile its kernels.
PROCESS_START_TIMEOUT_S = 900.0


class ThreadTransport:
    """The core on a thread of this process; commands through a queue, messages by direct call."""

    def __init__(self, core: EngineCore, on_message: Callable[[CoreMessage], None],
                 kv_listen: KVListenSpec | None = None) -> None:
        self.core = core
        self.on_message = on_message
        self.kv_listen = kv_listen
        self.inbox: queue.SimpleQueue[CoreCommand] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.listener: KVListener | None = None

    @property
    def started(self) -> bool:
        """Whether ``start`` ran and ``stop`` has not."""
        return self.thread is not None

    @property
    def alive(self) -> bool:
        """Whether the engine thread still runs."""
        return self.thread is not None and self.thread.is_alive()

    def start(self, info: EngineInfo | None) -> EngineInfo | None:
        """Warm the kernels up and start the loop; ``info`` is known already on a thread."""
        warm_up(self.core.engine)
        if self.kv_listen is not None:
            self.listener = start_kv_listener(self.kv_listen, self.core.engine, self.inbox.put)
            if info is not None:
                info = dataclasses.replace(info, kv_port=self.listener.port)
        self.thread = threading.Thread(target=self._run, name=f"engine-{self.core.name}", daemon=True)
        self.thread.start()
        return info

    def _run(self) -> None:
        self.core.run(self._receive, self.on_message)

    def _receive(self, timeout: float | None) -> CoreCommand | None:
        try:
            return self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def send(self, command: CoreCommand) -> None:
        """Queue ``command`` for the loop, or carry it out now if it is immediate."""
        if self.core.is_immediate(command):
            self.core.handle(command, self.on_message)  # on the caller's thread, even mid-step
        else:
            self.inbox.put(command)

    def stop(self, timeout: float) -> None:
        """Send :class:`Shutdown` and wait up to ``timeout`` s for the thread to end."""
        assert self.thread is not None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self.inbox.put(Shutdown())
        self.thread.join(timeout)
        self.thread = None


class ProcessTransport:
    """The core in a child process, over a socket pair.

    The child is a fresh interpreter (``python -c``), not a ``multiprocessing`` spawn, so it
    never re-imports the parent's ``__main__`` (a script without a main guard, a notebook) and
    inherits no threads or CUDA state. A reader thread here receives the child's messages;
    the socket closing without a ``shutdown`` (the child crashed or was killed) counts as the
    engine dying, and the child stops when the socket closes on its side (the server died).
    """

    def __init__(self, spec: EngineSpec, on_message: Callable[[CoreMessage], None]) -> None:
        self.spec = spec
        self.on_message = on_message
        self.process: subprocess.Popen | None = None
        self.conn: MessageConnection | None = None
        self.reader: threading.Thread | None = None
        self.stopping = False

    @property
    def started(self) -> bool:
        """Whether ``start`` ran and ``stop`` has not."""
        return self.process is not None

    @property
    def alive(self) -> bool:
        """Whether the engine process still runs."""
        return self.process is not None and self.process.poll() is None

    def start(self, info: EngineInfo | None) -> EngineInfo:
        """Start the child, send it the spec and wait for :class:`Ready`; return its info.

        Raises the child's own error if it could not load the model, or a RuntimeError if it
        exited or took longer than ``PROCESS_START_TIMEOUT_S``. ``info`` is unused: only the
        child knows it.
        """
        self.stopping = False  # a restart after a shutdown: its death must be reported again
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PROJECT_ROOT), env.get("PYTHONPATH")]))
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _CHILD_MAIN, str(theirs.fileno()), f"engine={self.spec.name}"],
                pass_fds=(theirs.fileno(),), env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the child holds its end; ours alone lets EOF reach us when it dies
        conn = MessageConnection(ours.detach())
        try:
            conn.send(self.spec)
            if not conn.poll(PROCESS_START_TIMEOUT_S):
                raise RuntimeError(f"engine {self.spec.name!r} did not load its model in "
                                   f"{PROCESS_START_TIMEOUT_S:.0f} s")
            first = conn.recv()
        except (EOFError, OSError):
            process.wait(5)
            conn.close()
            raise RuntimeError(f"engine {self.spec.name!r}: its process exited while starting "
                               f"(exit code {process.returncode}); see the log above") from None
        except BaseException:
            process.kill()
            process.wait(5)
            conn.close()
            raise
        if isinstance(first, Failed):  # the child's own error (a CheckpointError, a PermissionError, ...)
            process.wait(5)
            conn.close()
            raise first.error
        if not isinstance(first, Ready):
            process.kill()
            process.wait(5)
            conn.close()
            raise RuntimeError(f"engine {self.spec.name!r}: its process said {first!r} instead of Ready")
        self.process, self.conn = process, conn
        self.reader = threading.Thread(target=self._read, name=f"engine-{self.spec.name}-reader", daemon=True)
        self.reader.start()
        return first.info

    def _read(self) -> None:
        conn, on_message = self.conn, self.on_message
        assert conn is not None
        try:
            while True:
                on_message(conn.recv())
        except (EOFError, OSError):
            if not self.stopping:
                process = self.process
                code = process.wait(5) if process is not None else None
                on_message(Dead(f"its process ended unexpectedly (exit code {code})"))
        except Exception as e:  # noqa: BLE001 - a message we could not read: the stream is lost
            logger.exception("engine %s: reading from its process failed", self.spec.name)
            on_message(Dead(f"reading from its process failed: {e!r}"))

    def send(self, command: CoreCommand) -> None:
        """Pickle ``command`` to the child; raises OSError once it is gone."""
        assert self.conn is not None
        self.conn.send(command)

    def stop(self, timeout: float) -> None:
        """Send :class:`Shutdown`, wait up to ``timeout`` s for the child to exit, else kill it."""
        assert self.process is not None and self.conn is not None
        self.stopping = True
        try:
            self.conn.send(Shutdown())
        except (OSError, ValueError):
            pass
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("engine %s: its process did not stop in %.0f s; killing it", self.spec.name, timeout)
            self.process.kill()
            self.process.wait(5)
        if self.reader is not None:
            self.reader.join(timeout)
        self.conn.close()
        self.process = None
