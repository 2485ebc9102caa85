"""A soak with faults: a real server under a mixed, bounded, loopback-only load for ``--minutes``
while its engine is killed and reset, traces and profiles are taken, hostile bodies arrive, and
its own Redis and PostgreSQL go away and come back; then the checks (issue 42), printed as a
table and written as JSON.

It starts its own Redis (``redis-server``) and PostgreSQL (``initdb`` + ``pg_ctl`` as the
postgres user) on spare ports, so the machine's shared ones are never touched, and ``manage.py
serve`` on them: the demo engine in its own process with a small KV cache (preemption happens),
tracing, trace autosave and metrics snapshots, the Redis channel layer and fleet.

Load (``soak_clients``): clients sending streaming and non-streaming chat and completions with
every sampling option, structured output and ``n`` > 1, short prompts, long ones sharing a
prefix and long unique ones; one client reading slowly; one in ten streams dropped mid-way;
a burst of ``--burst`` concurrent requests every ``--burst-every`` s; dashboard viewers on
websockets coming, reading and going (some dropping the connection), live timelines following,
one page open throughout. Faults, one every ``--fault-every`` s in turn: engine SIGKILL, reset
under load, trace save, a profile, the trace cleared from the dashboard, hostile bodies, Redis
stopped for ``--outage`` s, PostgreSQL stopped for ``--outage`` s.

Checks: see :func:`checks`. Figures sampled every second: server and engine RSS, open files,
threads, KV pages in use, the server's event-loop lag (``llm_engine_event_loop_lag_seconds``).

    python bench/soak.py                                              # 30 minutes, the judge
    python bench/soak.py --minutes 2.5 --fault-every 8 --outage 8     # one of each fault (CI)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from results_file import ResultsFile, add_results_option  # bench/ is the script's folder, first on sys.path
from servers import REPO, free_port, wait_healthy
from soak_clients import MODEL, Tally, Viewers, hostile_bodies, load

PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), Path("/usr/lib/postgresql/bin"))
PROBE = {"model": MODEL, "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 16, "temperature": 0, "seed": 7}
FAULTS = ("kill engine", "reset", "save trace", "profile", "clear trace", "hostile bodies", "redis down",
          "postgres down")
#: Seconds after a fault ends that still count as its window (an engine's restart, a reconnect).
AFTERMATH_S = 10.0
#: The server's ``--metrics-prefix``, given to it so that the /metrics names read here are its.
METRICS_PREFIX = "llm_engine_"
#: The server's trace autosave period, seconds (``serve --trace-autosave``; ``--autosave-every``).
TRACE_AUTOSAVE_S = 60
#: The RSS/fds/threads comparison: warm-up left out, then the first and the last window.
WARMUP_S, WINDOW_S = 300.0, 600.0
LAG_LIMIT_S = 0.1


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


def children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").glob("*/children") for child in task.read_text().split()]


def engine_pid(server_pid: int) -> int | None:
    for pid in children(server_pid):
        if Path(f"/proc/{pid}/cmdline").read_bytes().endswith(b"engine=" + MODEL.encode() + b"\0"):
            return pid
    return None


def digest_pid(server_pid: int) -> int | None:
    for pid in children(server_pid):
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    return None


#: The kernel's TCP counters that say who ended a connection and why (/proc/net/netstat, /proc/net/snmp):
#: sampled every second, so that a connection error the clients see can be matched to its cause
#: (an overflowing listen queue, a socket closed with unread data, a reset).
TCP_COUNTERS = {"TcpExt": ("ListenOverflows", "ListenDrops", "TCPAbortOnData", "TCPAbortOnClose",
                           "TCPAbortOnTimeout", "TCPAbortOnMemory", "TCPReqQFullDrop", "TCPBacklogDrop"),
                "Tcp": ("AttemptFails", "EstabResets", "OutRsts", "InErrs")}


def tcp_counters() -> dict[str, int]:
    """The :data:`TCP_COUNTERS` of this network namespace (the server's: it is local)."""
    figures: dict[str, int] = {}
    for table in ("/proc/net/netstat", "/proc/net/snmp"):
        lines = Path(table).read_text().splitlines()
        for names, values in zip(lines[::2], lines[1::2], strict=True):
            kind, *keys = names.split()
            for key, value in zip(keys, values.split()[1:], strict=True):
                if key in TCP_COUNTERS.get(kind.rstrip(":"), ()):
                    figures[key] = int(value)
    return figures


def tcp_counter_changes(samples: list[dict[str, Any]], start: float = 0.0, end: float = float("inf")) -> dict[str, int]:
    """How the TCP counters moved between the samples at ``start`` and ``end`` (soak seconds); only those that did."""
    inside = [s["tcp"] for s in samples if "tcp" in s and start <= s["t"] <= end]
    if len(inside) < 2:
        return {}
    return {key: inside[-1][key] - inside[0][key] for key in inside[0] if inside[-1][key] != inside[0][key]}


@dataclass
class Run:
    """Everything the soak saw, for the checks."""

    tally: Tally = field(default_factory=Tally)
    viewers: Viewers = field(default_factory=Viewers)
    samples: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)  # at, until, fault, outcome, ok
    saves: list[int] = field(default_factory=list)
    profiles: list[int] = field(default_factory=list)
    first_probe: str = ""
    idle: dict[str, Any] = field(default_factory=dict)
    outage_pages: list[str] = field(default_factory=list)  # what history pages answered while PostgreSQL was away


