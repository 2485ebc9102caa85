"""What one request may put into the engine, its trace and the history is bounded (issue 10)."""
from __future__ import annotations

import httpx
import pytest

from engines.registry import registry
from engines.runtime import REQUEST_LIMITS
from tests.server.conftest import TRACED, assert_error

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Tell me a story."}]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
async def test_a_user_longer_than_a_request_id_is_refused(client: httpx.AsyncClient, path: str) -> None:
    limit = REQUEST_LIMITS.max_request_id_chars
    prompt = {"messages": HELLO} if path == CHAT else {"prompt": "Once"}
    tracer = registry.get(TRACED).engine.tracer
    before = tracer.event_count
    body = assert_error(await client.post(path, json={"model": TRACED, **prompt, "max_tokens": 2,
                                                      "user": "u" * (limit + 1)}), 400)
    assert body["param"] == "user" and f"at most {limit} characters" in body["message"]
    assert tracer.event_count == before  # refused before anything reached the engine or its trace
    ok = await client.post(path, json={"model": TRACED, **prompt, "max_tokens": 2, "user": "u" * limit})
    assert ok.status_code == 200 and ok.json()["id"] == "u" * limit
