"""The fleet as one view: members and attached servers, every engine's row, and the fleet's
totals, assembled from the store once a second while anyone watches.

Totals: counts and rates are summed over the engines that report them; a fleet percentile is
:func:`~engines.fleet.quantiles.fleet_quantile` over each engine's last-minute histogram in its
own bounds (never a mean of percentiles, never buckets summed across different bounds), given
with the interval the servers' buckets allow.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from django.urls import NoReverseMatch, reverse

from engines.server.cancellation import check_cancelled
from engines.server.outage_log import OutageLog
from engines.fleet.server_kinds import KINDS, ServerKind
from engines.fleet.quantiles import fleet_quantile
from engines.fleet.rows import (FLEET_WINDOW_QUANTITIES, EngineRow, EngineWeights, FleetRowsUpdate, FleetServer,
                                FleetTotals, FleetUnavailable, FleetView, ServerRows, TotalQuantile)
from engines.fleet.membership import ServerCard
from engines.fleet.store import FleetStore

logger = logging.getLogger("engines.fleet")

__all__ = ["FleetBoard", "ForeignTarget", "engine_pages", "engine_weights", "fleet_totals", "fleet_view"]

#: Seconds between whole views sent to the fleet pages (members, attached servers, totals).
VIEW_INTERVAL_S = 1.0
#: Seconds between pushes of the rows servers published meanwhile: a row reaches a page within
#: this long of its server reading its engines.
PUSH_INTERVAL_S = 0.25
#: Seconds after which an unbroken feed has brought every live server's rows at least once.
FEED_COVERS_S = 2.0


@dataclass(frozen=True)
class ForeignTarget:
    """A server attached by URL, as the pollers and the board know it (never its API key's value
    beyond the poller: the board and the browser see ``has_api_key`` only)."""

    id: str                          # "foreign-<pk>": its key in the store
    name: str
    url: str
    kind: str = ""                   # as detected at attach time; "" to detect on each poll
    interval_s: float = 2.0
    api_key: str = field(default="", repr=False)


@functools.lru_cache(maxsize=4096)
def _engine_path(name: str) -> str | None:
    """``/dashboard/engines/<name>/``, or None for a name no URL can carry ("/"). Cached: the
    view names every engine every second, and a ``reverse`` is tens of µs."""
    try:
        return reverse("dashboard-engine", args=[name])
    except NoReverseMatch:
        return None


def engine_pages(card: ServerCard) -> dict[str, str]:
    """Each engine's dashboard page on its own server (``<url>/dashboard/engines/<name>/``); none
    for a server that gave no URL, nor for a router's lane, which has no page."""
    if not card.url:
        return {}
    base = card.url.rstrip("/")
    return {engine.name: base + path for engine in card.engines
            if engine.backend != "router" and (path := _engine_path(engine.name)) is not None}


def engine_weights(card: ServerCard) -> dict[str, EngineWeights]:
    """What each engine of a server of ours computes with (its card's ``weights_in_memory``) and
    what its file holds; none for a router's lane, nor from a server whose cards do not say."""
    return {engine.name: EngineWeights(in_memory=engine.weights_in_memory, stored=engine.weights)
            for engine in card.engines if engine.backend != "router" and engine.weights_in_memory}


def _total(rows: Sequence[EngineRow], quantity: str) -> float:
    return sum(v for r in rows if (v := r.figures.get(quantity)) is not None and math.isfinite(v))


def fleet_totals(rows: Sequence[EngineRow], servers_up: int) -> FleetTotals:
    """The fleet's sums and percentiles over ``rows`` (rows of servers not up are left out by the caller)."""
    quantiles: dict[str, TotalQuantile] = {}
    for quantity in FLEET_WINDOW_QUANTITIES:
        histograms = [r.windows[quantity].buckets() for r in rows if quantity in r.windows]
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            found = fleet_quantile(q, histograms)
            quantiles[f"{quantity}_{label}"] = (
                TotalQuantile(value=None, low=None, high=None, count=0.0) if found is None else
                TotalQuantile(value=found.value, low=found.low,
                              high=None if math.isinf(found.high) else found.high, count=found.count))
    return FleetTotals(engines=len(rows), servers_up=servers_up, running=_total(rows, "running"),
                       waiting=_total(rows, "waiting"), prompt_tokens=_total(rows, "prompt_tokens"),
                       generation_tokens=_total(rows, "generation_tokens"), quantiles=quantiles)