async def probe(http: httpx.AsyncClient) -> str:
    """The greedy, fixed-seed probe's text (the engine may be restarting: asked until it answers)."""
    for _ in range(90):
        reply = await http.post("/v1/completions", json=PROBE)
        if reply.status_code == 200:
            return reply.json()["choices"][0]["text"]
        await asyncio.sleep(1)
    return "(no answer)"


async def sample(http: httpx.AsyncClient, server: subprocess.Popen, started: float) -> dict[str, Any]:
    """One second's figures: processes, KV pages in use, the event loop's lag histogram."""
    figures: dict[str, Any] = {"t": time.monotonic() - started, "server": process_figures(server.pid),
                               "tcp": tcp_counters()}
    pid = engine_pid(server.pid)
    if pid:
        figures["engine"] = process_figures(pid)
    digest = digest_pid(server.pid)
    if digest:  # the trace digest process (engines.history.digest): replaced every 20 saves, so not judged
        figures["digest"] = process_figures(digest)
    try:
        text = (await http.get("/metrics", timeout=10)).text
    except httpx.HTTPError:
        return figures
    figures["lag_buckets"] = _lag_buckets(text)
    used = re.search(rf'^{METRICS_PREFIX}kv_cache_pages_used\{{model="{MODEL}"\}} (\S+)$', text, re.M)
    if used:
        figures["kv_pages_used"] = float(used[1])
    return figures


TRANSPORT_AT = re.compile(r"transport at (\d+) s")
LAG_BUCKET = re.compile(rf'^{METRICS_PREFIX}event_loop_lag_seconds_bucket\{{le="([^"]+)"\}} (\S+)$', re.M)


def _lag_buckets(text: str) -> dict[str, float]:
    """The event loop's lag histogram in a /metrics text: ``le`` -> cumulative count."""
    return {m[1]: float(m[2]) for m in LAG_BUCKET.finditer(text)}


