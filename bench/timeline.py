"""The timeline viewer in a real browser: opening large saved traces, frame times, live mode.

Starts ``manage.py serve`` (demo engine in its own process, tracing on) over a fresh SQLite
database holding saved traces of ``--events`` sizes (the history benchmark's recorder workload),
signs Debian's chromium in through the one-time link, and measures (issue 12's goals):

* saved traces: time from the data having arrived (gzip on the wire, inflated by the browser)
  to the first frame, and from opening the page to a usable view;
* zoom (wheel) and pan (drag) frame times: the draw's own time per frame and the interval
  between ``requestAnimationFrame`` callbacks, p50/p95;
* live mode with ``--streams`` concurrent streams: how far the viewer is behind the engine
  (wall clock minus the newest event it holds), and the engine's tokens/s with one live viewer
  against none, in rotated rounds; the viewer is chromium on the timeline page (which shares
  the machine's cores with the server) and, apart, a websocket follower without a browser.

    .venv/bin/python bench/timeline.py                               # 100k and 1M events, 64 streams
    .venv/bin/python bench/timeline.py --events 100000 --rounds 2     # quicker
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
from itertools import pairwise
from pathlib import Path

import httpx
import orjson
import websockets

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import add_results_option, ResultsFile  # noqa: E402
from bench.trace_history import recorded_trace  # noqa: E402
from bench.ws_fanout import load  # noqa: E402

CHROMIUM = "/usr/bin/chromium"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def save_traces(var: str, sizes: list[int], results: ResultsFile) -> dict[int, int]:
    """Saved trace records of about each size in the database under ``var``; size -> record id."""
    os.environ["DEBUGSITE_VAR_DIR"] = var
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "debugsite.settings")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from engines.history import save_trace

    records = {}
    for size in sizes:
        raw = recorded_trace(size).dump_json()
        record = save_trace(raw, engine="demo", model="demo", retention=False, note=f"bench {size}")
        records[size] = record.pk
        print(f"saved a {record.event_count:,}-event trace ({len(raw) / 1e6:.0f} MB JSON, "
              f"{record.compressed_bytes / 1e6:.1f} MB gzip) as record {record.pk}")
        results.add("JSON", len(raw) / 1e6, "MB", part="saved trace", events_asked=size)
        results.add("gzip", record.compressed_bytes / 1e6, "MB", part="saved trace", events_asked=size)
    return records


def echo_problems(lines) -> None:
    """Print the server's warnings and errors (the rest of its log is dropped)."""
    shown = False
    for line in lines:
        if re.search(r"WARNING|ERROR|CRITICAL|Traceback", line) or (shown and line.startswith((" ", "\t"))):
            print(f"  server: {line.rstrip()}")
            shown = True
        else:
            shown = False


def start_server(var: str, streams: int) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DATABASE_URL", "REDIS_URL")}
    env |= {"DEBUGSITE_VAR_DIR": var, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port), "--backend", "cpu", "--enable-tracing",
         "--enable-debug", "--max-num-seqs", str(streams), "--max-total-tokens", str(streams * 256),
         "--metrics-snapshot-interval", "0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        match = re.search(r"Dashboard\s+http://[^/]+(/dashboard/login/\S+)", line)
        if match:
            threading.Thread(target=echo_problems, args=(process.stdout,), daemon=True).start()
            return process, f"http://127.0.0.1:{port}", match.group(1)
    raise SystemExit("serve exited before printing its dashboard link")


# A requestAnimationFrame loop of its own, running through the action: the interval between its
# callbacks is the page's frame time (a frame the main thread could not give shows as a long one),
# whether or not the view had anything to redraw.
RAF_PROBE = """() => {
  const probe = { stamps: [], running: true };
  const tick = (stamp) => { probe.stamps.push(stamp); if (probe.running) requestAnimationFrame(tick); };
  requestAnimationFrame(tick);
  window.rafProbe = probe;
}"""


