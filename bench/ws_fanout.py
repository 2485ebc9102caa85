"""Many dashboard viewers of one engine while it serves load: delivery, latency, and their cost.

Starts ``manage.py serve`` (demo engine in its own process), signs in with the one-time link it
prints, then alternates rounds with ``--viewers`` websocket viewers of the engine page's socket
and rounds with none, the same streaming load in each. Reports:

* delivery: whether every viewer got every snapshot of the round, in order;
* latency: snapshot taken (its ``at``) to received by a viewer, p50/p99 over all deliveries;
* the server process's CPU per viewer-second, from /proc, with viewers against without;
* the engine's tokens/s with viewers against without (goal >= 0.95).

    python bench/ws_fanout.py                        # in-memory channel layer
    python bench/ws_fanout.py --redis redis://127.0.0.1:6379/2
    python bench/ws_fanout.py --pin                  # engine alone on CPU 0, all else on CPU 1

``--pin`` is for a small machine: there the viewer clients, the load generator and Redis would
otherwise share the engine's cores, and the ratio would measure them, not the server. The engine
process then runs one compute thread on the first CPU and everything else (server, bench, Redis)
shares the second, so the ratio says what the viewers cost the engine through the server.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import websockets
from cpu_threads import THREAD_VARIABLES  # bench/ is the script's folder, first on sys.path
from results_file import add_results_option, ResultsFile

REPO = Path(__file__).resolve().parents[1]
SERVER_LOG = Path(tempfile.gettempdir()) / "ws_fanout_server.log"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process ``pid`` (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def copy_lines(source: Any, path: Path) -> None:
    """Write every line of ``source`` to ``path`` as it comes."""
    with open(path, "w") as log:
        for line in source:
            log.write(line)
            log.flush()


def pin_process(pid: int, cpus: set[int]) -> None:
    """Pin every thread of process ``pid`` to ``cpus``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def children(pid: int) -> list[int]:
    """The direct child processes of ``pid``."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def redis_pid() -> int | None:
    """The local redis-server's pid, if one runs."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "comm").read_text().strip() == "redis-server":
                    return int(proc.name)
            except OSError:
                continue
    return None


def start_server(redis: str | None, one_thread: bool) -> tuple[subprocess.Popen, str, str]:
    """``serve`` on a free port; returns the process, its base URL and its one-time login path."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DATABASE_URL", "REDIS_URL")}
    env |= {"DEBUGSITE_VAR_DIR": tempfile.mkdtemp(prefix="bench-ws-"), "PYTHONUNBUFFERED": "1"}
    if one_thread:
        env |= {name: "1" for name in THREAD_VARIABLES}
    if redis:
        env["REDIS_URL"] = redis
    process = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port), "--backend", "cpu", "--enable-debug",
         "--max-num-seqs", "16", "--max-total-tokens", "16384", "--metrics-snapshot-interval", "0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        match = re.search(r"Dashboard\s+http://[^/]+(/dashboard/login/\S+)", line)
        if match:
            # Keep reading its log (into SERVER_LOG), or a full pipe would stall the server.
            threading.Thread(target=copy_lines, args=(process.stdout, SERVER_LOG), daemon=True).start()
            return process, f"http://127.0.0.1:{port}", match.group(1)
    raise SystemExit("serve exited before printing its dashboard link")


async def load(base: str, clients: int, seconds: float) -> int:
    """Streaming chat requests from ``clients`` clients for ``seconds``; returns tokens generated."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 64,
            "stream": True, "stream_options": {"include_usage": True}, "debug_config": {"ignore_eos": True}}
    deadline = time.monotonic() + seconds
    tokens = 0
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=clients)) as http:
        async def client() -> None:
            nonlocal tokens
            while time.monotonic() < deadline:
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and '"usage"' in line and '"choices":[]' in line:
                            tokens += orjson.loads(line[6:])["usage"]["completion_tokens"]

        await asyncio.gather(*(client() for _ in range(clients)))
    return tokens


