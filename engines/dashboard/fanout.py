"""One channel-layer subscription per engine group per server process, fanned out locally.

Joining every browser socket to the engine's group would make each snapshot cost the channel
layer one send per viewer (with Redis: a Redis write and read per viewer, four times a second).
Instead each server process joins one channel of its own to the group, and hands what arrives
to its local sockets, serialised once: a thousand viewers cost the layer what one does.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)

__all__ = ["LocalFanout", "fanout"]

Deliver = Callable[[str], Awaitable[None]]


class LocalFanout:
    """The relays of one event loop: per group, a channel in the layer and the local subscribers."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.subscribers: dict[str, set[Deliver]] = {}
        self.relays: dict[str, asyncio.Task[None]] = {}

    async def subscribe(self, group: str, deliver: Deliver) -> None:
        """Call ``deliver(json_text)`` with every message sent to ``group`` from now on."""
        subscribers = self.subscribers.setdefault(group, set())
        subscribers.add(deliver)
        if group not in self.relays:
            layer = get_channel_layer()
            channel = await layer.new_channel()
            await layer.group_add(group, channel)
            self.relays[group] = asyncio.get_running_loop().create_task(
                self._relay(layer, group, channel), name=f"fanout-{group}")

    async def unsubscribe(self, group: str, deliver: Deliver) -> None:
        subscribers = self.subscribers.get(group)
        if subscribers is None:
            return
        subscribers.discard(deliver)
        if not subscribers:
            del self.subscribers[group]
            relay = self.relays.pop(group, None)
            if relay is not None:
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)

    async def _relay(self, layer: Any, group: str, channel: str) -> None:
        try:
            while True:
                message = await layer.receive(channel)
                text = orjson.dumps(message.get("snapshot", message)).decode()
                for deliver in list(self.subscribers.get(group, ())):
                    try:
                        await deliver(text)
                    except Exception:  # noqa: BLE001 - one closed socket must not starve the others
                        logger.debug("dashboard: a socket of %s did not take a snapshot", group, exc_info=True)
        finally:
            try:
                await layer.group_discard(group, channel)
            except Exception:  # noqa: BLE001 - the layer (or its Redis) may be gone at shutdown
                pass


_fanouts: dict[int, LocalFanout] = {}


def fanout() -> LocalFanout:
    """This event loop's fan-out (tests run several loops in one process)."""
    loop = asyncio.get_running_loop()
    hub = _fanouts.get(id(loop))
    if hub is None or hub.loop is not loop:  # a closed loop's id may come back
        hub = _fanouts[id(loop)] = LocalFanout(loop)
    return hub
