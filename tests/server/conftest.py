"""Fixtures for the server tests: real demo engines, the registry configured per test, an ASGI client.

The engines are the real thing (the demo checkpoint, CPU backend), built once per
session and kept small so the suite stays quick on two cores. Each test then
configures the process-wide registry the way ``manage.py serve`` would, and talks
to ``debugsite.asgi.application`` in-process through httpx's ASGI transport.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest

from engines.registry import ServerOptions, configure, registry
from engines.startup import ModelSpec, build_engines
from engines.runtime.frontend.async_engine import AsyncEngine
from engines.runtime.core.engine import EngineConfig
from engines.runtime.core.disagg.kv_http import KVListenSpec

TRACED = "demo"  # served with tracing on
UNTRACED = "demo-untraced"  # the same checkpoint, tracing off

# Small on purpose: two engines share two cores with the test process.
SMALL_ENGINE = dict(max_num_seqs=8, max_total_tokens=2048, prefill_chunk_size=128)


@pytest.fixture(scope="session")
def engines() -> Iterator[dict[str, AsyncEngine]]:
    """Two started demo engines by name: ``demo`` (tracing on) and ``demo-untraced``."""
    built = build_engines([ModelSpec("demo")], EngineConfig(**SMALL_ENGINE), backend="cpu", enable_tracing=True)
    # The untraced engine is the microserving tests' decode side: it listens for K/V.
    built += build_engines([ModelSpec("demo", UNTRACED)], EngineConfig(**SMALL_ENGINE), backend="cpu",
                           kv_listen=KVListenSpec("127.0.0.1"))
    for engine in built:
        engine.start()
    yield {engine.name: engine for engine in built}
    for engine in built:
        engine.shutdown()


@pytest.fixture
def serve(engines: dict[str, AsyncEngine]) -> Iterator[Callable[..., httpx.AsyncClient]]:
    """``serve(enable_debug=True, api_key=None, engines=None, **options)`` -> an httpx client on the
    ASGI app; ``options``: :func:`~engines.registry.configure`'s others (``metrics_prefix``, ...).

    Configures the registry as ``manage.py serve`` would; the registry is emptied
    again after the test so no test sees another's settings.
    """
    from debugsite.asgi import application

    clients: list[httpx.AsyncClient] = []

    def make(enable_debug: bool = True, api_key: str | None = None,
             serving: list[AsyncEngine] | None = None, **options: Any) -> httpx.AsyncClient:
        configure(list(engines.values()) if serving is None else serving,
                  enable_debug=enable_debug, api_key=api_key, start=False, **options)
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=application), base_url="http://127.0.0.1", timeout=60
        )
        clients.append(client)
        return client

    yield make
    registry.replace([], ServerOptions())


@pytest.fixture
async def client(serve: Callable[..., httpx.AsyncClient]) -> AsyncIterator[httpx.AsyncClient]:
    """A client for a server with both engines and ``--enable-debug``, and a freshly reset ``demo`` engine."""
    async with serve(enable_debug=True) as http:
        await registry.get(TRACED).reset(clear_trace=True)
        yield http


@pytest.fixture
async def dashboard(serve: Callable[..., httpx.AsyncClient]) -> AsyncIterator[None]:
    """Both demo engines served; the samplers of this test's event loop stopped afterwards
    (the dashboard's socket tests, tests/server/test_dashboard_sockets.py and test_timeline.py)."""
    from engines.dashboard.sampler import hub_for

    async with serve(enable_debug=True):
        await registry.get(TRACED).reset(clear_trace=True)
        yield
        await hub_for(registry).stop()


@pytest.fixture
def precompiled(monkeypatch) -> list[bool]:
    """``startup.prepare_kernels``' call of ``precompile`` noted, not run (``serve``'s and a bare
    Daphne's cold start): whether it was asked for the kept-quantized units, a call each."""
    import engines.runtime

    calls: list[bool] = []
    monkeypatch.setattr(engines.runtime, "precompile", lambda progress=None, quantized=False: calls.append(quantized))
    return calls


def sse_payloads(body: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded; ``[DONE]`` stays a string."""
    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"not an SSE data event: {block!r}"
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response: httpx.Response, status: int, message: str | None = None) -> dict[str, Any]:
    """The reply is an error object (not a JSON string) with ``status``, and ``message`` if given."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert isinstance(body, dict), f"error body is double-encoded: {response.text!r}"
    assert body["object"] == "error" and body["code"] == status
    assert body["error"]["message"] == body["message"]
    if message is not None:
        assert body["message"] == message
    return body


def assert_invalid_request(response: httpx.Response, raw: str) -> dict[str, Any]:
    """MLC's ``Invalid request {raw_body}`` 400, followed by our reason."""
    body = assert_error(response, 400)
    assert body["message"].startswith(f"Invalid request {raw}: "), body["message"]
    return body


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``predicate`` on the event loop until it holds (engine state moves on its own thread)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)