async def inject(fault: str, run: Run, http: httpx.AsyncClient, services: Services, server: subprocess.Popen,
                 args: argparse.Namespace, cookie: str) -> tuple[str, bool]:
    """Inject one fault; ``(what happened, whether it went as the server promises)``."""
    if fault == "kill engine":
        pid = engine_pid(server.pid)
        if pid is None:
            return "no engine process", False
        os.kill(pid, signal.SIGKILL)
        return f"pid {pid} killed", True
    if fault == "reset":
        reply = await http.post("/debug/reset_engine", json={"model": MODEL})
        return str(reply.status_code), reply.status_code in (200, 503)
    if fault == "save trace":
        reply = await http.post("/debug/save_event_trace", json={"model": MODEL, "note": "soak"})
        if reply.status_code == 200:
            run.saves.append(int(reply.json()["id"]))
        return str(reply.status_code), reply.status_code in (200, 409, 503)
    if fault == "profile":
        reply = await http.post("/debug/profile_start", json={"model": MODEL, "max_seconds": 60})
        if reply.status_code != 200:
            return f"start {reply.status_code} {reply.text[:120]}", reply.status_code == 503
        await asyncio.sleep(5)
        reply = await http.post("/debug/profile_stop", json={"model": MODEL})
        if reply.status_code == 200:
            run.profiles.append(int(reply.json()["profile_id"]))
        return f"stop {reply.status_code}", reply.status_code == 200
    if fault == "clear trace":
        action_id = f"clear-{len(run.faults)}"
        await run.viewers.act("clear_trace", action_id)
        for _ in range(100):
            if run.viewers.actions.get(action_id) in ("done", "error"):
                break
            await asyncio.sleep(0.1)
        outcome = run.viewers.actions.get(action_id, "no watcher")
        return f"dashboard clear_trace: {outcome}", outcome == "done"
    if fault == "hostile bodies":
        before = len(run.tally.hostile_bad)
        await hostile_bodies(http, run.tally)
        return f"{len(run.tally.hostile_bad) - before} answered wrongly", len(run.tally.hostile_bad) == before
    if fault == "redis down":
        services.stop_redis()
        await asyncio.sleep(args.outage / 2)
        serving = await http.post("/v1/completions", json=PROBE)  # the API does not need Redis
        await asyncio.sleep(args.outage / 2)
        services.start_redis()
        return f"the API meanwhile: {serving.status_code}", serving.status_code == 200
    if fault == "postgres down":
        services.stop_pg()
        await asyncio.sleep(2)
        save = await http.post("/debug/save_event_trace", json={"model": MODEL, "note": "pg down"})
        page = await http.get("/admin/engines/tracerecord/", headers={"Cookie": cookie})
        serving = await http.post("/v1/completions", json=PROBE)  # nor PostgreSQL
        run.outage_pages.append(f"{page.status_code}")
        await asyncio.sleep(max(0.0, args.outage - 2))
        services.start_pg()
        back = await _page_back(http, cookie)
        ok = save.status_code == 503 and page.status_code == 503 and serving.status_code == 200 and back
        return (f"save {save.status_code}, history page {page.status_code}, the API {serving.status_code}, "
                f"history page back: {back}"), ok
    raise ValueError(fault)


async def _page_back(http: httpx.AsyncClient, cookie: str) -> bool:
    """Whether the history page answers again within 30 s of the database's return."""
    for _ in range(30):
        if (await http.get("/admin/engines/tracerecord/", headers={"Cookie": cookie})).status_code == 200:
            return True
        await asyncio.sleep(1)
    return False


async def soak(args: argparse.Namespace, services: Services, server: subprocess.Popen, base: str,
               login: str) -> Run:
    run, stop = Run(), asyncio.Event()
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        await http.get(login, follow_redirects=True)
        cookie = "; ".join(f"{k}={v}" for k, v in http.cookies.items())
        run.first_probe = await probe(http)
        loader = asyncio.create_task(load(base, run.tally, stop, args.clients, args.burst, args.burst_every))
        ws_base = base.replace("http://", "ws://")
        viewing = asyncio.create_task(run.viewers.run(ws_base, cookie, base, stop))
        started = run.viewers.started = run.tally.started = time.monotonic()
        end = started + args.minutes * 60
        next_fault, turn = started + args.fault_every, 0
        # Until the end, and on past it until every fault has had its turn: on a busy machine the
        # faults take longer, and a short run must still inject each one (its checks judge them).
        while time.monotonic() < end or turn < len(args.faults):
            await asyncio.sleep(1)
            run.samples.append(await sample(http, server, started))
            if time.monotonic() < next_fault:
                continue
            fault = args.faults[turn % len(args.faults)]
            turn += 1
            at = time.monotonic() - started
            outcome, ok = await inject(fault, run, http, services, server, args, cookie)
            run.faults.append({"at": at, "until": time.monotonic() - started, "wall_until": time.time(),
                               "fault": fault, "outcome": outcome, "ok": ok})
            run.tally.probes.append((at, await probe(http)))
            next_fault = time.monotonic() + args.fault_every
        await _feed_back(run.viewers)
        await _autosave_back(services, run, args.autosave_every)
        stop.set()
        await loader
        await viewing
        await asyncio.sleep(5)  # idle
        run.idle = (await http.post("/debug/dump_engine_metrics", json={"model": MODEL})).json()
        run.samples.append(await sample(http, server, started))
    return run


