"""A soak with faults: a real server under a mixed, bounded, loopback-only load for ``--minutes``,
while an engine process is killed, the engine is reset under load, traces are saved, and its own
Redis and PostgreSQL go away and come back; then the checks (issue 42), printed and written as JSON.

This first version starts its own Redis (``redis-server``) and PostgreSQL (``initdb`` + ``pg_ctl``
as the postgres user) on spare ports, so the machine's shared ones are never touched, and
``manage.py serve`` on them (the demo engine in its own process, tracing on, trace autosave and
metrics snapshots on, the Redis channel layer and fleet). Load: streaming and non-streaming chat
and completions with varied sampling, a greedy fixed-seed probe, clients that drop mid-stream,
bursts. Faults, in turn every ``--fault-every`` seconds: engine SIGKILL, reset under load, trace
save, Redis stopped for ``--outage`` seconds, PostgreSQL stopped for ``--outage`` seconds.

Checks: no 5xx but 503; every stream that was read to its end ends with a finish reason and
[DONE]; the greedy probe's text is the same before and after every fault; at idle no KV page in
use and nothing running or waiting; every acknowledged trace save is in PostgreSQL with its CRC
intact; server and engine RSS, open files and threads of the last third within 10% of the first
third (after warm-up); event-loop lag is not measured yet.

    python bench/soak.py --minutes 30
    python bench/soak.py --minutes 3 --fault-every 20 --outage 10   # short
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from results_file import ResultsFile, add_results_option  # bench/ is the script's folder, first on sys.path
from servers import REPO, free_port, wait_healthy

PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), Path("/usr/lib/postgresql/bin"))
PROBE = {"model": "demo", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 16, "temperature": 0, "seed": 7}


class Services:
    """A Redis and a PostgreSQL of the soak's own, on spare ports, that it can stop and start."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.redis_port, self.pg_port = free_port(), free_port()
        self.pg_data = root / "pg"
        self.redis: subprocess.Popen | None = None

    def start_redis(self) -> None:
        self.redis = subprocess.Popen(["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                                       "--save", "", "--appendonly", "no", "--dir", str(self.root)],
                                      stdout=subprocess.DEVNULL)
        time.sleep(0.3)

    def stop_redis(self) -> None:
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(10)
            self.redis = None

    def _as_postgres(self, *command: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *command], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    def init_pg(self) -> None:
        self.pg_data.mkdir(parents=True)
        shutil.chown(self.root, "postgres")
        shutil.chown(self.pg_data, "postgres")
        self._as_postgres(str(PG_BIN / "initdb"), "-D", str(self.pg_data), "-A", "trust", "-U", "postgres")
        self.start_pg()

    def start_pg(self) -> None:
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.pg_data), "-w", "-o",
                          f"-p {self.pg_port} -k {self.pg_data} -c listen_addresses=127.0.0.1", "start")

    def stop_pg(self) -> None:
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.pg_data), "-m", "fast", "-w", "stop")

    @property
    def env(self) -> dict[str, str]:
        return {"REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
                "DATABASE_URL": f"postgres://postgres@127.0.0.1:{self.pg_port}/postgres"}


