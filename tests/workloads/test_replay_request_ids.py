"""A replay's ``X-Request-Id``: its name for each request, or none for a server that refuses ours
(llama-cpp-python's takes UUIDs only, with a bare 400 for anything else); and such a 400 said as one."""
from __future__ import annotations

import asyncio

import httpx

from engines.workloads.replay import replay

WORKLOAD = {"format": "llm-debugsite.workload", "version": 1, "engine": "m",
            "requests": [{"request_id": "r0", "offset_s": 0.0, "prompt_tokens": 4, "completion_tokens": 2}]}


def _replayed(request_ids: bool) -> tuple[list[str | None], dict]:
    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("x-request-id"))
        return httpx.Response(400)  # llama-cpp-python's answer to an id that is not a UUID: no body

    async def run() -> dict:
        async with httpx.AsyncClient(base_url="http://target", transport=httpx.MockTransport(answer)) as client:
            return (await replay(WORKLOAD, client, "m", "t", tag="x", request_ids=request_ids)).as_dict()

    return seen, asyncio.run(run())


def test_each_request_is_named_unless_asked_not_to() -> None:
    seen, run = _replayed(True)
    assert seen == ["replay-x-0"] and run["requests"][0]["sent_id"] == "replay-x-0"
    seen, run = _replayed(False)
    assert seen == [None] and run["requests"][0]["sent_id"] == ""


def test_a_refusal_without_a_body_is_an_error_that_names_its_status() -> None:
    _, run = _replayed(False)
    assert run["requests"][0]["status"] == 400 and run["requests"][0]["error"] == "HTTP 400 with no body"
    assert run["summary"]["succeeded"] == 0
