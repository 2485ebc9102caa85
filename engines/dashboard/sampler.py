"""One sampler per engine per server process: reads its metrics and publishes snapshots.

Browsers never poll an engine: each server process reads each of its engines a few times a
second (:data:`WATCHED_INTERVAL_S`) while anyone watches it, and every viewer gets the same
snapshot from the engine's channel-layer group, so a thousand viewers cost the engine what one
does. With no viewer the sampler slows down (:data:`IDLE_INTERVAL_S`), and a new viewer wakes it
at once, so a page shows a snapshot as soon as it opens. A metrics read is answered by the
engine process's receiving thread even mid-step, so sampling never waits for a long prefill.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from typing import Any

from channels.layers import get_channel_layer
from redis.exceptions import RedisError

from django.urls import reverse

from engines.dashboard.messages import EngineHistory, EngineSnapshot, StallBanner, chart_values, engine_group
from engines.history.incidents import incident_recorder
from engines.server.server_identity import server_id
from engines.watchdog.stall_watch import stall_watch
from engines.profiling import profile_state
from engines.registry import EngineRegistry, registry as served_engines
from engines.runtime import AsyncEngine, EngineDeadError
from engines.server.cancellation import check_cancelled, within
from engines.server.outage_log import OutageLog

logger = logging.getLogger(__name__)


class LayerUnavailableError(Exception):
    """The channel layer (Redis) did not take a snapshot: the server serves on, the pages wait."""


#: What the channel layer raises while Redis does not answer (redis-py's errors, or the socket's).
LAYER_ERRORS: tuple[type[Exception], ...] = (ConnectionError, OSError, RedisError)

__all__ = ["LAYER_ERRORS", "EngineSampler", "LayerUnavailableError", "SamplerHub", "hub_for", "read_engine"]

#: Seconds between snapshots while someone watches (the charts move at 4 Hz).
WATCHED_INTERVAL_S = 0.25
#: Seconds between snapshots while no one watches.
IDLE_INTERVAL_S = 5.0
#: A metrics read the engine does not answer in this long is skipped (a wedged engine).
READ_TIMEOUT_S = 2.0
#: Seconds of samples kept for a page that opens (its charts' window).
HISTORY_S = 300.0


class EngineSampler:
    """Reads one engine's metrics and publishes :class:`EngineSnapshot` s to its group."""

    def __init__(self, engine: AsyncEngine, layer: Any) -> None:
        self.engine = engine
        self.layer = layer
        self.group = engine_group(engine.name)
        self.viewers = 0
        self.latest: EngineSnapshot | None = None
        self.latest_text: str | None = None  # ``latest`` as JSON, what the sockets are sent
        #: The last :data:`HISTORY_S` of samples: (time, ``chart_values``), oldest first.
        self.history: deque[tuple[float, tuple[float | None, ...]]] = deque()
        self._wake = asyncio.Event()

    def watch(self) -> None:
        """A viewer came: sample at the watched rate, starting now."""
        self.viewers += 1
        self._wake.set()

    def unwatch(self) -> None:
        self.viewers = max(0, self.viewers - 1)

    async def snapshot(self) -> EngineSnapshot:
        """The engine as of now: metrics left out while it does not run, or (``slow``) while it
        does not answer within :data:`READ_TIMEOUT_S`."""
        engine = self.engine
        metrics = view = None
        slow = False
        if engine.is_alive:
            metrics, view, slow = await read_engine(engine)
        status = engine.status
        return EngineSnapshot(
            server=server_id(), engine=engine.name, at=time.time(), state=status.state.value,
            reason=status.reason, restarts=status.restarts, backend=engine.backend_name, dtype=engine.dtype,
            mode="process" if engine.process else "thread", tracing=engine.tracing_enabled, metrics=metrics,
            recent_requests=view.ended if view else None, slow=slow,
            live_requests=[dataclasses.asdict(row) for row in view.live.requests] if view else None,
            live_total=view.live.total if view else None, kv_cache=dataclasses.asdict(view.kv) if view else None,
            draining=served_engines.draining, profile=profile_state(engine), stall=stall_banner(engine.name))

    def history_text(self) -> str:
        """The last :data:`HISTORY_S` of samples as an :class:`EngineHistory` message (JSON)."""
        return EngineHistory(engine=self.engine.name, at=[at for at, _ in self.history],
                             values=[list(values) for _, values in self.history]).model_dump_json()

    async def publish(self) -> EngineSnapshot:
        """Take a snapshot and send it to the engine's group."""
        snap = await self.snapshot()
        self.latest = snap
        self.history.append((snap.at, chart_values(snap.metrics)))
        while self.history and self.history[0][0] < snap.at - HISTORY_S:
            self.history.popleft()
        # Serialised once here, not once per viewer: the layer copies (in memory) or packs (Redis)
        # a string for each socket far more cheaply than a nested dict, and the consumer forwards it.
        self.latest_text = snap.model_dump_json()
        try:
            await self.layer.group_send(self.group, {"type": "engine.snapshot", "text": self.latest_text})
        except LAYER_ERRORS as exc:
            raise LayerUnavailableError(str(exc)) from exc
        return snap

    async def run(self) -> None:
        """Publish until cancelled: every :data:`WATCHED_INTERVAL_S` while watched, else every
        :data:`IDLE_INTERVAL_S` or as soon as a viewer comes."""
        layer = OutageLog(logger, f"dashboard: engine {self.engine.name}'s channel layer", down="does not answer",
                          meanwhile="its pages are not live until it does", back="answers again")
        while True:
            check_cancelled()  # a callee may have swallowed our cancel (engines.server.cancellation)
            self._wake.clear()
            try:
                await self.publish()
                layer.worked()
            except LayerUnavailableError as exc:  # Redis away: said once an outage, tried every sample
                layer.failed(exc)
            except Exception:  # noqa: BLE001 - one failed read or send must not end the engine's dashboard
                logger.exception("dashboard: sampling engine %s failed", self.engine.name)
            interval = WATCHED_INTERVAL_S if self.viewers else IDLE_INTERVAL_S
            try:
                await within(self._wake.wait(), interval)
            except asyncio.TimeoutError:
                pass


