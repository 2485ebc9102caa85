"""A websocket to any path but the dashboard's is refused cleanly (no 500, no traceback)."""
from __future__ import annotations

import logging

import pytest
from channels.testing import WebsocketCommunicator

from debugsite.asgi import application
from engines.dashboard.consumers import CLOSE_NOT_FOUND

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("path", ["/", "/ws/", "/ws/engines", "/v1/chat/completions", "/admin/"])
async def test_a_websocket_to_any_other_path_is_refused(path: str, caplog) -> None:
    caplog.set_level(logging.ERROR)
    communicator = WebsocketCommunicator(application, path, headers=[(b"origin", b"http://127.0.0.1:8000"),
                                                                      (b"host", b"127.0.0.1:8000")])
    connected, code = await communicator.connect(timeout=10)
    assert not connected and code == CLOSE_NOT_FOUND
    await communicator.disconnect()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_message_to_a_browser_already_gone_is_dropped_not_raised() -> None:
    """A tab killed without a close frame: Daphne's send raises Disconnected until the disconnect
    reaches the consumer; the consumer's sends drop it (no traceback), other errors still raise."""
    from autobahn.exception import Disconnected

    from engines.dashboard.consumers import sends_unless_gone

    sent: list[dict] = []

    async def gone(message: dict) -> None:
        raise Disconnected("Attempt to send on a closed protocol")

    async def broken(message: dict) -> None:
        raise RuntimeError("a bug")

    async def open_(message: dict) -> None:
        sent.append(message)

    await sends_unless_gone(gone)({"type": "websocket.send", "text": "{}"})
    await sends_unless_gone(open_)({"type": "websocket.send", "text": "{}"})
    assert sent == [{"type": "websocket.send", "text": "{}"}]
    with pytest.raises(RuntimeError):
        await sends_unless_gone(broken)({"type": "websocket.send", "text": "{}"})