async def fleet_view(store: FleetStore, foreign: Sequence[ForeignTarget], now: float | None = None,
                     held_rows: Mapping[str, ServerRows] | None = None) -> FleetView:
    """Read the store once and assemble the view (with ``held_rows``, the servers' rows as the
    caller holds them, from the store's feed, instead of reading them again)."""
    async def held() -> Mapping[str, ServerRows]:
        return held_rows if held_rows is not None else await store.all_rows()

    members, rows_by_server, foreign_rows = await asyncio.gather(store.members(), held(), store.all_foreign())
    now = time.time() if now is None else now
    servers: list[FleetServer] = []
    rows: list[EngineRow] = []
    live_rows: list[EngineRow] = []
    for member in members:
        card = member.card
        published = rows_by_server.get(card.server)
        these = published.rows if published is not None else []
        servers.append(FleetServer(server=card.server, name=card.server, url=card.url, kind=ServerKind.OURS.value,
                                   version=card.version, roles=card.roles, state=member.state,
                                   last_seen=member.last_seen, age_s=member.age_s, engines=len(card.engines),
                                   engine_pages=engine_pages(card), engine_weights=engine_weights(card)))
        rows.extend(these)
        if member.state == "up":
            live_rows.extend(these)
    for target in foreign:
        polled = foreign_rows.get(target.id)
        kind = polled.kind if polled is not None else (target.kind or ServerKind.UNKNOWN.value)
        missing = dict(KINDS[ServerKind.parse(kind)].missing_controls)
        if polled is None:
            servers.append(FleetServer(server=target.id, name=target.name, url=target.url, kind=kind, state="waiting",
                                       missing_controls=missing))
            continue
        state: Literal["unreachable", "up"] = "unreachable" if polled.error else "up"
        servers.append(FleetServer(server=target.id, name=target.name, url=target.url, kind=kind, state=state,
                                   last_seen=polled.at, age_s=max(0.0, now - polled.at), error=polled.error,
                                   engines=0 if polled.error else len(polled.rows), missing_controls=missing))
        named = [row.model_copy(update={"server": target.id}) for row in polled.rows]
        rows.extend(named)
        if state == "up":
            live_rows.extend(named)
    servers_up = sum(1 for s in servers if s.state == "up")
    return FleetView(fleet=store.name, at=now, shared=store.shared, heartbeat_s=store.heartbeat_s,
                     grace_s=store.grace_s, servers=servers, rows=rows,
                     totals=fleet_totals(live_rows, servers_up))


class FleetBoard:
    """Sends the fleet view to this process's fleet pages once a second while any is open (one
    store read a second for all of them), and between views, every :data:`PUSH_INTERVAL_S`, the
    rows servers published meanwhile (``FleetRowsUpdate``), from the store's feed."""

    def __init__(self, store: FleetStore, foreign: Callable[[], Sequence[ForeignTarget]],
                 interval_s: float = VIEW_INTERVAL_S) -> None:
        self.store = store
        self.foreign = foreign
        self.interval_s = interval_s
        self.viewers: dict[object, Callable[[str], Awaitable[None]]] = {}
        self.latest_text: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._feed_task: asyncio.Task[None] | None = None
        self._fresh: dict[str, ServerRows] = {}
        #: Every server's newest rows from the feed, and since when the feed has run unbroken: once
        #: it has run past a rows interval, whole views use these rather than read them again.
        self._held: dict[str, ServerRows] = {}
        self._feed_since: float | None = None
        self._outage = OutageLog(logger, f"fleet: reading fleet {store.name}")

    def watch(self, viewer: object, send: Callable[[str], Awaitable[None]]) -> None:
        """Send ``viewer`` every view (starting with the latest, if any) until :meth:`unwatch`."""
        self.viewers[viewer] = send
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run(), name="fleet-board")
            self._feed_task = loop.create_task(self._follow(), name="fleet-board-feed")

    def unwatch(self, viewer: object) -> None:
        self.viewers.pop(viewer, None)

    async def view_text(self) -> str:
        """The view as JSON, engine rows without their histograms (what a page and fleet.json get)."""
        since = self._feed_since
        held = self._held if since is not None and time.monotonic() - since > FEED_COVERS_S else None
        view = await fleet_view(self.store, self.foreign(), held_rows=held)
        return view.model_dump_json(exclude={"rows": {"__all__": {"windows"}}})

    async def _follow(self) -> None:
        """Keep the rows servers publish (the newest of each) until no page is open."""
        while self.viewers:
            feed = self.store.rows_feed()
            try:
                self._held, self._feed_since = dict(await self.store.all_rows()), time.monotonic()
                async for rows in feed:
                    self._fresh[rows.server] = self._held[rows.server] = rows
                    if not self.viewers:
                        break
            except Exception as exc:  # noqa: BLE001 - Redis went away: the views say so; retry
                logger.info("fleet %s: the rows feed stopped (%s); resubscribing", self.store.name, exc)
                await asyncio.sleep(1.0)
            finally:
                self._feed_since = None
                await feed.aclose()

    async def _send(self, text: str) -> None:
        for send in list(self.viewers.values()):
            try:
                await send(text)
            except Exception:  # noqa: BLE001 - a closing socket: its consumer unwatches
                pass

    async def _run(self) -> None:
        try:
            next_view = 0.0
            while self.viewers:
                check_cancelled()  # a callee may have swallowed our cancel (engines.server.cancellation)
                now = time.monotonic()
                if now >= next_view:
                    next_view = now + self.interval_s
                    self._fresh.clear()  # the view reads every server's newest rows itself
                    try:
                        text = await self.view_text()
                        self._outage.worked()
                    except Exception as exc:  # noqa: BLE001 - the store is down: say so, keep trying
                        self._outage.failed(exc)
                        text = FleetUnavailable(fleet=self.store.name, at=time.time(),
                                                error=str(exc)).model_dump_json()
                    self.latest_text = text
                    await self._send(text)
                elif self._fresh and not self._outage.failing:
                    fresh, self._fresh = self._fresh, {}
                    rows = [row for server_rows in fresh.values() for row in server_rows.rows]
                    update = FleetRowsUpdate(at=time.time(), rows=rows)
                    await self._send(update.model_dump_json(exclude={"rows": {"__all__": {"windows"}}}))
                await asyncio.sleep(min(PUSH_INTERVAL_S, max(0.0, next_view - time.monotonic())))
        finally:
            if self._feed_task is not None:
                self._feed_task.cancel()
