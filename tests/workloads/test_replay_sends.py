"""What a replay sends beyond the recorded request: its ``X-Request-Id`` for each, or none for a server
that refuses ours (llama-cpp-python's takes UUIDs only, with a bare 400 for anything else; such a 400
said as one), and a server's own settings in every body (``extra_body``)."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from engines.workloads.replay import replay

WORKLOAD = {"format": "llm-debugsite.workload", "version": 1, "engine": "m",
            "requests": [{"request_id": "r0", "offset_s": 0.0, "prompt_tokens": 4, "completion_tokens": 2}]}


def _replayed(request_ids: bool, **options: Any) -> tuple[list[str | None], dict, list[dict]]:
    seen: list[str | None] = []
    bodies: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("x-request-id"))
        bodies.append(json.loads(request.content))
        return httpx.Response(400)  # llama-cpp-python's answer to an id that is not a UUID: no body

    async def run() -> dict:
        async with httpx.AsyncClient(base_url="http://target", transport=httpx.MockTransport(answer)) as client:
            return (await replay(WORKLOAD, client, "m", "t", tag="x", request_ids=request_ids, **options)).as_dict()

    return seen, asyncio.run(run()), bodies


def test_each_request_is_named_unless_asked_not_to() -> None:
    seen, run, _ = _replayed(True)
    assert seen == ["replay-x-0"] and run["requests"][0]["sent_id"] == "replay-x-0"
    seen, run, _ = _replayed(False)
    assert seen == [None] and run["requests"][0]["sent_id"] == ""


def test_a_refusal_without_a_body_is_an_error_that_names_its_status() -> None:
    _, run, _ = _replayed(False)
    assert run["requests"][0]["status"] == 400 and run["requests"][0]["error"] == "HTTP 400 with no body"
    assert run["summary"]["succeeded"] == 0


def test_extra_body_goes_into_every_body_beside_the_recorded_request() -> None:
    _, _, bodies = _replayed(True, extra_body={"repeat_penalty": 1.0})
    assert bodies[0]["repeat_penalty"] == 1.0 and bodies[0]["max_tokens"] == 2 and bodies[0]["model"] == "m"
    _, _, bodies = _replayed(True)
    assert "repeat_penalty" not in bodies[0]