def stall_banner(engine: str) -> StallBanner | None:
    """The engine's open stall incident for the page's banner, linking its history row once written."""
    incident = stall_watch.open_incident(engine)
    if incident is None:
        return None
    pk = incident_recorder.record_pk(incident)
    url = reverse("admin:engines_stallincidentrecord_change", args=[pk]) if pk is not None else None
    return StallBanner(reason=incident.reason, detail=incident.detail, since=incident.opened_wall, url=url)


async def read_engine(engine: AsyncEngine) -> tuple[Any, Any, bool]:
    """``(metrics, requests, slow)`` from one read (``AsyncEngine.dashboard_reading``), or none and
    ``slow`` when the engine does not answer in :data:`READ_TIMEOUT_S` (a long compile or step
    holding its process), or none when it died meanwhile. A read left behind is cancelled and
    awaited here, its outcome taken: nothing is left to log "exception was never retrieved" later."""
    read = asyncio.ensure_future(engine.dashboard_reading(with_text=served_engines.options.capture_text))
    done, _ = await asyncio.wait([read], timeout=READ_TIMEOUT_S)
    if not done:
        read.cancel()
    outcome = (await asyncio.gather(read, return_exceptions=True))[0]
    if not done:
        return None, None, True
    if isinstance(outcome, BaseException):
        if not isinstance(outcome, EngineDeadError):
            raise outcome
        return None, None, False
    return outcome.metrics, outcome, False


class SamplerHub:
    """The samplers of one server process's engines, running on its event loop."""

    def __init__(self, registry: EngineRegistry) -> None:
        self.registry = registry
        self.loop = asyncio.get_running_loop()
        self.samplers: dict[str, EngineSampler] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        """Run a sampler for every registered engine (on the running loop); idempotent, and an
        engine registered anew under a served name gets a new sampler."""
        layer = get_channel_layer()
        for engine in self.registry:
            current = self.samplers.get(engine.name)
            if current is not None and current.engine is engine:
                continue
            if engine.name in self.tasks:
                self.tasks.pop(engine.name).cancel()
            sampler = EngineSampler(engine, layer)
            self.samplers[engine.name] = sampler
            self.tasks[engine.name] = asyncio.get_running_loop().create_task(
                sampler.run(), name=f"sampler-{engine.name}")

    def get(self, engine: str) -> EngineSampler | None:
        """The sampler of the engine served as ``engine``, starting the samplers if need be."""
        self.start()
        return self.samplers.get(engine)

    async def stop(self) -> None:
        """Stop every sampler."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()
        self.samplers.clear()


_hubs: dict[int, SamplerHub] = {}


def hub_for(registry: EngineRegistry) -> SamplerHub:
    """The process's sampler hub for ``registry`` (one per event loop: tests run several)."""
    loop = asyncio.get_running_loop()
    hub = _hubs.get(id(loop))
    if hub is None or hub.registry is not registry or hub.loop is not loop:  # a closed loop's id may come back
        hub = _hubs[id(loop)] = SamplerHub(registry)
    return hub
