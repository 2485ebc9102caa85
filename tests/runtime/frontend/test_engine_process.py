"""AsyncEngine with its engine loop in a child process (``process=True``, what ``serve`` runs)."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines.startup import ModelSpec, build_engines
from engines.runtime.frontend.async_engine import AsyncEngine, EngineDeadError
from engines.runtime.model.checkpoint import load_checkpoint
from engines.runtime.model.config import CheckpointError
from engines.runtime.model.demo_model import demo_checkpoint_path
from engines.runtime.core.engine import EngineConfig
from engines.runtime.core.request import EngineRequestError

from tests.processes import is_running
from tests.runtime.demo_engine import consume, lane_events, prompts, request

PROJECT_ROOT = Path(__file__).resolve().parents[3]
SIZING = EngineConfig(max_num_seqs=16, num_pages=128, prefill_chunk_size=128)


def process_engine(name: str = "demo", **kwargs) -> AsyncEngine:
    (engine,) = build_engines([ModelSpec("demo", name)], SIZING, backend="cpu", process=True, **kwargs)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine():
    engine = process_engine(enable_tracing=True)
    yield engine
    engine.shutdown()


@pytest.fixture
def lone_engine():
    """A process engine of this test's own, for tests that kill or strand it."""
    engine = process_engine("lone", restart=False)
    yield engine
    engine.shutdown()


def test_the_server_side_holds_no_weights_and_learns_the_backend_from_the_child(engine) -> None:
    assert engine.checkpoint.weights == {}
    assert (engine.backend_name, engine.dtype, engine.is_alive) == ("cpu", "float32", True)
    assert engine.engine is None  # the model lives in the other process
    assert engine._transport.process.pid != os.getpid()


async def test_greedy_output_matches_the_engine_on_a_thread(engine, demo) -> None:
    threaded = AsyncEngine(demo, "threaded", SIZING, backend="cpu")
    threaded.start()
    try:
        reqs = [request(f"same-{i}", p, max_tokens=12, ignore_eos=True)
                for i, p in enumerate(prompts(demo, 3))]
        here = await asyncio.gather(*(consume(threaded, r) for r in reqs))
        there = await asyncio.gather(*(consume(engine, r) for r in reqs))
    finally:
        threaded.shutdown()
    assert [r.tokens for r in there] == [r.tokens for r in here]
    assert [r.text for r in there] == [r.text for r in here]
    assert all(len(r.tokens) == 12 and r.usage["completion_tokens"] == 12 for r in there)


async def test_bad_requests_fail_before_the_first_output_and_the_engine_serves_on(engine, demo) -> None:
    prompt = prompts(demo, 1)[0]
    with pytest.raises(EngineRequestError, match="outside the vocabulary"):  # checked on this side
        await consume(engine, request("bad-token", [10**6]))
    with pytest.raises(EngineRequestError, match="response_format"):  # only the engine's grammar compiler knows
        await consume(engine, request("bad-schema", prompt, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}))
    assert (await consume(engine, request("after", prompt, max_tokens=2))).usage["completion_tokens"] == 2


async def test_closing_a_stream_aborts_it_and_frees_its_pages(engine, demo) -> None:
    stream = engine.generate(request("walk-away", prompts(demo, 1)[0], max_tokens=500,
                                     ignore_eos=True))
    await anext(stream)
    assert (await engine.metrics())["kv_pages_used"] > 0
    await stream.aclose()
    for _ in range(200):
        if (await engine.metrics())["kv_pages_used"] == 0:
            break
        await asyncio.sleep(0.01)
    m = await engine.metrics()
    assert (m["kv_pages_used"], m["num_running_requests"]) == (0, 0)


