"""``/ws/fleet/``: the fleet view, once a second, from this process's board (``engines.fleet``).
Every page open on this server shares one read of the fleet's store a second."""
from __future__ import annotations

from typing import Any

from engines.dashboard.consumers import StaffSocket
from engines.fleet.rows import FleetRequest, FleetSocketError
from engines.fleet.service import fleet_service

__all__ = ["FleetConsumer"]


class FleetConsumer(StaffSocket[FleetRequest]):
    """A staff member's fleet page."""

    request_model = FleetRequest
    example = '{"action": "refresh"}'
    #: It talks to no group (the board calls it back): no channel of its own in the layer, whose
    #: reads would end the socket with a traceback while Redis is away.
    channel_layer_alias = "fleet-sockets-use-no-layer"
    watching = False

    async def open(self) -> None:
        await self.accept()
        service = fleet_service()
        service.start()
        if service.board.latest_text is not None:
            await self.send(text_data=service.board.latest_text)
        service.board.watch(self, self._send_view)
        self.watching = True

    async def _send_view(self, text: str) -> None:
        await self.send(text_data=text)

    async def disconnect(self, code: int) -> None:
        if self.watching:
            fleet_service().board.unwatch(self)

    async def handle(self, request: FleetRequest) -> None:
        try:
            text = await fleet_service().board.view_text()
        except Exception as exc:  # noqa: BLE001 - the store is down; the board says so every second too
            await self.reject(f"the fleet's store does not answer: {exc}", None)
            return
        await self.send(text_data=text)

    async def reject(self, message: str, raw: Any) -> None:
        await self.send(text_data=FleetSocketError(error=message).model_dump_json())
