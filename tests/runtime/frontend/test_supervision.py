"""A dead engine comes back: restart with backoff, a state the server reports, a policy that gives up."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from engines.startup import ModelSpec, build_engines
from engines.runtime import AsyncEngine, EngineConfig, EngineDeadError, EngineState, RestartPolicy
from engines.runtime.frontend.supervision import DeathLog, EngineStatus
from tests.runtime.demo_engine import consume, prompts, request

SIZING = EngineConfig(max_num_seqs=8, num_pages=64, prefill_chunk_size=64)
QUICK = RestartPolicy(first_delay_s=0.05, max_delay_s=0.2, max_deaths=3, window_s=60)


def engine_with(policy: RestartPolicy, *, process: bool, name: str = "supervised") -> AsyncEngine:
    (engine,) = build_engines([ModelSpec("demo", name)], SIZING, backend="cpu", process=process)
    engine._supervisor.deaths = DeathLog(policy)  # the policy under test, on an engine built as serve builds it
    engine.start()
    return engine


async def wait_for_state(engine: AsyncEngine, state: EngineState, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while engine.status.state is not state:
        assert time.monotonic() < deadline, f"still {engine.status} after {timeout} s"
        await asyncio.sleep(0.02)


def kill(engine: AsyncEngine) -> None:
    os.kill(engine._transport.process.pid, signal.SIGKILL)


def test_backoff_doubles_up_to_its_cap_and_deaths_count_within_the_window() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=4, max_deaths=3, window_s=10)
    assert [policy.delay_s(n) for n in range(5)] == [0.5, 1, 2, 4, 4]
    log = DeathLog(policy)
    assert [log.record(now) for now in (0, 5, 9)] == [1, 2, 3]
    assert log.exhausted(3) and not log.exhausted(2)
    assert log.record(now=30) == 1  # the old ones left the window
    assert DeathLog(RestartPolicy(enabled=False)).exhausted(1)
    assert EngineStatus(EngineState.DEAD, "boom", 2).describe() == "dead (boom, restarts 2)"
    assert EngineStatus(EngineState.RESTARTING, "boom", 0).describe() == "restarting (boom)"


async def test_a_killed_engine_process_comes_back_and_serves(demo, caplog) -> None:
    caplog.set_level(logging.INFO, logger="engines.runtime")
    engine = engine_with(QUICK, process=True)
    try:
        assert engine.status == EngineStatus(EngineState.RUNNING)
        stream = asyncio.create_task(consume(engine, request("victim", prompts(demo, 1)[0], max_tokens=400,
                                                                ignore_eos=True)))
        while (await engine.metrics())["num_running_requests"] < 1:
            await asyncio.sleep(0.01)
        killed_at = time.monotonic()
        kill(engine)
        with pytest.raises(EngineDeadError):  # the request in flight fails, as before
            await asyncio.wait_for(stream, 30)
        assert engine.status.state in (EngineState.RESTARTING, EngineState.RUNNING)
        await wait_for_state(engine, EngineState.RUNNING)
        result = await consume(engine, request("after", prompts(demo, 1)[0], max_tokens=4))
        assert len(result.tokens) == 4 and time.monotonic() - killed_at < 60
        assert engine.status == EngineStatus(EngineState.RUNNING, None, 1)
        deaths = [r for r in caplog.records if "died" in r.getMessage()]
        assert len(deaths) == 1 and "restarting it" in deaths[0].getMessage()  # logged once
    finally:
        engine.shutdown()
    assert engine.status.state is EngineState.STOPPED


async def test_an_engine_that_keeps_dying_stays_dead_until_reset(demo) -> None:
    engine = engine_with(QUICK, process=True)
    try:
        for restarts in range(QUICK.max_deaths - 1):
            kill(engine)
            await wait_for_state(engine, EngineState.RESTARTING, 30)
            await wait_for_state(engine, EngineState.RUNNING)
            assert engine.restarts == restarts + 1
        kill(engine)
        await wait_for_state(engine, EngineState.DEAD, 30)
        await asyncio.sleep(3 * QUICK.max_delay_s)
        assert engine.status.state is EngineState.DEAD and not engine.is_alive  # no restart came
        assert "ended unexpectedly" in engine.status.reason
        with pytest.raises(EngineDeadError, match="stopped on an internal error"):
            await engine.metrics()
        await engine.reset()  # /debug/reset_engine: a dead engine is restarted by hand
        assert engine.is_alive and engine.status == EngineStatus(EngineState.RUNNING, None, QUICK.max_deaths)
        assert len((await consume(engine, request("back", prompts(demo, 1)[0], max_tokens=3))).tokens) == 3
    finally:
        engine.shutdown()


async def test_restarts_off_leaves_it_dead(demo) -> None:
    engine = engine_with(RestartPolicy(enabled=False), process=True)
    try:
        kill(engine)
        await wait_for_state(engine, EngineState.DEAD, 30)
        await asyncio.sleep(0.5)
        assert engine.status.state is EngineState.DEAD and engine.restarts == 0
    finally:
        engine.shutdown()


async def test_a_thread_engine_whose_loop_died_is_restarted(demo) -> None:
    engine = engine_with(QUICK, process=False, name="threaded")
    try:
        old = engine.engine

        def broken_step() -> list:
            raise RuntimeError("a kernel fault")

        old.step = broken_step
        with pytest.raises(EngineDeadError, match="a kernel fault"):
            await consume(engine, request("x", prompts(demo, 1)[0], max_tokens=3))
        await wait_for_state(engine, EngineState.RUNNING)
        assert engine.engine is not old and engine.restarts == 1
        assert len((await consume(engine, request("y", prompts(demo, 1)[0], max_tokens=3))).tokens) == 3
    finally:
        engine.shutdown()


async def test_shutdown_stops_a_restart_from_happening(demo) -> None:
    engine = engine_with(RestartPolicy(first_delay_s=1.0), process=True)
    kill(engine)
    await wait_for_state(engine, EngineState.RESTARTING, 30)
    engine.shutdown()
    await asyncio.sleep(1.5)
    assert engine.status.state is EngineState.STOPPED and engine.restarts == 0 and not engine.is_alive