async def test_reset_aborts_streams_and_zeroes_metrics_before_returning(engine, demo) -> None:
    await consume(engine, request("done-before", prompts(demo, 1)[0], max_tokens=2))
    assert (await engine.metrics())["num_finished_requests"] >= 1
    tasks = [asyncio.create_task(consume(engine, request(f"live-{i}", p, max_tokens=500,
                                                         ignore_eos=True)))
             for i, p in enumerate(prompts(demo, 3))]
    while (await engine.metrics())["num_running_requests"] < 3:
        await asyncio.sleep(0.01)
    await engine.reset()
    m = await engine.metrics()
    assert (m["num_finished_requests"], m["num_running_requests"], m["kv_pages_used"]) == (0, 0, 0)
    assert all(r.finish_reason == "abort" for r in await asyncio.gather(*tasks))


async def test_cached_prompt_tokens_and_a_prefix_cache_reset_cross_the_process_boundary(engine, demo) -> None:
    await engine.reset()
    shared = prompts(demo, 1, length=48, seed=5)[0]
    await consume(engine, request("warm", shared + [400], max_tokens=2))
    hit = await consume(engine, request("hit", shared + [401], max_tokens=2))
    assert hit.usage["prompt_tokens_details"] == {"cached_tokens": 48}
    assert await engine.reset_prefix_cache() == {"dropped_pages": 3, "pinned_pages": 0}
    cold = await consume(engine, request("cold", shared + [402], max_tokens=2))
    assert cold.usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_server_events_and_engine_events_share_one_timeline(engine, demo) -> None:
    await engine.dump_trace(clear=True)
    assert await engine.dump_trace(skip_empty=True) is None
    engine.record_server_event("timed", "receive request")
    engine.record_server_event("timed", "start tokenization")
    engine.record_server_event("timed", "finish tokenization", {"prompt_tokens": 5})
    await consume(engine, request("timed", prompts(demo, 1)[0], max_tokens=3))
    trace = json.loads(await engine.dump_trace(clear=True))
    lane = lane_events(trace, "timed")
    names = [e["name"] for e in lane]
    # The queue opens when the front end took the request (a server's view stamps it at its arrival).
    assert names[:5] == ["receive request", "tokenization (0)", "tokenization (0)", "queue (0)",
                         "request added to engine"]
    assert "prefill (0)" in names and "finish" in names
    stamps = [e["ts"] for e in lane]
    assert stamps == sorted(stamps)
    # Taken on two clocks a pipe apart, yet in order and close: the child uses the server's anchor.
    assert 0 <= stamps[3] - stamps[2] < 2_000_000
    assert await engine.dump_trace(skip_empty=True) is None  # clear=True took everything


async def test_a_live_reader_follows_the_engine_process_trace_mid_stream(engine, demo) -> None:
    """``trace_since`` crosses the process boundary as a typed TraceDelta, answered while the
    engine is busy, and what a reader collects is what the dump holds."""
    from engines.runtime import TraceDelta
    from engines.runtime.telemetry.chrome_trace_reference import export_dict
    from engines.runtime.telemetry.trace_window import TraceWindow

    await engine.dump_trace(clear=True)
    start = await engine.trace_since(0)
    assert isinstance(start, TraceDelta) and start.calls == 0
    cursor, calls = start.cursor, []
    stream = asyncio.ensure_future(consume(engine, request("live", prompts(demo, 1)[0], max_tokens=24)))
    while not stream.done():   # read while the request runs
        delta = await engine.trace_since(cursor)
        assert delta.missed == 0 and delta.recorder == start.recorder
        calls += json.loads(delta.calls_json)
        cursor = delta.cursor
        await asyncio.sleep(0.005)
    await stream
    delta = await engine.trace_since(cursor)
    calls += json.loads(delta.calls_json)
    assert [c[2] for c in calls][:2] == ["request added to engine", "start queue"]
    window = TraceWindow([(ts * 1000, tuple(ids), ev, args, lane) for ts, ids, ev, args, lane in calls],
                         delta.now_us * 1000, 0, 0, 1, "demo", "", "", "")
    rebuilt = [e for e in export_dict(window)["traceEvents"] if e["ph"] != "M"]
    dumped = [e for e in json.loads(await engine.dump_trace(clear=True))["traceEvents"] if e["ph"] != "M"]
    assert rebuilt == dumped
    with pytest.raises(ValueError, match="ahead"):
        await engine.trace_since(cursor + 10**9)