def process_figures(pid: int) -> dict[str, float]:
    """RSS (MiB), open files and threads of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024
    threads = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:"))
    return {"rss_mib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}


def engine_pid(server_pid: int) -> int | None:
    for child in Path(f"/proc/{server_pid}/task").glob("*/children"):
        for pid in child.read_text().split():
            if Path(f"/proc/{pid}/cmdline").read_bytes().endswith(b"engine=demo\0"):
                return int(pid)
    return None


class Tally:
    """What the clients saw."""

    def __init__(self) -> None:
        self.requests = self.tokens = self.dropped = 0
        self.status: dict[int, int] = {}
        self.bad: list[str] = []        # 5xx other than 503, streams without an end, bodies without a reason
        self.probes: list[tuple[float, str]] = []

    def saw(self, status: int, what: str = "") -> None:
        self.status[status] = self.status.get(status, 0) + 1
        if status >= 500 and status != 503:
            self.bad.append(f"{status}: {what[:200]}")


async def one_request(client: httpx.AsyncClient, tally: Tally, rng: random.Random) -> None:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.6
    body: dict[str, Any] = {"model": "demo", "max_tokens": rng.choice([4, 16, 48]), "stream": stream,
                            "temperature": rng.choice([0, 0.7, 1.0]), "top_p": rng.choice([1.0, 0.9]),
                            "seed": rng.randint(0, 1000)}
    prompt = " ".join(["soak"] * rng.choice([2, 20, 200]))
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    tally.requests += 1
    try:
        if not stream:
            reply = await client.post(path, json=body)
            tally.saw(reply.status_code, reply.text)
            if reply.status_code == 200:
                choice = reply.json()["choices"][0]
                if not choice.get("finish_reason"):
                    tally.bad.append(f"no finish reason: {reply.text[:200]}")
                tally.tokens += reply.json()["usage"]["completion_tokens"]
            return
        drop = rng.random() < 0.1
        async with client.stream("POST", path, json=body) as reply:
            tally.saw(reply.status_code, "")
            if reply.status_code != 200:
                await reply.aread()
                return
            lines, finished = [], False
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    compact = line.replace(" ", "")
                    if '"finish_reason":"' in compact:
                        finished = True
                    tally.tokens += 1
                if drop and len(lines) > 2:
                    tally.dropped += 1
                    return  # a client gone mid-stream
            # An engine that died mid-stream ends it with a 503 error object, then [DONE] (documented).
            errored = len(lines) >= 2 and '"code":503' in lines[-2].replace(" ", "")
            if lines[-1:] != ["[DONE]"] or not (finished or errored):
                tally.bad.append(f"stream ended without a finish reason and [DONE]: {lines[-2:]}")
    except httpx.HTTPError as exc:
        tally.bad.append(f"transport: {type(exc).__name__}: {exc}"[:200])


async def load(base: str, tally: Tally, stop: asyncio.Event, clients: int) -> None:
    rng = random.Random(42)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def worker(n: int) -> None:
            local = random.Random(n)
            while not stop.is_set():
                await one_request(client, tally, local)
        tasks = [asyncio.create_task(worker(n)) for n in range(clients)]
        next_burst = time.monotonic() + 60
        while not stop.is_set():
            await asyncio.sleep(1)
            if time.monotonic() > next_burst:  # a burst of concurrent requests
                await asyncio.gather(*(one_request(client, tally, rng) for _ in range(50)))
                next_burst = time.monotonic() + 120
        await asyncio.gather(*tasks, return_exceptions=True)


async def probe(base: str) -> str:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        for _ in range(60):
            reply = await client.post("/v1/completions", json=PROBE)
            if reply.status_code == 200:
                return reply.json()["choices"][0]["text"]
            await asyncio.sleep(1)
    return "(no answer)"


async def soak(args: argparse.Namespace, services: Services, server: subprocess.Popen, base: str) -> dict[str, Any]:
    tally, stop = Tally(), asyncio.Event()
    samples: list[dict[str, Any]] = []
    saves: list[int] = []
    faults: list[tuple[float, str, str]] = []
    first = await probe(base)
    loader = asyncio.create_task(load(base, tally, stop, args.clients))
    started = time.monotonic()
    end = started + args.minutes * 60
    cycle = ["kill engine", "reset", "save trace", "redis down", "postgres down"]
    next_fault, turn = started + args.fault_every, 0
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        while time.monotonic() < end:
            await asyncio.sleep(1)
            pid = engine_pid(server.pid)
            sample = {"t": time.monotonic() - started, "server": process_figures(server.pid)}
            if pid:
                sample["engine"] = process_figures(pid)
            samples.append(sample)
            if time.monotonic() < next_fault:
                continue
            fault = cycle[turn % len(cycle)]
            turn += 1
            at = time.monotonic() - started
            outcome = ""
            if fault == "kill engine" and pid:
                os.kill(pid, signal.SIGKILL)
            elif fault == "reset":
                outcome = str((await http.post("/debug/reset_engine", json={"model": "demo"})).status_code)
            elif fault == "save trace":
                reply = await http.post("/debug/save_event_trace", json={"model": "demo", "note": "soak"})
                outcome = str(reply.status_code)
                if reply.status_code == 200:
                    saves.append(int(reply.json()["id"]))
            elif fault == "redis down":
                services.stop_redis()
                await asyncio.sleep(args.outage)
                services.start_redis()
            elif fault == "postgres down":
                services.stop_pg()
                reply = await http.post("/debug/save_event_trace", json={"model": "demo", "note": "pg down"})
                outcome = f"save while down: {reply.status_code} {reply.text[:120]}"
                await asyncio.sleep(args.outage)
                services.start_pg()
            faults.append((at, fault, outcome))
            tally.probes.append((at, await probe(base)))
            next_fault = time.monotonic() + args.fault_every
    stop.set()
    await loader
    await asyncio.sleep(5)  # idle
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        metrics = (await http.post("/debug/dump_engine_metrics", json={"model": "demo"})).json()
    return {"tally": tally, "samples": samples, "saves": saves, "faults": faults, "first_probe": first,
            "idle_metrics": metrics}


def verify_saves(services: Services, saves: list[int]) -> list[str]:
    """Every acknowledged save in PostgreSQL, its payload's CRC intact."""
    import psycopg
    import zlib

    missing = []
    with psycopg.connect(services.env["DATABASE_URL"]) as conn:
        for pk in saves:
            row = conn.execute("SELECT payload, payload_crc32 FROM engines_tracerecord WHERE id = %s", (pk,)).fetchone()
            if row is None:
                missing.append(f"trace #{pk} acknowledged, not stored")
            elif row[1] is not None and zlib.crc32(bytes(row[0])) != row[1]:
                missing.append(f"trace #{pk}: CRC mismatch")
    return missing