async def frames_while(page, action) -> dict[str, float]:
    """Frame times (rAF intervals, ms) and the view's draw times while ``action`` drives it."""
    await page.evaluate("window.timeline.view.frames = []; window.timeline.view.recordFrames = true")
    await page.evaluate(RAF_PROBE)
    await action()
    await asyncio.sleep(0.2)
    stamps = await page.evaluate("window.rafProbe.running = false; window.rafProbe.stamps")
    frames = await page.evaluate("window.timeline.view.recordFrames = false; window.timeline.view.frames")
    draws = [f[1] for f in frames]
    intervals = [b - a for a, b in pairwise(stamps)]
    return {"draws": len(frames), "draw_p50": percentile(draws, 0.5), "draw_p95": percentile(draws, 0.95),
            "draw_max": max(draws, default=float("nan")), "frames": len(intervals),
            "frame_p50": percentile(intervals, 0.5), "frame_p95": percentile(intervals, 0.95),
            "frame_max": max(intervals, default=float("nan"))}


async def bench_saved(page, base: str, record: int, size: int, results: ResultsFile) -> None:
    started = time.perf_counter()
    await page.goto(f"{base}/dashboard/traces/{record}/timeline/")
    await page.wait_for_function("window.timeline && window.timeline.stats.ready === true", timeout=120_000,
                                 polling=50)
    usable = (time.perf_counter() - started) * 1000
    stats = await page.evaluate("window.timeline.stats")
    after_data = stats["firstFrameMs"] - stats["arrivedMs"]
    print(f"\n{size:,}-event trace: {await page.evaluate('window.timeline.model.events'):,} events, "
          f"{await page.evaluate('window.timeline.model.lanes.length'):,} lanes")
    print(f"  open -> usable {usable:.0f} ms (data arrived {stats['arrivedMs']:.0f} ms, "
          f"parse {stats['parseMs']:.0f} ms, build {stats['buildMs']:.0f} ms); "
          f"data arrived -> first frame {after_data:.0f} ms")
    where = {"part": "saved trace", "events_asked": size}
    results.add("events", await page.evaluate("window.timeline.model.events"), "events", **where)
    results.add("lanes", await page.evaluate("window.timeline.model.lanes.length"), "lanes", **where)
    for metric, value in (("open -> usable", usable), ("data arrived", stats["arrivedMs"]), ("parse", stats["parseMs"]),
                          ("build", stats["buildMs"]), ("data arrived -> first frame", after_data)):
        results.add(metric, value, "ms", **where)
    box = await page.locator(".tl-canvas").bounding_box()
    cx, cy = box["x"] + box["width"] * 0.6, box["y"] + 120

    async def zoom() -> None:
        await page.mouse.move(cx, cy)
        for i in range(60):
            await page.mouse.wheel(0, -100 if i < 30 else 100)
            await asyncio.sleep(0.016)

    async def pan() -> None:
        for zoom_steps in (0, 12):  # whole trace in view, then zoomed in
            for _ in range(zoom_steps):
                await page.mouse.wheel(0, -100)
            await page.mouse.move(cx, cy)
            await page.mouse.down()
            for step in range(60):
                await page.mouse.move(cx - step * 8, cy + (step % 10))
                await asyncio.sleep(0.016)
            await page.mouse.up()

    for label, action in (("zoom (wheel)", zoom), ("pan (drag)", pan)):
        await page.click("#fit")
        result = await frames_while(page, action)
        print(f"  {label:<11} frame time (rAF interval, {result['frames']} frames) p50 {result['frame_p50']:.1f} ms, "
              f"p95 {result['frame_p95']:.1f} ms, max {result['frame_max']:.1f} ms; view draws ({result['draws']}) "
              f"p50 {result['draw_p50']:.1f} ms, p95 {result['draw_p95']:.1f} ms, max {result['draw_max']:.1f} ms")
        action_name = label.split()[0]
        for key in ("frame_p50", "frame_p95", "frame_max", "draw_p50", "draw_p95", "draw_max"):
            kind, stat = key.split("_")
            results.add(f"{action_name}: {kind} {stat}", result[key], "ms", **where)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (those alive now)."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except FileNotFoundError:  # the thread ended meanwhile
                pass
    return out


