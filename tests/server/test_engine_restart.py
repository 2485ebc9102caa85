"""A killed engine process comes back, and the server says so: /health, /stats, /metrics, reset."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from engines.prometheus_names import DEFAULT_METRICS_PREFIX as P
from engines.startup import ModelSpec, build_engines
from engines.runtime import AsyncEngine, EngineConfig, EngineState, RestartPolicy
from engines.runtime.frontend.supervision import DeathLog
from tests.server.conftest import SMALL_ENGINE, assert_error

BODY = {"model": "phoenix", "prompt": "Once upon a time", "max_tokens": 3}


@pytest.fixture
def phoenix() -> Iterator[AsyncEngine]:
    (engine,) = build_engines([ModelSpec("demo", "phoenix")], EngineConfig(**SMALL_ENGINE), backend="cpu",
                              process=True)
    engine._supervisor.deaths = DeathLog(RestartPolicy(first_delay_s=0.3))
    engine.start()
    yield engine
    engine.shutdown()


async def until(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_a_killed_engine_is_reported_restarting_then_serves_again(serve, phoenix) -> None:
    async with serve(enable_debug=True, serving=[phoenix]) as http:
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200
        os.kill(phoenix._transport.process.pid, signal.SIGKILL)
        await until(lambda: phoenix.status.state is EngineState.RESTARTING, 30)
        health = await http.get("/health")
        assert health.status_code == 503
        assert health.json()["engines"]["phoenix"]["state"] == "restarting"
        assert "ended unexpectedly" in health.json()["engines"]["phoenix"]["reason"]
        refused = assert_error(await http.post("/v1/completions", json=BODY), 503)
        assert "restarting" in refused["message"]
        await until(lambda: phoenix.is_alive)
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200
        health = await http.get("/health")
        assert health.status_code == 200
        assert health.json()["engines"]["phoenix"] == {"state": "running", "reason": None, "restarts": 1}
        assert (await http.get("/stats")).json()["engines"]["phoenix"]["restarts"] == 1
        exposition = (await http.get("/metrics")).text.splitlines()
        assert f'{P}restarts_total{{model="phoenix"}} 1.0' in exposition
        assert f'{P}up{{model="phoenix",state="running"}} 1.0' in exposition


async def test_reset_engine_restarts_a_dead_engine(serve, phoenix) -> None:
    phoenix._supervisor.deaths = DeathLog(RestartPolicy(enabled=False))
    async with serve(enable_debug=True, serving=[phoenix]) as http:
        os.kill(phoenix._transport.process.pid, signal.SIGKILL)
        await until(lambda: phoenix.status.state is EngineState.DEAD, 30)
        assert (await http.get("/health")).json()["engines"]["phoenix"]["state"] == "dead"
        assert_error(await http.post("/v1/completions", json=BODY), 503)
        reset = await http.post("/debug/reset_engine", json={"model": "phoenix"})
        assert reset.status_code == 200, reset.text
        assert phoenix.is_alive and phoenix.restarts == 1
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200
