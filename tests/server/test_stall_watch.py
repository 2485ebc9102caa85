"""The watchdog inside a server process: a step held long (the test wraps the thread engine's
step, a test-only hook) opens a ``long_step`` incident with the engine thread's stack, /health
says ``stalled`` (503, or 200 with ``--stall-health-ok``); a blocked event loop is a ``loop_lag``
incident; each closes when progress resumes."""
from __future__ import annotations

import asyncio
import time

import pytest

from engines.server.loop_lag import LoopLagMonitor
from engines.registry import registry
from engines.watchdog.stall_watch import StallWatch, stall_watch
from engines.watchdog.detector import StallThresholds
from tests.server.conftest import TRACED

HELD_S = 2.0


def held_step(engine, seconds: float):
    """Make ``engine``'s next step take ``seconds`` longer; returns the undo."""
    inner = engine.engine  # the thread engine's Engine
    original = inner.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(seconds)  # parked here: the evidence's stack must show it
        return original()

    inner.step = step
    return lambda: setattr(inner, "step", original) if "step" in vars(inner) else None


async def wait_until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_held_step_is_a_long_step_stall_on_health_metrics_and_the_list(serve) -> None:
    async with serve(enable_debug=True) as http:
        engine = registry.get(TRACED)
        await engine.reset()
        stall_watch.configure(StallThresholds(step_s=0.5, loop_lag_s=30), health_ok=False)
        stall_watch.poll_s = 0.1
        undo = held_step(engine, HELD_S)
        stall_watch.start(lambda: [engine])
        try:
            reply = asyncio.ensure_future(http.post("/v1/completions", json={
                "model": TRACED, "prompt": "hi", "max_tokens": 3}))
            await wait_until(lambda: stall_watch.open_incident(TRACED) is not None)
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["stalled"][TRACED]["reason"] == "long_step"
            stall_watch.health_ok = True
            kept = await http.get("/health")
            assert kept.status_code == 200 and kept.json()["status"] == "stalled"
            assert f'llm_engine_stalled{{model="{TRACED}"}} 1.0' in (await http.get("/metrics")).text
            await wait_until(lambda: bool(stall_watch.incidents(TRACED)[0].evidence))
            evidence = stall_watch.incidents(TRACED)[0].evidence
            stacks = evidence["server_stacks"]
            assert "test_stall_watch.py" in stacks and "time.sleep(seconds)" in stacks
            assert "engine_stacks" not in evidence  # a thread engine's stack is the server's
            assert evidence["configuration"]["mode"] == "thread"
            assert (await reply).status_code == 200
            await wait_until(lambda: stall_watch.open_incident(TRACED) is None)
            listed = (await http.post("/debug/list_incidents", json={"model": TRACED})).json()
            assert not listed["open"] and listed["incidents"][0]["duration_s"] >= HELD_S - 0.6
            assert (await http.get("/health")).json()["status"] == "ok"
        finally:
            stall_watch.stop()
            undo()
            stall_watch.configure(StallThresholds(), health_ok=False)
            stall_watch.poll_s = 0.5
            stall_watch._incidents.clear()
        await engine.reset()


async def test_a_blocked_event_loop_is_a_loop_lag_stall_that_closes_when_it_runs(serve) -> None:
    async with serve(enable_debug=True):
        engine = registry.get(TRACED)
        lag = LoopLagMonitor(interval_s=0.05)
        lag.start()
        watch = StallWatch(lag=lag, poll_s=0.1)
        watch.configure(StallThresholds(loop_lag_s=0.5))
        await asyncio.sleep(0.2)
        watch.start(lambda: [engine])
        try:
            time.sleep(1.5)  # the loop is held: a blocking call in a coroutine
            await asyncio.sleep(0.5)
            incidents = watch.incidents(TRACED)
            assert len(incidents) == 1 and incidents[0].reason == "loop_lag", incidents
            assert "event loop ran" in incidents[0].detail
            await wait_until(lambda: not watch.incidents(TRACED)[0].open)
            assert incidents[0].duration_s is not None and incidents[0].duration_s > 0
        finally:
            watch.stop()
            await lag.stop()


@pytest.mark.parametrize("flag, value", [("--stall-step-s", "0"), ("--stall-no-progress-s", "-1")])
def test_a_threshold_that_is_not_positive_is_refused(flag, value) -> None:
    from django.core.management import CommandError, call_command

    with pytest.raises((CommandError, SystemExit)):
        call_command("serve", "--model", "demo", flag, value)
