"""How long an engine takes to come back, and a server to drain: the figures of a crash and a stop.

* **Restart**: an engine process (as ``manage.py serve`` runs it) is SIGKILLed; the time from the
  kill to the first token of a new request, retried until the engine answers. Medians over
  ``--restarts`` kills, with the restart policy's first delay reported beside it.
* **Drain**: ``manage.py serve`` with ``--clients`` streams in flight gets SIGTERM; the time until
  every stream has its ``[DONE]`` and until the process has exited, with ``--drain-timeout``
  (the streams are long, so the drain always runs to its timeout and then ends them).

    python bench/engine_lifecycle.py                       # CPU, demo model
    python bench/engine_lifecycle.py --clients 32 --drain-timeout 2
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results_file import add_results_option, ResultsFile  # noqa: E402
from engines.runtime import (  # noqa: E402
    AsyncEngine,
    EngineConfig,
    GenerationRequest,
    RestartPolicy,
    SamplingParams,
    demo_checkpoint_path,
    load_checkpoint,
)

SIZING = EngineConfig(max_num_seqs=32, max_total_tokens=8192, prefill_chunk_size=256)


async def first_token_s(engine, started: float, prompt: list[int]) -> float:
    """Seconds from ``started`` until a new request's first output, retrying while the engine is down."""
    from engines.runtime import EngineDeadError

    attempt = 0
    while True:
        attempt += 1
        request = GenerationRequest(f"probe-{attempt}-{time.monotonic_ns()}", prompt,
                                    SamplingParams(temperature=0.0, max_tokens=1))
        try:
            async for _ in engine.generate(request):
                return time.monotonic() - started
        except EngineDeadError:
            await asyncio.sleep(0.01)


async def measure_restarts(count: int) -> list[float]:
    # serve's policy, but no crash-loop guard: the kills here are on purpose.
    policy = RestartPolicy(max_deaths=count + 1)
    engine = AsyncEngine(load_checkpoint(demo_checkpoint_path(), load_weights=False), "bench", SIZING,
                         backend="cpu", process=True, restart=policy)
    engine.start()
    prompt = engine.tokenizer.encode("Once upon a time")
    times = []
    try:
        for _ in range(count):
            await first_token_s(engine, time.monotonic(), prompt)  # up and serving
            killed = time.monotonic()
            os.kill(engine._transport.process.pid, signal.SIGKILL)
            times.append(await first_token_s(engine, killed, prompt))
    finally:
        engine.shutdown()
    return times


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def measure_drain(clients: int, drain_timeout: float) -> tuple[float, float, int]:
    """(seconds to the last [DONE], seconds to the process's exit, streams that got [DONE])."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DATABASE_URL")}
    env["DEBUGSITE_VAR_DIR"] = tempfile.mkdtemp(prefix="bench-drain-")
    server = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port), "--backend", "cpu", "--enable-debug",
         "--max-num-seqs", str(max(clients, 1)), "--max-total-tokens", "65536", "--drain-timeout", str(drain_timeout),
         "--metrics-snapshot-interval", "0"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=120,
                                     limits=httpx.Limits(max_connections=clients + 4)) as http:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not start")
                await asyncio.sleep(0.2)
            body = {"model": "demo", "messages": [{"role": "user", "content": "Tell me everything."}],
                    "max_tokens": 1500, "stream": True, "debug_config": {"ignore_eos": True}}
            started = asyncio.Event()
            streaming = 0
            done_at: list[float] = []

            async def client(i: int) -> None:
                nonlocal streaming
                async with http.stream("POST", "/v1/chat/completions", json={**body, "user": f"c{i}"}) as r:
                    first = True
                    async for line in r.aiter_lines():
                        if first and line.startswith("data: "):
                            first = False
                            streaming += 1
                            if streaming == clients:
                                started.set()
                        if line == "data: [DONE]":
                            done_at.append(time.monotonic())

            tasks = [asyncio.create_task(client(i)) for i in range(clients)]
            await asyncio.wait_for(started.wait(), 120)
            signalled = time.monotonic()
            server.send_signal(signal.SIGTERM)
            await asyncio.gather(*tasks, return_exceptions=True)
            exit_code = await asyncio.to_thread(server.wait, 60)
            exited = time.monotonic()
            if exit_code != 0:
                raise SystemExit(f"the server exited with {exit_code}")
            return max(done_at) - signalled if done_at else float("nan"), exited - signalled, len(done_at)
    finally:
        if server.poll() is None:
            server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=5, help="kills to time (default 5)")
    parser.add_argument("--clients", type=int, default=32, help="streams in flight at SIGTERM (default 32)")
    parser.add_argument("--drain-timeout", type=float, default=2.0, help="serve's --drain-timeout (default 2)")
    add_results_option(parser, "engine_lifecycle")
    args = parser.parse_args()
    results = ResultsFile(args.results, "engine_lifecycle")

    times = asyncio.run(measure_restarts(args.restarts))
    print(f"restart, kill to first token: median {statistics.median(times):.2f} s "
          f"(min {min(times):.2f}, max {max(times):.2f}; {len(times)} kills; first retry after "
          f"{RestartPolicy().first_delay_s:g} s)")
    for statistic, value in (("median", statistics.median(times)), ("min", min(times)), ("max", max(times))):
        results.add("restart: kill to first token", value, "s", statistic=statistic, kills=len(times))
    done, exited, streams = asyncio.run(measure_drain(args.clients, args.drain_timeout))
    print(f"drain, {args.clients} streams, --drain-timeout {args.drain_timeout:g}: every stream's [DONE] "
          f"{done:.2f} s after SIGTERM ({streams}/{args.clients} streams ended cleanly), process exit {exited:.2f} s")
    where = {"clients": args.clients, "drain_timeout": args.drain_timeout}
    results.add("drain: SIGTERM to every stream's [DONE]", done, "s", **where)
    results.add("drain: streams ended cleanly", streams, "streams", **where)
    results.add("drain: SIGTERM to process exit", exited, "s", **where)


if __name__ == "__main__":
    main()
