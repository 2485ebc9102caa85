"""The fleet at 100 servers x 4 engines: Redis traffic per server, and what a fleet page costs.

Starts a Redis of its own on a spare port (the machine's shared one is never touched, and its
INFO counters are ours alone), then runs ``--servers`` simulated members in this process, each
with its own connection: a real ``FleetPublisher`` (card + heartbeat, rows once a second, clock
measurement) over ``--engines`` engines whose metrics are real ``EngineMetrics`` fed with
observations every second. Measures, over ``--seconds``:

* Redis commands and bytes in/out per server per second with nobody watching, then with
  ``--boards`` members each holding a fleet page open (a ``FleetBoard`` each: the rows pushed to
  it, and one whole read a second): a server's own traffic must not grow with the fleet's viewers;
* with pages open, a row's age when the board pushes it to its pages (its server read the engine
  at ``at``): p50 and p99 (goal p99 <= 500 ms); and this process's CPU per server-second;
* the time to assemble one fleet view (all servers, all rows, fleet percentiles) and its JSON size;
* with ``--browser``, the grid's render time in Debian's chromium: a live ``manage.py serve`` in
  the same fleet, its fleet page open, every update's ``render()`` timed by the page itself.

    python bench/fleet.py                        # 100 x 4, 20 s a phase
    python bench/fleet.py --browser              # and the page in chromium
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import orjson
from results_file import ResultsFile, add_results_option  # bench/ is the script's folder, first on sys.path
from servers import free_port, launch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "debugsite.settings")


class SimulatedEngine:
    """What the publisher reads of an engine, backed by a real ``EngineMetrics`` that a feeder
    advances every second (steps, first tokens, token gaps), as a busy engine's would be."""

    def __init__(self, name: str) -> None:
        from engines.runtime import EngineMetrics

        self.name = name
        self.metrics = EngineMetrics()
        self.checkpoint = SimpleNamespace(name="Llama-3.1-8B-Instruct")
        self.is_alive = True
        self.status = SimpleNamespace(state=SimpleNamespace(value="running"))

    def feed(self, rng: random.Random) -> None:
        m = self.metrics
        m.set_gauges(num_running_requests=rng.randint(0, 32), num_waiting_requests=rng.randint(0, 4),
                      kv_pages_used=rng.randint(0, 900), kv_pages_total=1000)
        for _ in range(rng.randint(1, 5)):
            m.on_step(0.02, prefill_tokens=rng.randint(0, 512), decode_seqs=rng.randint(1, 32))
            m.on_first_token(rng.lognormvariate(-2.5, 0.6))
            m.on_token_gaps([rng.lognormvariate(-3.5, 0.3) for _ in range(8)])

    async def metrics_with_histograms(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.metrics.as_dict(), self.metrics.histograms()


async def redis_info(client: Any) -> dict[str, int]:
    info = await client.info("stats")
    return {key: int(info[key]) for key in ("total_commands_processed", "total_net_input_bytes",
                                            "total_net_output_bytes")}


def _cpu_seconds(pid: int) -> float:
    """A process's user + system CPU so far (``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _member_worker(args: argparse.Namespace, redis_url: str, fleet: str, first: int, stop: Any) -> None:
    """One worker process publishing the simulated members ``first, first + workers, ...``."""
    import django

    django.setup()
    asyncio.run(_publish_until(args, redis_url, fleet, stop, range(first, args.servers, args.workers)))


def start_members(args: argparse.Namespace, redis_url: str, fleet: str) -> tuple[list[Any], Any]:
    """The simulated members, in ``--workers`` processes (as real members are processes of their own)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    workers = [context.Process(target=_member_worker, args=(args, redis_url, fleet, first, stop), daemon=True)
               for first in range(args.workers)]
    for worker in workers:
        worker.start()
    return workers, stop


async def run_phase(args: argparse.Namespace, redis_url: str, fleet: str, boards: list[Any]) -> dict[str, float]:
    """One phase: the members publishing for ``--seconds``, with these boards (pages) open here."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    workers, stop = start_members(args, redis_url, fleet)
    ages: list[float] = []

    async def sink(text: str) -> None:
        """A page: how old each pushed row is when it is sent (its server read it at ``at``)."""
        message = orjson.loads(text)
        if message.get("type") == "fleet_rows":
            now = time.time()
            ages.extend(now - row["at"] for row in message["rows"])

    viewers = [(board, object()) for board in boards]
    for board, viewer in viewers:
        board.watch(viewer, sink)
    await asyncio.sleep(8.0)  # warm: workers started, every member announced, windows begun
    before = await redis_info(client)
    ages.clear()
    cpu_members = sum(_cpu_seconds(w.pid) for w in workers)
    cpu_pages = time.process_time()
    started = time.monotonic()
    await asyncio.sleep(args.seconds)
    elapsed = time.monotonic() - started
    cpu_members = sum(_cpu_seconds(w.pid) for w in workers) - cpu_members
    cpu_pages = time.process_time() - cpu_pages
    after = await redis_info(client)
    for board, viewer in viewers:
        board.unwatch(viewer)
    stop.set()
    for worker in workers:
        worker.join(30)
    await client.aclose()
    per = args.servers * elapsed
    ages.sort()
    latency = {"age_p50_ms": 1000 * ages[len(ages) // 2], "age_p99_ms": 1000 * ages[int(len(ages) * 0.99)]} \
        if ages else {}
    return {key: (after[key] - before[key]) / per for key in before} | {
        "elapsed_s": elapsed, "cpu_ms": 1000 * cpu_members / per,
        "pages_cpu_ms": 1000 * cpu_pages / elapsed / max(1, len(boards))} | latency


async def measure(args: argparse.Namespace, redis_url: str, fleet: str) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from engines.fleet.board import FleetBoard, fleet_view
    from engines.fleet.store import RedisFleetStore

    client = aioredis.from_url(redis_url)
    boards = [FleetBoard(RedisFleetStore(aioredis.from_url(redis_url), fleet), list) for _ in range(args.boards)]
    quiet = await run_phase(args, redis_url, fleet, [])
    watched = await run_phase(args, redis_url, fleet, boards)
    store = RedisFleetStore(client, fleet)
    times, size = [], 0
    for _ in range(10):
        started = time.perf_counter()
        view = await fleet_view(store, [])
        text = view.model_dump_json(exclude={"rows": {"__all__": {"windows"}}})
        times.append(time.perf_counter() - started)
        size = len(text)
    rows = len(view.rows)
    await client.aclose()
    return {"quiet": quiet, "watched": watched, "view_ms": 1000 * statistics.median(times), "view_bytes": size,
            "rows": rows}


def browser_render(args: argparse.Namespace, redis_url: str, fleet: str) -> list[float]:
    """Render times (ms) of the fleet page's grid while the simulated fleet publishes."""
    import asyncio as aio

    from playwright.async_api import async_playwright

    var = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "API_KEY")}
    env |= {"DEBUGSITE_VAR_DIR": str(var), "REDIS_URL": redis_url, "FLEET_NAME": fleet,
            "DJANGO_SUPERUSER_PASSWORD": "bench-pw", "PYTHONUNBUFFERED": "1"}
    manage = [sys.executable, "manage.py"]
    subprocess.run(manage + ["migrate", "-v", "0"], cwd=REPO, env=env, check=True)
    subprocess.run(manage + ["createsuperuser", "--noinput", "--username", "admin", "--email", "a@example.com"],
                   cwd=REPO, env=env, check=True, capture_output=True)
    server, base = launch(["--model", "demo", "--backend", "cpu"], var, env)

    async def run() -> list[float]:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path="/usr/bin/chromium")
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            await page.goto(f"{base}/admin/login/?next=/dashboard/fleet/")
            await page.fill("#id_username", "admin")
            await page.fill("#id_password", "bench-pw")
            await page.click("input[type=submit]")
            await page.wait_for_function(f"() => document.querySelectorAll('tr.fleet-row').length > "
                                         f"{args.servers * args.engines}", timeout=60000)
            await page.evaluate("() => { window.fleetStats.renders = []; }")
            await aio.sleep(args.seconds)
            renders = await page.evaluate("() => window.fleetStats.renders")
            await browser.close()
            return renders

    try:
        return aio.run(run())
    finally:
        server.terminate()
        server.wait(60)
        shutil.rmtree(var, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=100)
    parser.add_argument("--engines", type=int, default=4, help="engines a server (default 4)")
    parser.add_argument("--boards", type=int, default=10, help="members with a fleet page open (default 10)")
    parser.add_argument("--workers", type=int, default=4, help="processes the simulated members run in (default 4)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase (default 20)")
    parser.add_argument("--browser", action="store_true", help="also time the page's grid in chromium")
    add_results_option(parser, "fleet")
    args = parser.parse_args()

    import django

    django.setup()
    port = free_port()
    data = tempfile.mkdtemp(prefix="fleet-redis-")
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", data], stdout=subprocess.DEVNULL)
    redis_url = f"redis://127.0.0.1:{port}/0"
    fleet = "bench"
    try:
        time.sleep(0.5)
        result = asyncio.run(measure(args, redis_url, fleet)) if not args.browser else None
        results = ResultsFile(args.results, "fleet")
        where = {"part": "browser" if args.browser else "redis", "servers": args.servers, "engines": args.engines}
        if not args.browser:
            where["boards"] = args.boards
        if result is not None:
            for phase, label in (("quiet", "no page open"),
                                 ("watched", f"{args.boards} member{'s' if args.boards != 1 else ''} with pages open")):
                r = result[phase]
                kib_in, kib_out = r["total_net_input_bytes"] / 1024, r["total_net_output_bytes"] / 1024
                print(f"{label}: per server per second {r['total_commands_processed']:.2f} Redis commands, "
                      f"{kib_in:.2f} KiB in, {kib_out:.2f} KiB out")
                results.add(f"Redis commands per server-second, {label}", r["total_commands_processed"], "commands",
                            **where)
                results.add(f"Redis bytes in per server-second, {label}", r["total_net_input_bytes"], "bytes", **where)
                results.add(f"Redis bytes out per server-second, {label}", r["total_net_output_bytes"], "bytes",
                            **where)
                results.add(f"member CPU per server-second, {label}", r["cpu_ms"], "ms", **where)
                if phase == "watched":
                    results.add(f"CPU of a member's open pages per second, {label}", r["pages_cpu_ms"], "ms", **where)
                if "age_p50_ms" in r:
                    print(f"  a row's age when pushed to the pages: p50 {r['age_p50_ms']:.0f} ms, "
                          f"p99 {r['age_p99_ms']:.0f} ms; CPU {r['cpu_ms']:.1f} ms per server-second, "
                          f"{r['pages_cpu_ms']:.0f} ms a second for a member's pages")
                    results.add(f"row age when pushed to a page, p50, {label}", r["age_p50_ms"], "ms", **where)
                    results.add(f"row age when pushed to a page, p99, {label}", r["age_p99_ms"], "ms", **where)
            print(f"one fleet view: {result['rows']} rows assembled in {result['view_ms']:.1f} ms (median of 10), "
                  f"{result['view_bytes'] / 1024:.0f} KiB of JSON")
            results.add("fleet view assembly", result["view_ms"], "ms", **where)
            results.add("fleet view JSON", result["view_bytes"], "bytes", **where)
        else:
            import threading

            stop = threading.Event()
            feeder = threading.Thread(target=lambda: asyncio.run(_publish_until(args, redis_url, fleet, stop)),
                                      daemon=True)
            feeder.start()
            try:
                renders = browser_render(args, redis_url, fleet)
            finally:
                stop.set()
                feeder.join(30)
            if renders:
                print(f"grid render: median {statistics.median(renders):.1f} ms, max {max(renders):.1f} ms over "
                      f"{len(renders)} updates ({args.servers * args.engines} rows)")
                results.add("grid render, median", statistics.median(renders), "ms", **where)
                results.add("grid render, max", max(renders), "ms", **where)
    finally:
        redis.terminate()
        redis.wait(10)
        shutil.rmtree(data, ignore_errors=True)