async def viewer(url: str, cookie: str, origin: str, seen: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """One dashboard socket; records (snapshot at, received at) for each snapshot."""
    async with websockets.connect(url, additional_headers={"Cookie": cookie, "Origin": origin},
                                  max_queue=None) as ws:
        while not stop.is_set():
            try:
                raw = await asyncio.wait_for(ws.recv(), 0.5)
            except asyncio.TimeoutError:
                continue
            received = time.time()
            message = orjson.loads(raw)
            if message.get("type") == "snapshot":
                seen.append((message["at"], received))


async def round_with(base: str, cookie: str, viewers: int, clients: int, seconds: float, pid: int) -> dict:
    stop = asyncio.Event()
    logs: list[list[tuple[float, float]]] = [[] for _ in range(viewers)]
    ws_url = base.replace("http", "ws") + "/ws/engines/demo/"
    tasks = [asyncio.create_task(viewer(ws_url, cookie, base, log, stop)) for log in logs]
    # Every socket open (its first snapshot in) before the clock starts: on a loaded machine a
    # hundred sockets can take seconds to open.
    deadline = time.monotonic() + 60
    while not all(logs) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    tokens = await load(base, clients, seconds)
    wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
    stop.set()
    await asyncio.gather(*tasks)
    result = {"tok_s": tokens / wall, "cpu_s_per_s": cpu / wall}
    if viewers:
        union = sorted({at for log in logs for at, _ in log})
        all_open = max(log[0][0] for log in logs if log)  # the latest socket's first snapshot
        in_window = [at for at in union if all_open < at < union[-1] - 1]
        missed = sum(len(set(in_window) - {at for at, _ in log}) for log in logs)
        ordered = all([at for at, _ in log] == sorted(at for at, _ in log) for log in logs)
        # The snapshot a socket gets on opening is the sampler's latest, taken before: not a delivery.
        window = set(in_window)
        latencies = sorted(received - at for log in logs for at, received in log if at in window)
        result |= {"snapshots": len(in_window), "missed": missed, "ordered": ordered,
                   "p50_ms": 1000 * latencies[len(latencies) // 2],
                   "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)]}
    return result


def pin(server: subprocess.Popen, redis: str | None) -> None:
    """The engine process alone on CPU 0; the server, this bench and Redis on CPU 1."""
    engines = children(server.pid)
    if len(engines) != 1:
        raise SystemExit(f"--pin expects one engine process under the server, found {engines}")
    pin_process(engines[0], {0})
    for pid in (server.pid, os.getpid(), *([redis_pid()] if redis and redis_pid() else [])):
        pin_process(pid, {1})


async def main_async(args: argparse.Namespace) -> None:
    server, base, login = start_server(args.redis, one_thread=args.pin)
    try:
        async with httpx.AsyncClient(base_url=base) as http:
            # The links are printed before Daphne listens: wait until it answers.
            for _ in range(600):
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            response = await http.get(login)
            assert response.status_code == 302, response.text
            cookie = f"sessionid={response.cookies['sessionid']}"
            # The engine is up once it answers a request; only then has it every thread to pin.
            await http.post("/v1/completions", json={"model": "demo", "prompt": "warm up", "max_tokens": 4})
        if args.pin:
            pin(server, args.redis)
        rounds: dict[int, list[dict]] = {0: [], args.viewers: []}
        for _ in range(args.rounds):
            for viewers in (0, args.viewers):
                rounds[viewers].append(await round_with(base, cookie, viewers, args.clients, args.seconds,
                                                        server.pid))
        watched, alone = rounds[args.viewers], rounds[0]
        layer = "Redis" if args.redis else "in-memory"
        print(f"{args.viewers} viewers, {args.clients} streaming clients, {args.rounds} x {args.seconds:g} s rounds "
              f"alternated, {layer} channel layer{', engine pinned alone on CPU 0' if args.pin else ''}")
        missed = sum(r["missed"] for r in watched)
        print(f"  delivery: every snapshot to every viewer {missed == 0} ({missed} of "
              f"{sum(r['snapshots'] for r in watched) * args.viewers} deliveries missed), in order "
              f"{all(r['ordered'] for r in watched)} ({sum(r['snapshots'] for r in watched)} snapshots)")
        print(f"  latency snapshot -> viewer: p50 {statistics.median(r['p50_ms'] for r in watched):.1f} ms, "
              f"p99 {max(r['p99_ms'] for r in watched):.1f} ms (worst round)")
        tok_w = statistics.median(r["tok_s"] for r in watched)
        tok_a = statistics.median(r["tok_s"] for r in alone)
        cpu_w = statistics.median(r["cpu_s_per_s"] for r in watched)
        cpu_a = statistics.median(r["cpu_s_per_s"] for r in alone)
        print(f"  engine tokens/s: {tok_w:.0f} with viewers, {tok_a:.0f} without: ratio {tok_w / tok_a:.3f}")
        print(f"  server CPU: {cpu_w:.3f} vs {cpu_a:.3f} core-seconds/s: "
              f"{1000 * (cpu_w - cpu_a) / args.viewers:.2f} ms of CPU per viewer-second")
        results = ResultsFile(args.results, "ws_fanout")
        where = {"channel_layer": layer, "cores": "engine alone on CPU 0" if args.pin else "shared",
                 "viewers": args.viewers, "clients": args.clients}
        for metric, value, unit in (
            ("snapshots", sum(r["snapshots"] for r in watched), "snapshots"),
            ("missed deliveries", missed, "deliveries"),
            ("latency p50", statistics.median(r["p50_ms"] for r in watched), "ms"),
            ("latency p99 (worst round)", max(r["p99_ms"] for r in watched), "ms"),
            ("server CPU per viewer-second", 1000 * (cpu_w - cpu_a) / args.viewers, "ms"),
            ("engine, viewers", tok_w, "tok/s"), ("engine, none", tok_a, "tok/s"),
            ("engine, viewers/none", tok_w / tok_a, "ratio"),
        ):
            results.add(metric, value, unit, **where)
    finally:
        server.terminate()
        server.wait(60)
        if args.pin and args.redis and redis_pid():
            pin_process(redis_pid(), set(range(os.cpu_count() or 1)))  # the shared Redis back on every CPU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--viewers", type=int, default=100)
    parser.add_argument("--clients", type=int, default=8, help="streaming load clients (default 8)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of a round (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind, alternated (default 3)")
    parser.add_argument("--redis", help="REDIS_URL for the server's channel layer (default: in-memory)")
    parser.add_argument("--pin", action="store_true",
                        help="engine process (one compute thread) alone on CPU 0, everything else on CPU 1")
    add_results_option(parser, "ws_fanout")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