def flat(samples: list[dict[str, Any]], who: str, key: str) -> tuple[float, float, bool]:
    values = [s[who][key] for s in samples if who in s]
    if len(values) < 6:
        return float("nan"), float("nan"), True
    third = len(values) // 3
    first, last = statistics.median(values[:third]), statistics.median(values[-third:])
    return first, last, last <= first * 1.10 + (2 if key != "rss_mib" else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--fault-every", type=float, default=120.0, help="seconds between faults (default 120)")
    parser.add_argument("--outage", type=float, default=60.0, help="seconds Redis or PostgreSQL stays down (60)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--json", type=Path, help="write the checks and figures here")
    add_results_option(parser, "soak")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="soak-"))
    services = Services(root)
    services.start_redis()
    services.init_pg()
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DJANGO_SETTINGS_MODULE")} | services.env \
        | {"DEBUGSITE_VAR_DIR": str(root / "var"), "PYTHONUNBUFFERED": "1", "FLEET_NAME": "soak"}
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)
    port = free_port()
    log = open(root / "server.log", "w")
    server = subprocess.Popen([sys.executable, "manage.py", "serve", "--model", "demo", "--backend", "cpu",
                               "--enable-debug", "--enable-tracing", "--trace-autosave", "60",
                               "--metrics-snapshot-interval", "30", "--port", str(port)],
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, base)
        result = asyncio.run(soak(args, services, server, base))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        log.close()
    tally: Tally = result["tally"]
    text = (root / "server.log").read_text()
    tracebacks = text.count("Traceback (most recent call last)")
    idle = result["idle_metrics"]
    idle_metrics = idle.get("metrics", idle) if isinstance(idle, dict) else {}
    probes_same = all(p == result["first_probe"] for _, p in tally.probes)
    checks = {
        "no 5xx but 503, streams end with a reason and [DONE]": (not tally.bad, tally.bad[:5]),
        "no traceback in the server's log": (tracebacks == 0, tracebacks),
        "greedy probe unchanged by every fault": (probes_same, [p[:40] for _, p in tally.probes][:6]),
        "idle: no KV page in use, nothing running or waiting": (
            idle_metrics.get("kv_pages_used") == 0 and idle_metrics.get("num_running_requests") == 0
            and idle_metrics.get("num_waiting_requests") == 0,
            {k: idle_metrics.get(k) for k in ("kv_pages_used", "num_running_requests", "num_waiting_requests")}),
        "every acknowledged trace save stored whole": (not (missing := verify_saves(services, result["saves"])),
                                                       missing or len(result["saves"])),
    }
    for who in ("server", "engine"):
        for key in ("rss_mib", "fds", "threads"):
            first, last, ok = flat(result["samples"], who, key)
            checks[f"{who} {key} flat (last third within 10% of the first)"] = (ok, f"{first:.0f} -> {last:.0f}")
    services.stop_redis()
    services.stop_pg()
    print(f"{args.minutes:g} min: {tally.requests} requests, {tally.tokens} tokens, {tally.dropped} dropped by "
          f"their clients, statuses {tally.status}, {len(result['faults'])} faults")
    for at, fault, outcome in result["faults"]:
        print(f"  {at:7.1f} s  {fault:15s} {outcome}")
    for name, (ok, detail) in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
    results = ResultsFile(args.results, "soak")
    where = {"minutes": args.minutes, "fault_every": args.fault_every, "outage": args.outage}
    results.add("requests", tally.requests, "requests", **where)
    results.add("faults", len(result["faults"]), "faults", **where)
    results.add("checks failed", sum(1 for ok, _ in checks.values() if not ok), "checks", **where)
    if args.json:
        args.json.write_text(json.dumps({"checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in checks.items()},
                                         "faults": result["faults"], "samples": result["samples"]}, default=str))
    if not all(ok for ok, _ in checks.values()):  # the server's log, for whoever reads the failures
        kept = REPO / "var" / "soak-server.log"
        kept.parent.mkdir(exist_ok=True)
        shutil.copy(root / "server.log", kept)
        print(f"  the server's log: {kept}")
    shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if all(ok for ok, _ in checks.values()) else 1)


if __name__ == "__main__":
    main()