async def _publish_until(args: argparse.Namespace, redis_url: str, fleet: str, stop: Any,
                         indexes: Iterable[int] | None = None) -> None:
    """Simulated members (``indexes``, default all) publishing until ``stop`` is set."""
    import redis.asyncio as aioredis

    from engines.fleet.membership import EngineCard, ServerCard
    from engines.fleet.publisher import FleetPublisher
    from engines.fleet.store import RedisFleetStore

    rng = random.Random(1)
    members = list(range(args.servers) if indexes is None else indexes)
    engines = [[SimulatedEngine(f"engine-{e}") for e in range(args.engines)] for _ in members]
    tasks = []
    for index, group in zip(members, engines, strict=True):
        card = ServerCard(server=f"sim-{index:03d}:1", url=f"http://10.0.{index // 250}.{index % 250}:8000",
                          version="bench", roles=["engines"], started_at=time.time(),
                          engines=[EngineCard(name=e.name, model="Llama-3.1-8B-Instruct", backend="cuda",
                                              dtype="float16", mode="process", tracing=True) for e in group])
        publisher = FleetPublisher(RedisFleetStore(aioredis.from_url(redis_url), fleet), card.server,
                                   lambda g=group: g, lambda c=card: c)
        tasks.append(asyncio.create_task(publisher.run()))
    while not stop.is_set():
        for group in engines:
            for engine in group:
                engine.feed(rng)
        await asyncio.sleep(1.0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


if __name__ == "__main__":
    main()
