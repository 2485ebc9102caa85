"""The engines this server process serves, by served model name (MLC's ``ServerContext``).

There is one process-wide :data:`registry`. Whoever starts the process fills it
before requests arrive, and the ASGI views only look engines up:

- ``manage.py serve`` parses ``--model`` specs, builds the engines with
  :func:`engines.startup.build_engines`, and calls :func:`configure`;
- tests build engines themselves and call :func:`configure`;
- a bare ``daphne debugsite.asgi:application`` deployment sets ``ENGINES_MODELS``
  (and friends) and ``debugsite.asgi`` calls :func:`engines.startup.configure_from_env`.

Unlike MLC, lookup never guesses: a lone engine is *not* returned for any name,
and an unknown name is always "not served".
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

from engines.prometheus_names import DEFAULT_METRICS_PREFIX, check_prefix

if TYPE_CHECKING:  # the runtime (numba and all) loads only when engines are built
    from engines.disagg.router import DisaggRouter
    from engines.runtime import AsyncEngine

logger = logging.getLogger(__name__)


class RegistryError(Exception):
    """The registry cannot be configured as asked; the message says why."""


@dataclass(frozen=True)
class ServerOptions:
    """Process-wide switches that views and the auth gate read on every request."""

    enable_debug: bool = False  # mounts /debug/*, honours debug_config, returns usage.extra
    api_key: str | None = None  # required as "Authorization: Bearer <key>" when set
    metrics_prefix: str = DEFAULT_METRICS_PREFIX  # starts every /metrics name (engines.prometheus_names)
    metrics_vllm_aliases: bool = False  # /metrics repeats the series of vLLM's definition under its names
    capture_text: bool = False  # captures keep prompt and output text too (serve --capture-text)


@dataclass
class _Entry:
    engine: "AsyncEngine"
    created: int = field(default_factory=lambda: int(time.time()))  # for /v1/models


class EngineRegistry:
    """Engines by served name, in the order they were added.

    Filled before serving starts and read from the event loop afterwards, so it
    needs no lock: nothing mutates it while requests are in flight.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self.options = ServerOptions()
        #: Names this server process in disaggregation metadata: K/V bound for an engine of the
        #: same process is copied directly instead of over HTTP.
        self.server_id = uuid.uuid4().hex
        #: Set by ``serve --router disagg``: the OpenAI routes go to prefill and decode servers.
        self.router: "DisaggRouter | None" = None
        #: Set once a shutdown began: new generation requests are refused (503) from then on.
        self.draining = False
        #: Generation responses being written (a stream from its first chunk to ``[DONE]``).
        self.responses_in_flight = 0

    def add(self, engine: "AsyncEngine") -> None:
        """Register an engine under ``engine.name`` (MLC's error text on a duplicate)."""
        if engine.name in self._entries:
            raise RegistryError(f"Model {engine.name} already running.")
        self._entries[engine.name] = _Entry(engine)

    def get(self, model: str | None) -> "AsyncEngine | None":
        """The engine serving ``model``, or None. Never falls back to another engine."""
        if model is None:
            return None
        entry = self._entries.get(model)
        return entry.engine if entry else None

    def first(self) -> "AsyncEngine | None":
        """The first engine added: MLC's target for process-wide debug routes that name no model."""
        return next(iter(self._entries.values())).engine if self._entries else None

    def model_names(self) -> list[str]:
        """Served names, in the order the engines were added."""
        return list(self._entries)

    def created(self, model: str) -> int:
        """Unix time the model was registered (the ``created`` field of ``/v1/models``)."""
        return self._entries[model].created

    def __iter__(self) -> Iterator["AsyncEngine"]:
        return (entry.engine for entry in list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def start_all(self) -> None:
        """Start every engine that is not running yet."""
        for engine in self:
            if not engine.is_alive:
                engine.start()

    @contextlib.contextmanager
    def response_in_flight(self) -> Iterator[None]:
        """Count a generation response for as long as it is being written (for :meth:`drain`)."""
        self.responses_in_flight += 1
        try:
            yield
        finally:
            self.responses_in_flight -= 1

    async def drain(self, timeout_s: float, flush_timeout_s: float = 5.0) -> int:
        """Shut down gracefully: refuse new requests, let the responses in flight finish within
        ``timeout_s``, then end the rest as ``/debug/reset_engine`` does (each stream gets its last
        chunk with ``finish_reason: "abort"`` and ``[DONE]``), and wait for them to be written.

        Returns how many responses were still running at the timeout (and so were aborted).
        """
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._busy() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = max(self.responses_in_flight, sum(engine.num_streams for engine in self))
        if cut:
            logger.info("shutdown: %d responses still running after %.1f s; ending them", cut, timeout_s)
            await asyncio.gather(*(engine.reset() for engine in self if engine.is_alive), return_exceptions=True)
            deadline = loop.time() + flush_timeout_s
            while self._busy() and loop.time() < deadline:
                await asyncio.sleep(0.02)
        return cut

    def _busy(self) -> bool:
        # Both: a stream's request lives in its engine from before its response starts until
        # after its last output; its response is written from its first chunk to ``[DONE]``.
        return self.responses_in_flight > 0 or any(engine.num_streams for engine in self)

    def shutdown_all(self) -> None:
        """Stop every engine and forget them; safe to call twice (signal handler and ``finally``)."""
        engines = list(self)
        self._entries.clear()
        for engine in engines:
            try:
                engine.shutdown()
            except Exception:  # one engine failing to stop must not keep the others running
                logger.exception("engine %s did not shut down cleanly", engine.name)

    def replace(self, engines: Sequence["AsyncEngine"], options: ServerOptions) -> None:
        """Serve exactly ``engines`` with ``options`` from now on, routing nothing (does not stop the
        old ones)."""
        self._entries.clear()
        for engine in engines:
            self.add(engine)
        self.options = options
        self.draining = False
        self.router = None


registry = EngineRegistry()


def configure(
    engines: Sequence["AsyncEngine"],
    *,
    enable_debug: bool = False,
    api_key: str | None = None,
    start: bool = True,
    metrics_prefix: str = DEFAULT_METRICS_PREFIX,
    metrics_vllm_aliases: bool = False,
    capture_text: bool = False,
) -> EngineRegistry:
    """Make the process-wide registry serve ``engines``; the one entry point for serve, tests and ASGI.

    The caller keeps ownership of engines it replaces: tests swap options
    between cases without restarting a shared engine. A ``metrics_prefix`` that cannot start a
    metric name is a :class:`RegistryError`.
    """
    try:
        check_prefix(metrics_prefix)
    except ValueError as exc:
        raise RegistryError(str(exc)) from None
    registry.replace(engines, ServerOptions(enable_debug=enable_debug, api_key=api_key or None,
                                            metrics_prefix=metrics_prefix, metrics_vllm_aliases=metrics_vllm_aliases,
                                            capture_text=capture_text))
    if start:
        registry.start_all()
    return registry