async def _feed_back(viewers: Viewers) -> None:
    """Give the open page up to :data:`AFTERMATH_S` + 20 s to hear ``live`` again after a last
    fault that interrupted its feed, before the viewers stop."""
    for _ in range(int(AFTERMATH_S + 20)):
        if not viewers.feed or viewers.feed[-1][1] == "live":
            return
        await asyncio.sleep(1)


async def _autosave_back(services: Services, run: Run, autosave_every: int) -> None:
    """Give the server up to one autosave period and 30 s to autosave after the database's last
    outage, before the load stops: a short run can end before the next period does (on a busy
    machine the last fault comes late), and the check asks whether saving resumed, not when."""
    back = max((f["wall_until"] for f in run.faults if f["fault"] == "postgres down"), default=None)
    if back is None:
        return
    for _ in range(autosave_every + 30):
        if await asyncio.to_thread(autosaves_since, services, back) > 0:
            return
        await asyncio.sleep(1)


def stored_payloads(services: Services, table: str, ids: list[int]) -> tuple[list[str], int]:
    """Every acknowledged record in PostgreSQL, and every record at all whole (its payload's CRC
    intact; a trace with as many request summaries as it says): the problems, and the records read."""
    import psycopg

    problems = []
    with psycopg.connect(services.env["DATABASE_URL"]) as conn:
        stored = {row[0] for row in conn.execute(f"SELECT id FROM {table}")}
        problems += [f"{table} #{pk} acknowledged, not stored" for pk in ids if pk not in stored]
        for pk in sorted(stored):
            row = conn.execute(f"SELECT payload, payload_crc32 FROM {table} WHERE id = %s", (pk,)).fetchone()
            if row is None or row[1] is None or zlib.crc32(bytes(row[0])) != row[1]:
                problems.append(f"{table} #{pk}: its payload does not match its CRC")
        if table == "engines_tracerecord":
            for pk, said, held in conn.execute(
                    "SELECT t.id, t.request_count, count(s.id) FROM engines_tracerecord t LEFT JOIN "
                    "engines_requestsummary s ON s.trace_id = t.id GROUP BY t.id, t.request_count"):
                if said != held:
                    problems.append(f"trace #{pk}: {said} requests, {held} summaries stored")
    return problems, len(stored)


def reconcile(services: Services, tally: Tally) -> dict[str, Any]:
    """What the clients saw against what the history recorded: every request summary of a soak
    request is one a client sent, with the token count the client read."""
    import psycopg

    with psycopg.connect(services.env["DATABASE_URL"]) as conn:
        rows = conn.execute("SELECT request_id, completion_tokens, finish_reason FROM engines_requestsummary "
                            "WHERE request_id LIKE 'soak-%%'").fetchall()
    stored = {request_id: (tokens, reason) for request_id, tokens, reason in rows}
    sent = {f"soak-{n}" for n in range(1, tally.requests + 1)}
    phantom = [r for r in stored if r.rsplit("-", 1)[0] not in sent]
    matched = [r for r in tally.finished if r in stored]
    mismatched = [f"{r}: client {tally.finished[r]}, history {stored[r][0]}" for r in matched
                  if stored[r][1] in ("stop", "length") and stored[r][0] != tally.finished[r]]
    return {"summaries": len(stored), "client_finished": len(tally.finished), "matched": len(matched),
            "phantom": phantom[:5], "mismatched": mismatched[:5]}


def autosaves_since(services: Services, wall: float) -> int:
    """Autosaved traces captured after ``wall`` (Unix seconds)."""
    import psycopg

    with psycopg.connect(services.env["DATABASE_URL"]) as conn:
        row = conn.execute("SELECT count(*) FROM engines_tracerecord WHERE source = 'automatic' "
                           "AND captured_at > to_timestamp(%s)", (wall,)).fetchone()
    return int(row[0]) if row else 0


def windows(samples: list[dict[str, Any]], seconds: float) -> tuple[list[dict], list[dict], bool]:
    """The first window after warm-up and the last one, and whether the run is long enough for
    the comparison to mean anything (20 minutes: 5 of warm-up, then two windows apart)."""
    run_s = samples[-1]["t"] if samples else 0.0
    warm, window = min(WARMUP_S, run_s / 6), min(WINDOW_S, run_s / 3)
    first = [s for s in samples if warm <= s["t"] < warm + window]
    last = [s for s in samples if s["t"] >= run_s - window]
    return first, last, run_s >= seconds


