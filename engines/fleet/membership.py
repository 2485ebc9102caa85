"""Which servers of ours form the fleet: each announces itself in the shared Redis and beats a
heartbeat; every member reads the same list.

Its keys (``keys.FleetKeys``): ``cards``, server id -> its :class:`ServerCard` (URL, version,
roles, engines), written every beat; ``beats``, server id -> its last heartbeat on the Redis
server's clock (``TIME``), so that members whose clocks disagree still agree on ages; ``left``,
server id -> when it stopped on purpose.

A member is *up* until its next beat is late by more than a grace (``Membership.gone_after_s``: a
heartbeat of 2 s and half of one, 3 s with no beat), then *gone* (shown with when it was last
seen); one that beats again is back, and one restarted on its host and URL under another id
replaces its ghost. Members gone longer than ``forget_after_s`` are dropped from the list. No
process or port beyond the servers themselves.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import orjson
from pydantic import BaseModel

from engines.server.cancellation import check_cancelled
from engines.fleet.keys import FleetKeys
from engines.server.outage_log import OutageLog
from engines.server.server_identity import host_of

logger = logging.getLogger("engines.fleet")

__all__ = ["GRACE_SHARE", "HEARTBEAT_S", "KEY_TTL_S", "EngineCard", "Member", "Membership", "ServerCard",
           "member_state", "replaced_ghosts"]

#: Seconds between a server's beats.
HEARTBEAT_S = 2.0
#: How late a beat may come, as a share of the heartbeat (1 s of 2 s), before its server is gone:
#: a loop busy for a moment is no outage, and a server that died is gone 3 s after its last beat.
GRACE_SHARE = 0.5
#: Seconds every key of a fleet outlives the last beat of its last member (``FLEET_KEY_TTL_S``):
#: each beat pushes their expiry back, so a fleet whose servers all stopped leaves nothing behind.
KEY_TTL_S = 24 * 3600.0


class EngineCard(BaseModel):
    """One engine of a server, as the fleet lists it."""

    name: str
    model: str
    backend: str
    dtype: str
    mode: Literal["process", "thread"]
    tracing: bool
    kv_cache: str = ""
    weights: str = ""                # what the checkpoint holds: "safetensors", "GGUF F32 x61, Q4_1 x210, ..."
    #: What the engine computes with: "float32", or a GGUF's types kept ("Q4_1 x210, Q8_0 x1"); "" from a
    #: server that does not say (older ones), "pending" while its engine starts.
    weights_in_memory: str = ""


class ServerCard(BaseModel):
    """A server of ours as it announces itself."""

    server: str                      # engines.server.server_identity.server_id(), "host:port"
    url: str                         # where its pages and API answer
    version: str
    roles: list[str]                 # "engines", "router", "prefill", "decode"
    engines: list[EngineCard]
    started_at: float                # Unix seconds, its own clock


MemberState = Literal["up", "gone", "stopped"]


class Member(BaseModel):
    """A server in the fleet's list: its card, and how long since its last heartbeat."""

    card: ServerCard
    last_seen: float                 # Redis time of its last beat (Unix seconds)
    age_s: float
    state: MemberState


def member_state(age_s: float, gone_after_s: float, stopped: bool) -> MemberState:
    """A member's state from the age of its last beat: stopped (it said so), gone (no beat for
    ``gone_after_s``: the first beat missed, plus the grace) or up."""
    return "stopped" if stopped else "gone" if age_s > gone_after_s else "up"