async def test_a_profile_of_the_engine_process_comes_back_whole(engine, demo) -> None:
    """The profiler runs in the engine's process; its status is answered mid-stream, and the
    result crosses back typed, with the steps of the request that ran meanwhile."""
    from engines.runtime import ProfileResult, ProfilerStateError

    started = await engine.profile_start(max_seconds=30, stack_sampling=True)
    assert started.running and started.stack_sampling
    with pytest.raises(ProfilerStateError, match="already running"):
        await engine.profile_start()
    stream = asyncio.ensure_future(consume(engine, request("profiled", prompts(demo, 1)[0], max_tokens=16)))
    seen = 0
    while not stream.done():
        seen = max(seen, (await engine.profile_status()).steps)
        await asyncio.sleep(0.01)
    await stream
    result = await engine.profile_stop()
    assert isinstance(result, ProfileResult) and result.engine == engine.name and result.backend == "cpu"
    assert len(result.steps) >= max(seen, 16) and result.stacks["samples"] > 0
    assert {"attention", "embedding"} <= {k["name"] for k in result.kernels}
    with pytest.raises(ProfilerStateError):
        await engine.profile_stop()


async def test_sigterm_to_the_service_leaves_the_engine_to_its_server(engine, demo) -> None:
    """systemd signals every process of a service; the engine stops when its server tells it to
    (after the server saved the last trace window), not on the signal."""
    os.kill(engine._transport.process.pid, signal.SIGTERM)
    await asyncio.sleep(0.2)
    assert engine.is_alive
    assert (await consume(engine, request("after-sigterm", prompts(demo, 1)[0], max_tokens=2))).usage


def test_blocking_calls_for_code_without_an_event_loop(engine) -> None:
    assert "num_finished_requests" in engine.metrics_blocking(timeout=30)
    assert isinstance(engine.dump_trace_blocking(timeout=30), bytes)


async def kill_mid_stream(engine: AsyncEngine, demo, request_id: str) -> None:
    """SIGKILL the engine process while a request streams; its stream must fail, not hang."""
    stream = asyncio.create_task(consume(engine, request(
        request_id, prompts(demo, 1)[0], max_tokens=500, ignore_eos=True)))
    while (await engine.metrics())["num_running_requests"] < 1:
        await asyncio.sleep(0.01)
    os.kill(engine._transport.process.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="ended unexpectedly"):
        await asyncio.wait_for(stream, 30)
    assert not engine.is_alive


async def test_a_killed_engine_process_fails_its_streams_and_calls_instead_of_hanging(lone_engine, demo) -> None:
    await kill_mid_stream(lone_engine, demo, "victim")
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(lone_engine.metrics(), 30)
    with pytest.raises(EngineDeadError):
        await consume(lone_engine, request("after-death", prompts(demo, 1)[0]))