def lag_outside_faults(samples: list[dict[str, Any]], faults: list[dict[str, Any]]) -> dict[str, float]:
    """The event loop's lag p99 (the histogram's bound that holds 99% of the probes) over the
    seconds outside every fault's window, and the share of probes past :data:`LAG_LIMIT_S`."""
    deltas: dict[float, float] = {}
    for before, after in zip(samples, samples[1:], strict=False):
        if "lag_buckets" not in before or "lag_buckets" not in after:
            continue
        if any(f["at"] - 1 <= after["t"] <= f["until"] + AFTERMATH_S for f in faults):
            continue
        for le, count in after["lag_buckets"].items():
            bound = float("inf") if le == "+Inf" else float(le)
            deltas[bound] = deltas.get(bound, 0.0) + count - before["lag_buckets"].get(le, 0.0)
    total = deltas.get(float("inf"), 0.0)
    if not total:
        return {"probes": 0.0, "p99_s": float("nan"), "past_limit": float("nan")}
    p99 = next(bound for bound in sorted(deltas) if deltas[bound] >= 0.99 * total)
    within = max((count for bound, count in deltas.items() if bound <= LAG_LIMIT_S), default=0.0)
    return {"probes": total, "p99_s": p99, "past_limit": 1 - within / total}


def checks(run: Run, services: Services, log_text: str, args: argparse.Namespace) -> dict[str, tuple[bool, Any]]:
    """What must hold after the soak (issue 42), name -> (held, detail)."""
    tally, viewers = run.tally, run.viewers
    idle = run.idle.get("metrics", run.idle)
    tracebacks = log_text.count("Traceback (most recent call last)")
    load_4xx = {code: n for code, n in tally.status.items() if 400 <= code < 500}
    out: dict[str, tuple[bool, Any]] = {
        "no 5xx but 503; every stream ends with a reason per choice and [DONE]": (not tally.bad, tally.bad[:5]),
        "the load's requests all taken (no 4xx)": (not load_4xx, load_4xx),
        "no traceback in the server's log": (tracebacks == 0, tracebacks),
        "every fault handled as promised": (all(f["ok"] for f in run.faults),
                                            [f"{f['fault']}: {f['outcome']}" for f in run.faults if not f["ok"]]),
        "greedy probe unchanged by every fault": (all(p == run.first_probe for _, p in tally.probes),
                                                  sorted({p[:30] for _, p in tally.probes})[:4]),
        "idle: no KV page in use, nothing running or waiting": (
            idle.get("kv_pages_used") == 0 and idle.get("num_running_requests") == 0
            and idle.get("num_waiting_requests") == 0,
            {k: idle.get(k) for k in ("kv_pages_used", "num_running_requests", "num_waiting_requests")}),
    }
    # A fault left out with --faults leaves its own check out too (shown as not run).
    injected = set(args.faults)
    out["hostile bodies: each a 4xx with a JSON error"] = _unless_left_out(
        "hostile bodies", injected, tally.hostile > 0 and not tally.hostile_bad, tally.hostile_bad[:3] or tally.hostile)
    (trace_problems, traces), (profile_problems, profiles) = (
        stored_payloads(services, "engines_tracerecord", run.saves),
        stored_payloads(services, "engines_profilerecord", run.profiles))
    out["every acknowledged save and profile stored, every record whole, with its request summaries"] = (
        not trace_problems and not profile_problems,
        (trace_problems + profile_problems)[:5] or f"{len(run.saves)} saves and {len(run.profiles)} profiles "
                                                   f"acknowledged; {traces} traces and {profiles} profiles stored")
    rec = reconcile(services, tally)
    out["history agrees with the clients (no phantom request, same token counts)"] = (
        not rec["phantom"] and not rec["mismatched"] and rec["matched"] > 0, rec)
    pg_back = max((f["wall_until"] for f in run.faults if f["fault"] == "postgres down"), default=None)
    resumed = autosaves_since(services, pg_back) if pg_back is not None else 0
    out["autosave resumed after the database's outage"] = _unless_left_out(
        "postgres down", injected, pg_back is not None and resumed > 0, f"{resumed} autosaves since it came back")
    redis_windows = [(f["at"], f["until"]) for f in run.faults if f["fault"] == "redis down"]
    out["Redis away: the open page said the feed was interrupted, then live again"] = _unless_left_out(
        "redis down", injected, all(_feed_said(viewers.feed, at, until) for at, until in redis_windows)
        and bool(redis_windows), [state for _, state in viewers.feed][:8])
    out["dashboard viewers: no unexpected error, unreadable messages answered"] = (
        not viewers.errors and viewers.opened > 0 and viewers.bad_answered >= max(0, viewers.bad_sent - 1),
        viewers.errors[:3] or f"{viewers.opened} opened, {viewers.messages} messages, {viewers.refused} refused "
                               f"(database away), {viewers.bad_answered}/{viewers.bad_sent} bad messages answered")
    lag = lag_outside_faults(run.samples, run.faults)
    first, last, long_enough = windows(run.samples, 20 * 60)
    # A short run whose faults come closer together than their aftermath has no second outside
    # every window: shown, not judged (a 20-minute run with none fails).
    lag_judged = bool(lag["probes"]) or long_enough
    out["event-loop lag p99 under 100 ms outside fault windows"] = (
        lag["p99_s"] <= LAG_LIMIT_S if lag_judged else True,
        lag if lag_judged else {**lag, "judged": "no: no probe outside the fault windows in a short run"})
    for who in ("server", "engine"):
        for key in ("rss_mib", "fds", "threads"):
            a = statistics.median(s[who][key] for s in first if who in s) if first else float("nan")
            b = statistics.median(s[who][key] for s in last if who in s) if last else float("nan")
            held = b <= a * 1.10 + (0 if key == "rss_mib" else 2)
            detail = f"{a:.0f} -> {b:.0f}"
            if not long_enough:  # a short run has no ten-minute windows to compare: shown, not judged
                held, detail = True, detail + " (not judged: the run is under 20 minutes)"
            out[f"{who} {key} flat (last window within 10% of the first after warm-up)"] = (held, detail)
    return out


