"""Benchmark the event trace recorder: recording cost (enabled and disabled) and export time.

    .venv/bin/python bench/trace_recorder.py [--events 1000000] [--repeat 5] [--calls 200000]

Recording: CPU ns per ``add_event`` call (net of the loop's own cost) for a single request, a
single request with args, a batch (with the engine lane), and with the buffer full so every call
also evicts; and ns per disabled call site (``if tracer is not None``), which is all tracing
costs when it is off. Export: ``dump_json()`` of an ``--events`` trace, median of ``--repeat``
runs, for an engine-like workload (batched decode steps, 32 running requests) and for the worst
case (every call a single request, a quarter with args); plus ``dump()`` (the dict form).
Goals (issue 3): about 1 µs per enabled event, export of 1,000,000 events within 1 s.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.results_file import add_results_option, ResultsFile  # noqa: E402
from engines.runtime import TraceRecorder  # noqa: E402  (after the path set-up)


# Recording figures are process CPU time: what the recorder costs the engine thread, and far less
# sensitive than wall time to neighbours on a shared machine.
_cpu_ns = time.process_time_ns


def _bare_loop(n: int) -> None:
    for _ in range(n):
        pass


def _median_ns_per_iter(body: Callable[[int], None], n: int, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t0 = _cpu_ns()
        body(n)
        runs.append((_cpu_ns() - t0) / n)
    return statistics.median(runs)


def time_calls(body: Callable[[int], None], n: int, repeat: int) -> float:
    """CPU ns per iteration of ``body(n)`` net of the bare loop (medians of ``repeat`` runs;
    floored at 0, since a near-free body can measure below the loop's own noise)."""
    return max(_median_ns_per_iter(body, n, repeat) - _median_ns_per_iter(_bare_loop, n, repeat), 0.0)


def bench_recording(n: int, repeat: int, batch: int) -> list[tuple[str, str, float, str]]:
    """Each recording figure: its name, its printed form, its value and its unit."""
    ids = [f"chatcmpl-{i:032x}" for i in range(batch)]
    rid = ids[0]
    args = {"batch_size": batch}

    def single(k: int) -> None:
        rec = TraceRecorder(max_events=10 * k)
        add = rec.add_event
        for _ in range(k):
            add(rid, "first token")

    def single_args(k: int) -> None:
        rec = TraceRecorder(max_events=10 * k)
        add = rec.add_event
        for _ in range(k):
            add(rid, "finish prefill", args)

    def batched(k: int) -> None:
        rec = TraceRecorder(max_events=(batch + 1) * k + 1)
        add = rec.add_event
        for _ in range(k):
            add(ids, "start decode", args, engine_lane=True)

    def full(k: int) -> None:
        rec = TraceRecorder(max_events=1000)
        add = rec.add_event
        for _ in range(1000):
            add(rid, "first token")
        for _ in range(k):  # every call now evicts the oldest
            add(rid, "first token")

    def disabled(k: int) -> None:
        tracer: TraceRecorder | None = None
        for _ in range(k):
            if tracer is not None:
                tracer.add_event(rid, "first token")

    per_batch = time_calls(batched, n // 4, repeat)
    one, one_args, evicting = (time_calls(body, n, repeat) for body in (single, single_args, full))
    off = time_calls(disabled, n, repeat)
    return [
        ("add_event, 1 request", f"{one:8.0f} ns/call", one, "ns/call"),
        ("add_event, 1 request + args", f"{one_args:8.0f} ns/call", one_args, "ns/call"),
        (f"add_event, {batch} requests + engine lane",
         f"{per_batch:8.0f} ns/call = {per_batch / (batch + 1):.0f} ns/event", per_batch, "ns/call"),
        ("add_event, buffer full (evicting)", f"{evicting:8.0f} ns/call", evicting, "ns/call"),
        ("disabled call site (tracer is None)", f"{off:8.1f} ns/check", off, "ns/check"),
    ]


def engine_like_trace(n_events: int, batch: int, seed: int = 0) -> TraceRecorder:
    """A trace shaped like the engine's: requests arrive, queue, prefill, then decode in batches."""
    rng = random.Random(seed)
    rec = TraceRecorder("bench", "demo", "cpu", max_events=n_events)
    running: dict[str, int] = {}
    serial = 0

    def recorded() -> int:
        return rec.event_count + rec.dropped_events

    while recorded() < n_events:
        while len(running) < batch:
            rid = f"chatcmpl-{serial:032x}"
            serial += 1
            running[rid] = rng.randint(16, 256)
            rec.add_event(rid, "request added to engine", {"prompt_tokens": rng.randint(16, 512)})
            rec.add_event(rid, "start queue")
            rec.add_event(rid, "finish queue")
            rec.add_event([rid], "start prefill", {"batch_size": 1}, engine_lane=True)
            rec.add_event([rid], "finish prefill", {"tokens": 128}, engine_lane=True)
            rec.add_event(rid, "first token")
        ids = list(running)
        rec.add_event(ids, "start decode", {"batch_size": len(ids)}, engine_lane=True)
        rec.add_event(ids, "finish decode", {"tokens": len(ids)}, engine_lane=True)
        rec.add_event(ids, "start sampling")
        rec.add_event(ids, "finish sampling")
        for rid in ids:
            running[rid] -= 1
            if running[rid] == 0:
                del running[rid]
                rec.add_event(rid, "finish", {"finish_reason": "length", "completion_tokens": 1})
    return rec


def single_call_trace(n_events: int) -> TraceRecorder:
    """Worst case for export: one request per call (no batch to share work), a quarter with args."""
    rec = TraceRecorder("bench", "demo", "cpu", max_events=n_events)
    args = {"batch_size": 3}
    for i in range(n_events):
        rid = f"chatcmpl-{i // 20:032x}"
        rec.add_event(rid, "start decode" if i % 2 == 0 else "finish decode", args if i % 4 == 1 else None)
    return rec


def time_export(fn: Callable[[], object], repeat: int) -> tuple[float, float, object]:
    """Median wall and CPU seconds of ``fn()`` over ``repeat`` runs, and its last result."""
    fn()  # numba compile (first run after install) or cache load, page-in
    wall, cpu = [], []
    out = None
    for _ in range(repeat):
        out = None
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="trace size for the export runs")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (median reported)")
    parser.add_argument("--calls", type=int, default=200_000, help="add_event calls per recording run")
    parser.add_argument("--batch", type=int, default=32, help="requests per batched call / running")
    add_results_option(parser, "trace_recorder")
    opts = parser.parse_args()
    results = ResultsFile(opts.results, "trace_recorder")

    rows = []
    for name, text, value, unit in bench_recording(opts.calls, opts.repeat, opts.batch):
        rows.append((name, text))
        results.add(name, value, unit, calls=opts.calls)
    for name, make in (("engine-like", lambda: engine_like_trace(opts.events, opts.batch)),
                       ("single-request calls", lambda: single_call_trace(opts.events))):
        rec = make()
        wall, cpu, raw = time_export(rec.dump_json, opts.repeat)
        held = rec.event_count
        rows.append((f"dump_json {held:,} events, {name}",
                     f"{wall * 1000:6.0f} ms wall, {cpu * 1000:.0f} ms CPU "
                     f"({wall / held * 1e9:.0f} ns/event, {len(raw) / 1e6:.0f} MB)"))
        for metric, value, unit in (("dump_json", wall * 1000, "ms"), ("dump_json CPU", cpu * 1000, "ms"),
                                    ("dump_json size", len(raw) / 1e6, "MB")):
            results.add(metric, value, unit, events=held, workload=name)
        del raw
        if name == "engine-like":
            wall, cpu, _ = time_export(rec.dump, max(1, min(opts.repeat, 3)))
            rows.append((f"dump() dict {held:,} events, {name}",
                         f"{wall * 1000:6.0f} ms wall, {cpu * 1000:.0f} ms CPU"))
            results.add("dump() dict", wall * 1000, "ms", events=held, workload=name)
        del rec

    width = max(len(name) for name, _ in rows)
    print(f"{'measurement':<{width}}  result")
    print(f"{'-' * width}  {'-' * 40}")
    for name, value in rows:
        print(f"{name:<{width}}  {value.strip()}")
    load = os.getloadavg()[0]
    print(f"\npython {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {load:.2f}, "
          f"median of {opts.repeat}; recording figures are CPU time")


if __name__ == "__main__":
    main()
