"""Where the fleet's shared state lives: the Redis every member already uses for its channel
layer, or (no ``REDIS_URL``) this process alone.

Its keys (``keys.FleetKeys``) besides the membership's: ``rows``, server id -> that server's
:class:`~engines.fleet.rows.ServerRows`, rewritten once a second by the server itself (one
``HSET`` a second a server, whoever watches); ``foreign``, attached server id -> its last poll's
``ServerRows``; ``control:<server>``, the control commands other members sent that server
(``controls``), which it pops; ``lease:<what>``, held by the member doing a job for the whole
fleet (polling one foreign server), so that N members poll it once, and another takes over when
it stops.

The rows are also published on the channel of the hash's name: a member with fleet pages open
subscribes and forwards each server's rows within :data:`~engines.fleet.board.PUSH_INTERVAL_S`,
and reads the hashes once a second for the whole view. Per server and second, Redis carries one
write and, per member with pages open, one delivery, whatever the number of viewers.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any, Protocol

import orjson
from pydantic import ValidationError

from engines.fleet.membership import GRACE_SHARE, HEARTBEAT_S, KEY_TTL_S, Member, Membership, ServerCard
from engines.fleet.rows import ServerRows
from engines.server.cancellation import within

__all__ = ["FleetStore", "LocalFleetStore", "RedisFleetStore"]

#: Seconds a control queue outlives its last command (a gone server's queue does not pile up).
CONTROL_QUEUE_TTL_S = 60


class FleetStore(Protocol):
    """The fleet's shared state, as a member reads and writes it."""

    name: str
    shared: bool
    heartbeat_s: float               # seconds between a member's beats
    grace_s: float                   # how late a beat may be before its member is gone

    async def announce(self, card: ServerCard) -> None: ...
    async def leave(self) -> None: ...
    async def members(self) -> list[Member]: ...
    async def put_rows(self, rows: ServerRows) -> None: ...
    def rows_feed(self) -> AsyncGenerator[ServerRows, None]: ...
    async def all_rows(self) -> dict[str, ServerRows]: ...
    async def put_foreign(self, server: str, rows: ServerRows) -> None: ...
    async def all_foreign(self) -> dict[str, ServerRows]: ...
    async def take_lease(self, what: str, holder: str, ttl_s: float) -> bool: ...
    async def reference_time(self) -> float: ...
    async def push_control(self, server: str, command: str) -> None: ...
    async def pop_control(self, server: str, timeout_s: float) -> str | None: ...


def _decode_rows(raw: dict[Any, Any]) -> dict[str, ServerRows]:
    out: dict[str, ServerRows] = {}
    for key, value in raw.items():
        try:
            rows = ServerRows.model_validate(orjson.loads(value))
        except (ValidationError, orjson.JSONDecodeError):
            continue  # a member of another version: its rows are not ours to read
        out[key.decode() if isinstance(key, bytes) else key] = rows
    return out


