"""Whether a dashboard socket's snapshots arrive, and what its page is told when that changes.

Snapshots reach a socket only through the channel layer (Redis, with ``REDIS_URL``): the sampler
sends them to the engine's group and the layer hands them to every socket in it. While Redis is
away the sampler samples on, but nothing arrives, and a page would go on showing its last numbers
as if they were live. So each engine socket keeps a :class:`FeedWatch`: the layer failing under
the socket (joining its groups, reading its channel) or no snapshot for :data:`STALE_S` makes the
feed ``interrupted``, a :class:`FeedEvent` with the reason; meanwhile the socket joins its groups
again every :data:`RETRY_S` (a Redis that restarted empty forgot them), and the first snapshot that
arrives makes it ``live`` again, with no reload.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from engines.dashboard.messages import FeedEvent, FeedState
from engines.dashboard.sampler import LAYER_ERRORS, READ_TIMEOUT_S, WATCHED_INTERVAL_S

__all__ = ["RETRY_S", "STALE_S", "FeedWatch", "layer_reason"]

#: Seconds between tries to join the groups again while the feed is interrupted.
RETRY_S = 1.0
#: Seconds without a snapshot after which a watched feed counts as interrupted: well past the
#: longest a sampler takes between two of them (an engine slow to answer its read, then the interval).
STALE_S = 2 * (READ_TIMEOUT_S + WATCHED_INTERVAL_S)


def layer_reason(exc: BaseException) -> str:
    """Why the feed is interrupted, from what the channel layer raised."""
    said = str(exc).strip().rstrip(".") or type(exc).__name__
    return f"the channel layer (Redis) does not answer ({said})"


class FeedWatch:
    """One socket's feed: ``live`` or ``interrupted``, told to the browser with ``send`` when it
    opens (:meth:`start`) and at each change; ``join`` puts the socket in its groups (again).

    The socket reports what it sees (:meth:`arrived` for each snapshot, :meth:`failed` for the
    layer failing under it); a task of the watch's own notices a silence and joins again.
    """

    def __init__(self, send: Callable[[str], Awaitable[None]], join: Callable[[], Awaitable[None]]) -> None:
        self._send = send
        self._join = join
        self.state: FeedState = "live"
        self.reason: str | None = None
        #: Whether the socket is in its groups as far as it knows (not after a failure).
        self.joined = False
        self.last_arrival = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Join the groups, tell the browser how the feed stands, and watch it from now on."""
        reason = await self._try_join()
        if reason is not None:
            self.state, self.reason = "interrupted", reason
        await self._tell()
        self.last_arrival = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="dashboard-feed-watch")

    def stop(self) -> None:
        """The socket closed."""
        if self._task is not None:
            self._task.cancel()

    async def arrived(self) -> None:
        """A snapshot came through the layer: the feed is live."""
        self.last_arrival = time.monotonic()
        if self.state == "interrupted":
            self.state, self.reason = "live", None
            await self._tell()

    async def failed(self, reason: str) -> None:
        """The layer failed under the socket: interrupted (said once) until a snapshot comes again."""
        self.joined = False
        if self.state == "live":
            self.state, self.reason = "interrupted", reason
            await self._tell()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RETRY_S)
            if not self.joined:
                reason = await self._try_join()
                if reason is not None:
                    await self.failed(reason)
                    continue
            if self.state == "live" and time.monotonic() - self.last_arrival > STALE_S:
                await self.failed(f"no snapshot came for {STALE_S:g} s")

    async def _try_join(self) -> str | None:
        """Join the groups; None when done, else why not."""
        try:
            await self._join()
        except LAYER_ERRORS as exc:
            return layer_reason(exc)
        self.joined = True
        return None

    async def _tell(self) -> None:
        event = FeedEvent(state=self.state, reason=self.reason, at=time.time())
        await self._send(event.model_dump_json())