def test_the_engine_process_stops_when_its_server_is_killed(tmp_path) -> None:
    """No orphan holding a GPU: a server killed with SIGKILL closes the socket, and the engine exits."""
    script = (
        "import sys\n"
        "from engines.startup import ModelSpec, build_engines\n"
        "from engines.runtime.core.engine import EngineConfig\n"
        "(e,) = build_engines([ModelSpec('demo')], EngineConfig(num_pages=16), backend='cpu', process=True)\n"
        "e.start()\n"
        "print(e._transport.process.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    server = subprocess.Popen([sys.executable, "-c", script], cwd=PROJECT_ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(server.stdout.readline())
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and is_running(child):
            time.sleep(0.05)
        assert not is_running(child)
    finally:
        server.kill()
        server.wait(10)


def test_a_checkpoint_that_fails_in_the_engine_process_raises_at_start(tmp_path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(demo_checkpoint_path(), broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:1000])  # truncated: the header no longer fits
    load_checkpoint(broken, load_weights=False)  # the server side cannot tell
    (engine,) = build_engines([ModelSpec(str(broken))], SIZING, backend="cpu", process=True)
    with pytest.raises(CheckpointError, match="safetensors"):
        engine.start()
    assert not engine.is_alive


async def test_shutting_down_a_stuck_engine_process_ends_its_streams_and_calls(lone_engine, demo) -> None:
    stream = lone_engine.generate(request("stuck", prompts(demo, 1)[0], max_tokens=500,
                                          ignore_eos=True))
    await anext(stream)
    os.kill(lone_engine._transport.process.pid, signal.SIGSTOP)  # a hung kernel, say
    call = asyncio.create_task(lone_engine.reset())

    async def drain() -> None:  # outputs sent before the stop may still be queued: read past them
        async for _ in stream:
            pass

    rest = asyncio.create_task(drain())
    await asyncio.sleep(0.1)
    await asyncio.to_thread(lone_engine.shutdown, 1.0)  # kills it after 1 s
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(call, 10)
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(rest, 10)


async def test_an_engine_restarted_after_shutdown_still_reports_its_death(lone_engine, demo) -> None:
    lone_engine.shutdown()
    lone_engine.start()
    await kill_mid_stream(lone_engine, demo, "second-life")


@pytest.mark.parametrize("process", [True, False], ids=["process", "thread"])
async def test_a_request_id_reused_right_after_a_disconnect_gets_its_own_output(demo, process) -> None:
    """A client that reuses its ``user`` as the id at once must not receive the old request's abort."""
    reused = process_engine("reuse") if process else AsyncEngine(demo, "reuse", SIZING, backend="cpu")
    if not process:
        reused.start()
    try:
        prompt = prompts(demo, 1)[0]
        first = reused.generate(request("alice", prompt, max_tokens=400, ignore_eos=True))
        await anext(first)
        await first.aclose()  # the client went away
        again = await consume(reused, request("alice", prompt, max_tokens=5, ignore_eos=True))
        assert (again.finish_reason, len(again.tokens)) == ("length", 5)
    finally:
        reused.shutdown()


async def test_a_wedged_engine_is_left_out_of_a_scrape_instead_of_hanging_it(lone_engine, monkeypatch) -> None:
    from engines.views import metrics as metrics_view

    monkeypatch.setattr(metrics_view, "READ_TIMEOUT_S", 0.5)
    os.kill(lone_engine._transport.process.pid, signal.SIGSTOP)
    try:
        assert await asyncio.wait_for(metrics_view.read_engines([lone_engine]), 10) == []
    finally:
        os.kill(lone_engine._transport.process.pid, signal.SIGCONT)
    # Resumed, it answers (given the usual time: on a loaded machine a process just woken may take
    # more than half a second to be scheduled and answer, which once failed this test).
    monkeypatch.setattr(metrics_view, "READ_TIMEOUT_S", 10.0)
    assert [r.engine for r in await metrics_view.read_engines([lone_engine])] == [lone_engine]


def test_starting_an_engine_shortens_the_gil_switch_interval(demo) -> None:
    """The server side's reader thread (and an engine thread) must not wait 5 ms for the GIL behind
    a busy event loop; ``start`` shortens the interval, and never lengthens a shorter one."""
    from engines.runtime.frontend import engine_core

    previous = sys.getswitchinterval()
    engine = AsyncEngine(demo, "switch", SIZING, backend="cpu")
    try:
        sys.setswitchinterval(0.005)
        engine.start()
        assert sys.getswitchinterval() == engine_core.GIL_SWITCH_INTERVAL_S
        sys.setswitchinterval(0.0001)
        shorter = sys.getswitchinterval()  # CPython keeps microseconds: 0.0001 reads back a hair under
        engine_core.shorten_gil_switch()
        assert sys.getswitchinterval() == shorter
    finally:
        engine.shutdown()
        sys.setswitchinterval(previous)