def cpu_of(pid: int, reaped_children: bool = False) -> float:
    """CPU seconds of ``pid`` (0 once gone), with its reaped children's when asked."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    ticks = sum(int(fields[i]) for i in ((11, 12, 13, 14) if reaped_children else (11, 12)))
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_by_role(server: int) -> dict[str, float]:
    """CPU seconds so far of the server process, its engine process, chromium and this benchmark.
    Chromium's renderers come and go: their time counts through the parent that reaped them."""
    browser = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and "chrom" in _comm(p)]
    own = os.times()
    return {"server": cpu_of(server), "engine": sum(map(cpu_of, process_tree(server)[1:])),
            "browser": sum(cpu_of(pid, reaped_children=True) for pid in browser), "bench": own.user + own.system}


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""


async def socket_viewer(base: str, cookie: str, lags: list[float], traffic: list[int], stop: asyncio.Event) -> None:
    """A live timeline follower without a browser: the server's side of a viewer, alone.
    Appends the size of each message it gets to ``traffic``."""
    url = base.replace("http://", "ws://") + "/ws/engines/demo/timeline/"
    last = 0
    async with websockets.connect(url, additional_headers={"Cookie": cookie, "Origin": base},
                                  max_size=None) as socket:
        await socket.send(orjson.dumps({"action": "follow", "cursor": 0, "tag": 1}))
        while not stop.is_set():
            try:
                frame = await asyncio.wait_for(socket.recv(), 0.5)
            except TimeoutError:
                continue
            traffic.append(len(frame))
            message = orjson.loads(frame)
            if message["type"] == "trace_delta" and message["calls"]:
                last = max(last, max(call[0] for call in message["calls"]))
                if not message["more"]:
                    lags.append((time.time() * 1e6 - last) / 1000)


