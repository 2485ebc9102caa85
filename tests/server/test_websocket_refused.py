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