class RedisFleetStore:
    """The fleet in a Redis (``redis.asyncio`` client)."""

    shared = True

    def __init__(self, redis: Any, name: str = "default", heartbeat_s: float = HEARTBEAT_S,
                 key_ttl_s: float = KEY_TTL_S) -> None:
        self.redis = redis
        self.name = name
        self.membership = Membership(redis, name, heartbeat_s, key_ttl_s=key_ttl_s)
        self.keys = self.membership.keys
        self.heartbeat_s, self.grace_s = self.membership.heartbeat_s, self.membership.grace_s

    async def announce(self, card: ServerCard) -> None:
        await self.membership.announce(card)

    async def leave(self) -> None:
        await self.membership.leave()

    async def members(self) -> list[Member]:
        return await self.membership.members()

    async def put_rows(self, rows: ServerRows) -> None:
        """Keep the rows (for a page that opens, and /fleet.json) and push them to the members
        with pages open: one round trip."""
        data = rows.model_dump_json()
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.rows, rows.server, data)
        pipe.pexpire(self.keys.rows, self.membership.key_ttl_ms)  # a hash new since the last beat expires too
        pipe.publish(self.keys.rows, data)
        await pipe.execute()

    async def rows_feed(self) -> AsyncGenerator[ServerRows, None]:
        """Every server's rows as it publishes them, until the iterator is closed."""
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(self.keys.rows)
        try:
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is None or message.get("type") != "message":
                    continue
                try:
                    yield ServerRows.model_validate_json(message["data"])
                except ValidationError:
                    continue  # a member of another version
        finally:
            await pubsub.aclose()

    async def all_rows(self) -> dict[str, ServerRows]:
        return _decode_rows(await self.redis.hgetall(self.keys.rows))

    async def put_foreign(self, server: str, rows: ServerRows) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.foreign, server, rows.model_dump_json())
        pipe.pexpire(self.keys.foreign, self.membership.key_ttl_ms)
        await pipe.execute()

    async def all_foreign(self) -> dict[str, ServerRows]:
        return _decode_rows(await self.redis.hgetall(self.keys.foreign))

    async def take_lease(self, what: str, holder: str, ttl_s: float) -> bool:
        """Hold ``what`` for ``ttl_s`` more seconds: True if it was free, expired or already ours."""
        key = self.keys.lease(what)
        ttl_ms = max(1, int(ttl_s * 1000))
        if await self.redis.set(key, holder, nx=True, px=ttl_ms):
            return True
        current = await self.redis.get(key)
        if current is not None and (current.decode() if isinstance(current, bytes) else current) == holder:
            await self.redis.pexpire(key, ttl_ms)
            return True
        return False


    async def reference_time(self) -> float:
        """The fleet's reference clock: the Redis server's ``TIME`` (Unix seconds)."""
        seconds, micros = await self.redis.time()
        return seconds + micros / 1e6

    async def push_control(self, server: str, command: str) -> None:
        """Queue a command for ``server``; a queue nobody reads expires (its server is gone)."""
        key = self.keys.control(server)
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(key, command)
        pipe.expire(key, CONTROL_QUEUE_TTL_S)
        await pipe.execute()

    async def pop_control(self, server: str, timeout_s: float) -> str | None:
        """The next command for ``server``, waiting up to ``timeout_s`` (whole seconds in Redis)."""
        popped = await self.redis.blpop([self.keys.control(server)], timeout=max(1, round(timeout_s)))
        if popped is None:
            return None
        value = popped[1]
        return value.decode() if isinstance(value, bytes) else value


class LocalFleetStore:
    """A fleet of one: this server, and the foreign servers it polls itself."""

    shared = False
    # Nominal: this server is the fleet's only member, up while it runs.
    heartbeat_s = HEARTBEAT_S
    grace_s = HEARTBEAT_S * GRACE_SHARE

    def __init__(self, name: str = "default") -> None:
        self.name = name
        self._card: ServerCard | None = None
        self._left = False
        self._rows: dict[str, ServerRows] = {}
        self._foreign: dict[str, ServerRows] = {}
        self._controls: dict[str, asyncio.Queue[str]] = {}
        self._feeds: list[asyncio.Queue[ServerRows]] = []

    async def announce(self, card: ServerCard) -> None:
        self._card, self._left = card, False

    async def leave(self) -> None:
        self._left = True

    async def members(self) -> list[Member]:
        if self._card is None:
            return []
        now = time.time()
        return [Member(card=self._card, last_seen=now, age_s=0.0, state="stopped" if self._left else "up")]

    async def put_rows(self, rows: ServerRows) -> None:
        self._rows[rows.server] = rows
        for feed in self._feeds:
            feed.put_nowait(rows)

    async def rows_feed(self) -> AsyncGenerator[ServerRows, None]:
        feed: asyncio.Queue[ServerRows] = asyncio.Queue()
        self._feeds.append(feed)
        try:
            while True:
                yield await feed.get()
        finally:
            self._feeds.remove(feed)

    async def all_rows(self) -> dict[str, ServerRows]:
        return dict(self._rows)

    async def put_foreign(self, server: str, rows: ServerRows) -> None:
        self._foreign[server] = rows

    async def all_foreign(self) -> dict[str, ServerRows]:
        return dict(self._foreign)

    async def take_lease(self, what: str, holder: str, ttl_s: float) -> bool:
        return True

    async def reference_time(self) -> float:
        return time.time()  # a fleet of one is its own reference

    async def push_control(self, server: str, command: str) -> None:
        self._controls.setdefault(server, asyncio.Queue()).put_nowait(command)

    async def pop_control(self, server: str, timeout_s: float) -> str | None:
        queue = self._controls.setdefault(server, asyncio.Queue())
        try:
            return await within(queue.get(), timeout_s)
        except asyncio.TimeoutError:
            return None
