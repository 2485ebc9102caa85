"""The fleet in a server process: the store (the shared Redis, or this process alone), this
server's publisher, the pollers of attached servers and the board the fleet pages watch.

One :class:`FleetService` per event loop (:func:`fleet_service`), started by ``serve`` once it
listens, or by the first fleet page opened (tests, another ASGI server). Settings:
``REDIS_URL`` (shared with the channel layer; without it the fleet is this server alone),
``FLEET_NAME`` (one Redis may hold several fleets) and ``FLEET_KEY_TTL_S`` (how long the fleet's
keys outlive its last member's last beat; a day).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from django.conf import settings

import engines
from engines.server.cancellation import check_cancelled
from engines.server.server_identity import server_id, url_server_id
from engines.server.outage_log import OutageLog
from engines.fleet.board import FleetBoard, ForeignTarget
from engines.fleet.server_kinds import QUANTITIES
from engines.fleet.controls import ROUTER_ENGINE, ControlListener
from engines.fleet.membership import KEY_TTL_S, EngineCard, ServerCard
from engines.fleet.polling import TARGETS_REFRESH_S, ForeignPolling
from engines.fleet.publisher import FleetPublisher
from engines.fleet.rollups import RollupWriter
from engines.fleet.rows import EngineRow
from engines.fleet.store import FleetStore, LocalFleetStore, RedisFleetStore
from engines.registry import registry
from engines.server.db_calls import in_db_thread


__all__ = ["FleetService", "configure", "fleet_service", "foreign_targets"]

logger = logging.getLogger("engines.fleet")

_STARTED_AT = time.time()
#: What ``serve`` says of this server: its URL and roles (``configure``).
_server: dict[str, Any] = {"url": "", "roles": None}


def configure(url: str, roles: Sequence[str] | None = None) -> None:
    """Tell the fleet where this server answers and what it is (``serve`` calls this)."""
    _server["url"], _server["roles"] = url, list(roles) if roles is not None else None


def server_card() -> ServerCard:
    """This server as it announces itself now."""
    cards = []
    for engine in registry:
        checkpoint = engine.checkpoint
        cards.append(EngineCard(name=engine.name, model=str(getattr(checkpoint, "name", "")),
                                backend=engine.backend_name, dtype=engine.dtype,
                                mode="process" if engine.process else "thread", tracing=engine.tracing_enabled,
                                kv_cache=engine.kv_cache.describe() if engine.kv_cache else "",
                                weights=str(getattr(engine, "source_format", "")),
                                weights_in_memory=str(getattr(engine, "weights_format", ""))))
    if registry.router is not None:  # the router's own lane: a job may save its trace
        cards.append(EngineCard(name=ROUTER_ENGINE, model="", backend="router", dtype="", mode="thread", tracing=True))
    roles = _server["roles"]
    if roles is None:
        serves = ["engines"] if any(True for _ in registry) else []
        roles = serves + (["router"] if registry.router is not None else [])
    return ServerCard(server=server_id(), url=_server["url"], version=engines.__version__, roles=roles,
                      engines=cards, started_at=_STARTED_AT)


def router_rows() -> list[EngineRow]:
    """The router's row (requests in flight through it), when this server routes."""
    router = registry.router
    if router is None:
        return []
    return [EngineRow(server=server_id(), engine=ROUTER_ENGINE, model="", state="running", at=time.time(),
                      figures={"running": float(sum(router.in_flight.values()))},
                      not_exported=[q for q in QUANTITIES if q != "running"])]


def _load_targets() -> list[ForeignTarget]:
    from engines.models import ForeignServer

    return [ForeignTarget(id=f"foreign-{s.pk}", name=s.name, url=s.url, kind=s.kind,
                          interval_s=min(5.0, max(1.0, s.poll_interval_s)), api_key=s.api_key)
            for s in ForeignServer.objects.order_by("name")]


async def foreign_targets() -> list[ForeignTarget]:
    """The attached servers, from the database."""
    return await in_db_thread(_load_targets)()


def make_store() -> FleetStore:
    name = getattr(settings, "FLEET_NAME", "default")
    url = getattr(settings, "REDIS_URL", "")
    if not url:
        return LocalFleetStore(name)
    import redis.asyncio as aioredis

    # Short timeouts: a Redis that went away must not hold a page or a poll for long.
    client = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    return RedisFleetStore(client, name, key_ttl_s=float(getattr(settings, "FLEET_KEY_TTL_S", KEY_TTL_S)))


class FleetService:
    """This process's fleet parts, on one event loop."""

    def __init__(self, store: FleetStore | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.store = store if store is not None else make_store()
        self.targets: list[ForeignTarget] = []
        self.board = FleetBoard(self.store, lambda: self.targets)
        self.publisher = FleetPublisher(self.store, server_id(), lambda: list(registry), server_card, extra=router_rows)
        self.polling = ForeignPolling(self.store, server_id(), lambda: self.targets)
        self.controls = ControlListener(self.store, server_id(), lambda: self.publisher.clock.best)
        self.rollups = RollupWriter(self.store, server_id(), lambda: {t.id: t.name for t in self.targets},
                                    addresses=lambda: {t.id: url_server_id(t.url) for t in self.targets},
                                    keep_minutes_h=float(getattr(settings, "FLEET_ROLLUP_MINUTES_H", 24)),
                                    keep_hours_d=float(getattr(settings, "FLEET_ROLLUP_HOURS_D", 30)))
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Publish this server and poll the attached ones (idempotent)."""
        if self.tasks:
            return
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self.publisher.run(), name="fleet-publisher"),
                      loop.create_task(self._refresh_targets(), name="fleet-targets"),
                      loop.create_task(self.polling.run(), name="fleet-polling"),
                      loop.create_task(self.controls.run(), name="fleet-controls"),
                      loop.create_task(self.rollups.run(), name="fleet-rollups")]

    async def refresh_targets(self) -> None:
        """Re-read the attached servers now (after an attach or a detach)."""
        self.targets = await foreign_targets()
        self.polling.refresh()

    async def _refresh_targets(self) -> None:
        outage = OutageLog(logger, "fleet: reading the attached servers")
        while True:
            check_cancelled()  # a callee may have swallowed our cancel (engines.server.cancellation)
            try:
                await self.refresh_targets()
                outage.worked()
            except Exception as exc:  # noqa: BLE001 - the database is down: keep the last list
                outage.failed(exc)
            await asyncio.sleep(TARGETS_REFRESH_S)

    async def stop(self) -> None:
        """Stop, saying this server left on purpose."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        await self.publisher.leave()


_services: dict[int, FleetService] = {}


def fleet_service() -> FleetService:
    """The running loop's fleet service (tests run several loops)."""
    loop = asyncio.get_running_loop()
    service = _services.get(id(loop))
    if service is None or service.loop is not loop:
        service = _services[id(loop)] = FleetService()
    return service