async def bench_live(page, base: str, server: int, streams: int, seconds: float, rounds: int,
                     viewers: list[str], results: ResultsFile) -> None:
    from playwright.async_api import Error as PlaywrightError  # the timeout the first delta may end in

    kinds = ["none", *viewers]
    print(f"\nlive: {streams} concurrent streams, {seconds:.0f} s rounds of {', '.join(kinds)}, order rotated")
    cookie = "; ".join(f"{c['name']}={c['value']}" for c in await page.context.cookies())
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    lags: dict[str, list[float]] = {kind: [] for kind in viewers}
    cores: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for round_ in range(rounds):
        for kind in kinds[round_ % len(kinds):] + kinds[:round_ % len(kinds)]:
            await page.goto("about:blank")
            # Every round starts from an empty recorder: a viewer catches up on the same little.
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                (await http.post("/debug/reset_engine", json={"model": "demo", "clear_trace": True})).raise_for_status()
            stop = asyncio.Event()
            round_lags: list[float] = []
            follower = None
            if kind == "browser":
                await page.goto(f"{base}/dashboard/engines/demo/timeline/")
                try:
                    await page.wait_for_function("window.timeline && window.timeline.stats.deltas > 0", timeout=60_000)
                except PlaywrightError as exc:
                    status = await page.text_content("#timeline-status")
                    notice = await page.text_content("#timeline-notice")
                    raise SystemExit(f"the live timeline got no trace: status {status!r}, notice {notice!r}") from exc

                async def sample(lags: list[float], stop: asyncio.Event) -> None:
                    await asyncio.sleep(1.0)  # events flow from every step once the load runs
                    while not stop.is_set():
                        await asyncio.sleep(0.2)
                        if not stop.is_set():
                            lag = await page.evaluate("Date.now() * 1000 - window.timeline.model.last")
                            lags.append(lag / 1000)

                follower = asyncio.create_task(sample(round_lags, stop))
            elif kind == "socket":
                traffic: list[int] = []
                follower = asyncio.create_task(socket_viewer(base, cookie, round_lags, traffic, stop))
            cpu_before, started = cpu_by_role(server), time.perf_counter()
            tokens = await load(base, streams, seconds)
            elapsed = time.perf_counter() - started
            cpu_after = cpu_by_role(server)
            stop.set()
            if follower is not None:
                await follower
                lags[kind] += round_lags
            rates[kind].append(tokens / elapsed)
            used = {role: (cpu_after[role] - cpu_before[role]) / elapsed for role in cpu_after}
            cores[kind].append(used)
            print(f"  round {round_ + 1}, {kind:<7} viewer: {tokens / elapsed:7.0f} tok/s; cores used: "
                  + ", ".join(f"{role} {value:.2f}" for role, value in used.items())
                  + (f"; {len(traffic) / elapsed:.1f} deltas/s, {sum(traffic) / elapsed / 1e3:.0f} kB/s"
                     if kind == "socket" else ""))
    without = statistics.median(rates["none"])
    for kind in kinds:
        median_cores = {role: statistics.median(r[role] for r in cores[kind]) for role in cores[kind][0]}
        print(f"  {kind:<7} viewer, median cores: " + ", ".join(
            f"{role} {value:.2f}" for role, value in median_cores.items()))
        results.add("engine", statistics.median(rates[kind]), "tok/s", part="live", viewer=kind, streams=streams)
        for role, value in median_cores.items():
            results.add(f"cores used: {role}", value, "cores", part="live", viewer=kind, streams=streams)
    for kind in viewers:
        with_viewer = statistics.median(rates[kind])
        print(f"  engine tok/s with one {kind} viewer / none (medians): {with_viewer:.0f} / {without:.0f} = "
              f"{with_viewer / without:.3f} (goal >= 0.97)")
        steady = lags[kind]
        print(f"  {kind} viewer behind the engine: p50 {percentile(steady, 0.5):.0f} ms, "
              f"p99 {percentile(steady, 0.99):.0f} ms, max {max(steady, default=float('nan')):.0f} ms "
              f"over {len(steady)} samples (goal <= 1000 ms)")
        where = {"part": "live", "viewer": kind, "streams": streams}
        results.add("engine, viewer/none", with_viewer / without, "ratio", **where)
        for stat, value in (("p50", percentile(steady, 0.5)), ("p99", percentile(steady, 0.99)),
                            ("max", max(steady, default=float("nan")))):
            results.add(f"behind the engine {stat}", value, "ms", **where)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--viewers", nargs="*", choices=["browser", "socket"], default=["browser", "socket"],
                        help="live viewers to compare with none: chromium on the timeline page, and a websocket "
                             "follower without a browser (the server's cost alone); none given: no live rounds")
    add_results_option(parser, "timeline")
    args = parser.parse_args()
    results = ResultsFile(args.results, "timeline")
    var = tempfile.mkdtemp(prefix="bench-timeline-")
    records = save_traces(var, args.events, results)   # Django's ORM, before any event loop runs
    asyncio.run(run(args, var, records, results))


async def run(args: argparse.Namespace, var: str, records: dict[int, int], results: ResultsFile) -> None:
    from playwright.async_api import async_playwright

    process, base, login = start_server(var, args.streams)
    try:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM)
            page = await (await browser.new_context(viewport={"width": 1400, "height": 1000})).new_page()
            page.on("pageerror", lambda error: print(f"  page error: {error}"))
            page.on("console", lambda message: message.type in ("error", "warning")
                    and print(f"  console {message.type}: {message.text}"))
            await page.goto(base + login)
            for size, record in records.items():
                await bench_saved(page, base, record, size, results)
            if args.viewers:
                await bench_live(page, base, process.pid, args.streams, args.seconds, args.rounds, args.viewers,
                                 results)
            await browser.close()
    finally:
        process.terminate()
        process.wait(30)


if __name__ == "__main__":
    main()