class Membership:
    """One server's part in the fleet list, over a ``redis.asyncio`` client."""

    def __init__(self, redis: Any, fleet: str = "default", heartbeat_s: float = HEARTBEAT_S,
                 forget_after_s: float = 24 * 3600, grace_s: float | None = None,
                 key_ttl_s: float = KEY_TTL_S) -> None:
        if not key_ttl_s >= 2 * heartbeat_s:
            raise ValueError(f"the fleet's keys must live at least two heartbeats ({2 * heartbeat_s:g} s), "
                             f"not {key_ttl_s!r} s")
        self.redis = redis
        self.fleet = fleet
        self.heartbeat_s = heartbeat_s
        #: Seconds a beat may be late before its server is gone (:data:`GRACE_SHARE` of a heartbeat).
        self.grace_s = heartbeat_s * GRACE_SHARE if grace_s is None else grace_s
        self.forget_after_s = forget_after_s
        self.keys = FleetKeys(fleet)
        self.key_ttl_ms = round(key_ttl_s * 1000)
        self._server: str | None = None

    @property
    def gone_after_s(self) -> float:
        """Seconds without a beat after which a member is gone: a heartbeat, plus the grace."""
        return self.heartbeat_s + self.grace_s

    async def _now(self) -> float:
        seconds, micros = await self.redis.time()
        return seconds + micros / 1e6

    async def announce(self, card: ServerCard) -> None:
        """Write the card and beat. The card goes every beat, not only when it changed: a member
        purged meanwhile (forgotten, taken for a ghost, or its Redis restarted empty) is back at
        its next beat. Each beat also pushes back the expiry of every key of the fleet."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.cards, card.server, card.model_dump_json())
        pipe.hdel(self.keys.left, card.server)
        pipe.zadd(self.keys.beats, {card.server: await self._now()})
        for key in self.keys.shared():
            pipe.pexpire(key, self.key_ttl_ms)
        await pipe.execute()
        self._server = card.server

    async def leave(self) -> None:
        """Say this server stopped on purpose (it stays listed, as stopped, until forgotten or,
        when it was the last, until the fleet's keys expire)."""
        if self._server is not None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(self.keys.left, self._server, await self._now())
            pipe.pexpire(self.keys.left, self.key_ttl_ms)
            await pipe.execute()

    async def members(self) -> list[Member]:
        """Every server of the fleet, up or gone, newest beat first. Forgets the long gone, and
        the ghosts of servers back on their URL (:func:`replaced_ghosts`): their card, beat and
        rows leave the fleet's keys."""
        now = await self._now()
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.cards)
        pipe.zrange(self.keys.beats, 0, -1, withscores=True)
        pipe.hgetall(self.keys.left)
        cards, beats, left = await pipe.execute()
        stale = {_text(server) for server, at in beats if now - at > self.forget_after_s}
        stopped = {_text(k) for k in left}
        listed = []
        for server, at in sorted(beats, key=lambda pair: -pair[1]):
            server = _text(server)
            raw = cards.get(server.encode()) or cards.get(server)
            if raw is None or server in stale:
                continue
            try:
                card = ServerCard.model_validate(orjson.loads(raw))
            except ValueError:
                logger.warning("fleet %s: member %s announced a card this version cannot read", self.fleet, server)
                continue
            age = max(0.0, now - at)
            listed.append(Member(card=card, last_seen=at, age_s=age,
                                 state=member_state(age, self.gone_after_s, server in stopped)))
        ghosts = replaced_ghosts(listed)
        await self._forget(stale | ghosts)
        return [m for m in listed if m.card.server not in ghosts]

    async def _forget(self, servers: set[str]) -> None:
        """Drop ``servers`` from the fleet: card, beat, stop and rows."""
        if not servers:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(self.keys.beats, *servers)
        for key in (self.keys.cards, self.keys.left, self.keys.rows):
            pipe.hdel(key, *servers)
        await pipe.execute()

    async def run(self, card: Any) -> None:
        """Announce ``card()`` every heartbeat until cancelled; a Redis that does not answer is
        logged once per outage and tried again at the next beat."""
        outage = OutageLog(logger, f"fleet: announcing this server to fleet {self.fleet}")
        while True:
            check_cancelled()  # a callee may have swallowed our cancel (engines.server.cancellation)
            try:
                await self.announce(card())
                outage.worked()
            except Exception as exc:  # noqa: BLE001 - Redis down: the server serves on, the fleet waits
                outage.failed(exc)
            await asyncio.sleep(self.heartbeat_s)


def replaced_ghosts(members: list[Member]) -> set[str]:
    """The members (newest beat first) that are not up and that a member with a newer beat on
    the same host and URL replaced: a server restarted there under another id (a bare ASGI
    server is ``host:pid<pid>``). Servers without a URL, or on other hosts (``127.0.0.1:8000``
    names a different server on each machine), replace nothing; two live ones are both kept."""
    newest: set[tuple[str, str]] = set()
    ghosts = set()
    for member in members:
        card = member.card
        if not card.url:
            continue
        place = (host_of(card.server), card.url.rstrip("/"))
        if place not in newest:
            newest.add(place)
        elif member.state != "up":
            ghosts.add(card.server)
    return ghosts


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