def _unless_left_out(fault: str, injected: set[str], held: bool, detail: Any) -> tuple[bool, Any]:
    """A fault's own check, or a pass marked "not run" when ``--faults`` left the fault out."""
    return (held, detail) if fault in injected else (True, f"not run (--faults left out {fault!r})")


def _feed_said(feed: list[tuple[float, str]], at: float, until: float) -> bool:
    """Whether the open page heard ``interrupted`` during an outage (``at``..``until``, soak
    seconds) and ``live`` after it, within :data:`AFTERMATH_S` of its end."""
    return (any(state == "interrupted" and at <= t <= until + AFTERMATH_S for t, state in feed)
            and any(state == "live" and until < t <= until + AFTERMATH_S + 20 for t, state in feed))


def login_link(log: Path, server: subprocess.Popen) -> str:
    """The one-time dashboard link ``serve`` prints on loopback (a staff session for the viewers)."""
    for _ in range(100):
        found = re.search(r"^Dashboard\s+http://[^/]+(/\S+)\s+\(one-time link", log.read_text(), re.M)
        if found:
            return found[1]
        if server.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"the server printed no login link: {log.read_text()[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--fault-every", type=float, default=120.0, help="seconds between faults (default 120)")
    parser.add_argument("--outage", type=float, default=60.0, help="seconds Redis or PostgreSQL stays down (60)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--autosave-every", type=int, default=TRACE_AUTOSAVE_S,
                        help=f"the server's trace autosave period, seconds (default {TRACE_AUTOSAVE_S})")
    parser.add_argument("--burst", type=int, default=200, help="concurrent requests in a burst (default 200)")
    parser.add_argument("--burst-every", type=float, default=120.0, help="seconds between bursts (default 120)")
    parser.add_argument("--faults", type=lambda text: [f.strip() for f in text.split(",")], default=list(FAULTS),
                        help="the faults to inject in turn, comma-separated (default: all of them: "
                             + ", ".join(FAULTS) + ")")
    parser.add_argument("--json", type=Path, help="write the checks and figures here")
    parser.add_argument("--label", default="", help="this run's name in the results (BENCHMARKS.md's columns)")
    add_results_option(parser, "soak")
    args = parser.parse_args()
    if unknown := set(args.faults) - set(FAULTS):
        parser.error(f"unknown fault(s): {', '.join(sorted(unknown))}")

    root = Path(tempfile.mkdtemp(prefix="soak-"))
    services = Services(root)
    services.start_redis()
    services.init_pg()
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DJANGO_SETTINGS_MODULE")} | services.env \
        | {"DEBUGSITE_VAR_DIR": str(root / "var"), "PYTHONUNBUFFERED": "1", "FLEET_NAME": "soak"}
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)
    port = free_port()
    log_path = root / "server.log"
    log = open(log_path, "w")
    # A small KV cache (4,096 tokens for 16 sequences of up to ~1,000) so that long prompts preempt.
    server = subprocess.Popen([sys.executable, "manage.py", "serve", "--model", MODEL, "--backend", "cpu",
                               "--enable-debug", "--enable-tracing", "--trace-autosave", str(args.autosave_every),
                               "--metrics-snapshot-interval", "30", "--max-total-tokens", "4096",
                               "--max-num-seqs", "16", "--metrics-prefix", METRICS_PREFIX, "--port", str(port)],
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, base)
        run = asyncio.run(soak(args, services, server, base, login_link(log_path, server)))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
        log.close()
    table = checks(run, services, log_path.read_text(), args)
    services.stop_redis()
    services.stop_pg()
    report(args, run, table)
    if not all(ok for ok, _ in table.values()):  # the server's log, for whoever reads the failures
        kept = REPO / "var" / "soak-server.log"
        kept.parent.mkdir(exist_ok=True)
        shutil.copy(log_path, kept)
        print(f"  the server's log: {kept}")
    shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if all(ok for ok, _ in table.values()) else 1)


