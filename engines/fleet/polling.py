"""Polling the attached foreign servers: once per fleet, whichever member holds the lease.

Each attached server gets one :class:`ForeignPoller` task in every member; before each poll it
takes (or renews) the server's lease in the store, so one member polls it and the others only
read its rows; when that member stops, its lease runs out and another takes over within a few
intervals. A poll is bounded in time and bytes (``foreign.fetch_metrics``), runs on its own task
and so never slows another server's poll or the page.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import httpx

from engines.server.cancellation import check_cancelled
from engines.server.outage_log import OutageLog
from engines.fleet.server_kinds import ServerKind
from engines.fleet.board import ForeignTarget
from engines.fleet.foreign import ForeignReader, ForeignReading, PollError, fetch_metrics, reading_rows
from engines.fleet.store import FleetStore


__all__ = ["ForeignPoller", "ForeignPolling"]

logger = logging.getLogger("engines.fleet")

#: Seconds between re-reading the list of attached servers.
TARGETS_REFRESH_S = 5.0


class ForeignPoller:
    """Polls one foreign server every ``target.interval_s`` while this member holds its lease."""

    def __init__(self, store: FleetStore, holder: str, target: ForeignTarget, client: httpx.AsyncClient) -> None:
        self.store, self.holder, self.target, self.client = store, holder, target, client
        kind = ServerKind.parse(target.kind)
        self.reader = ForeignReader(kind if kind is not ServerKind.UNKNOWN else None)
        self._outage = OutageLog(logger, f"fleet: polling {target.name}")

    async def poll_once(self) -> ForeignReading:
        """Read ``/metrics`` once and store what it says (or why it said nothing)."""
        started = time.monotonic()
        try:
            text = await fetch_metrics(self.client, self.target.url, self.target.api_key or None)
            reading = self.reader.read(text, elapsed_s=time.monotonic() - started)
        except PollError as exc:
            reading = ForeignReading(at=time.time(), kind=self.reader.kind or ServerKind.UNKNOWN, error=str(exc))
        except httpx.HTTPError as exc:
            reading = ForeignReading(at=time.time(), kind=self.reader.kind or ServerKind.UNKNOWN,
                                     error=f"cannot reach {self.target.url}: {type(exc).__name__}: {exc}".rstrip(": "))
        await self.store.put_foreign(self.target.id, reading_rows(self.target.id, reading))
        return reading

    async def run(self) -> None:
        interval = max(0.5, self.target.interval_s)
        while True:
            check_cancelled()  # a callee may have swallowed our cancel (engines.server.cancellation)
            started = time.monotonic()
            try:
                if await self.store.take_lease(f"poll:{self.target.id}", self.holder, ttl_s=3 * interval):
                    await self.poll_once()
                self._outage.worked()
            except Exception as exc:  # noqa: BLE001 - the store is down: try again next interval
                self._outage.failed(exc)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))


class ForeignPolling:
    """Keeps one poller per attached server (the list re-read every :data:`TARGETS_REFRESH_S`)."""

    def __init__(self, store: FleetStore, holder: str, targets: Callable[[], Sequence[ForeignTarget]]) -> None:
        self.store, self.holder, self.targets = store, holder, targets
        self.pollers: dict[str, tuple[ForeignTarget, asyncio.Task[None]]] = {}
        # One connection pool for every poll; no redirects followed (a redirect is reported).
        self.client = httpx.AsyncClient(follow_redirects=False, timeout=httpx.Timeout(5.0))

    def refresh(self) -> None:
        """Start pollers for new targets (or changed ones) and stop those of detached ones."""
        wanted = {target.id: target for target in self.targets()}
        for key, (target, task) in list(self.pollers.items()):
            if wanted.get(key) != target:
                task.cancel()
                del self.pollers[key]
        for key, target in wanted.items():
            if key not in self.pollers:
                poller = ForeignPoller(self.store, self.holder, target, self.client)
                self.pollers[key] = (target, asyncio.get_running_loop().create_task(poller.run(),
                                                                                     name=f"fleet-poll-{key}"))

    async def run(self) -> None:
        try:
            while True:
                check_cancelled()  # a callee may have swallowed our cancel (engines.server.cancellation)
                self.refresh()
                await asyncio.sleep(TARGETS_REFRESH_S)
        finally:
            for _, task in self.pollers.values():
                task.cancel()
            await asyncio.gather(*(task for _, task in self.pollers.values()), return_exceptions=True)
            await self.client.aclose()