def report(args: argparse.Namespace, run: Run, table: dict[str, tuple[bool, Any]]) -> None:
    """The checks as a table, the figures into ``--results`` and everything into ``--json``."""
    tally = run.tally
    kv = [s["kv_pages_used"] for s in run.samples if "kv_pages_used" in s]
    digest_rss = [s["digest"]["rss_mib"] for s in run.samples if "digest" in s]
    print(f"{args.minutes:g} min: {tally.requests} requests ({tally.structured} structured, {tally.multi} with n > 1, "
          f"{tally.slow} read slowly, {tally.dropped} dropped mid-stream), {tally.tokens} tokens, statuses "
          f"{dict(sorted(tally.status.items()))}, {len(run.faults)} faults, "
          f"KV pages in use max {max(kv, default=0):.0f}, "
          f"trace digest process RSS max {max(digest_rss, default=0):.0f} MiB")
    for status, examples in sorted(tally.examples.items()):
        print(f"  {status}: {' | '.join(e[:150] for e in examples)}")
    for f in run.faults:
        print(f"  {f['at']:7.1f} s  {f['fault']:15s} {'ok ' if f['ok'] else 'BAD'} {f['outcome']}")
    for name, (ok, detail) in table.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
    print(f"  the kernel's TCP counters over the run: {tcp_counter_changes(run.samples) or 'unchanged'}")
    for when in sorted({int(m[1]) for m in map(TRANSPORT_AT.match, tally.bad) if m}):
        print(f"  around the transport error(s) at {when} s: {tcp_counter_changes(run.samples, when - 3, when + 2)}")
    results = ResultsFile(args.results, "soak")
    where = {"minutes": args.minutes, "fault_every": args.fault_every, "outage": args.outage, "soak": args.label}
    results.add("requests", tally.requests, "requests", **where)
    results.add("tokens", tally.tokens, "tokens", **where)
    results.add("faults", len(run.faults), "faults", **where)
    results.add("checks failed", sum(1 for ok, _ in table.values() if not ok), "checks", **where)
    first, last, _ = windows(run.samples, 0)
    for who in ("server", "engine"):
        for name, part in (("first", first), ("last", last)):
            values = [s[who]["rss_mib"] for s in part if who in s]
            if values:
                results.add(f"{who} RSS, {name} window", statistics.median(values), "MiB", **where)
    lag = lag_outside_faults(run.samples, run.faults)
    results.add("event-loop lag p99 outside faults", lag["p99_s"] * 1000, "ms", **where)
    if args.json:
        args.json.write_text(json.dumps({
            "checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in table.items()}, "faults": run.faults,
            "fault_kinds": FAULTS,
            "tally": {k: v for k, v in vars(tally).items() if k != "finished"}, "samples": run.samples}, default=str))


if __name__ == "__main__":
    main()
