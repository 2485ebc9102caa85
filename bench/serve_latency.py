"""Where a streaming request's time goes: the client's clock and the engine's trace, joined per request.

``manage.py serve`` with tracing on, N closed-loop streaming chat clients (each sends its next
request when the last one ended, as in ``serve_load.py``); then the trace is dumped and each
request's client-side moments (sent, first bytes, end of body) are matched to its trace events by
the request id the server answered with. Both sides use the Unix epoch on the same machine (the
trace's clock is ``perf_counter_ns`` plus the server's epoch anchor), so the gaps between them
are comparable to a few microseconds:

- send -> receive: the request's bytes to the view's first event, which comes after the body is
  parsed and validated (Daphne, Django, pydantic, and queueing on the event loop)
- receive -> added: the view to the engine taking the request in (tokenization, the engine
  process's socket and receiving thread, the end of the step under way)
- added -> first token: the engine's own time to first token
- first token -> client first: the first output back to the client's socket
- finish -> client end: the last output to the end of the body

    python bench/serve_latency.py --backend cuda --clients 16
    python bench/serve_latency.py --model /path/to/checkpoint --clients 16 --max-tokens 1
"""
from __future__ import annotations

import argparse
import asyncio
import re
import time
from pathlib import Path

import httpx
from results_file import add_results_option, ResultsFile  # bench/ is the script's folder, first on sys.path
from serve_load import PROMPT, RawSSEStream
from servers import launch

REPO = Path(__file__).resolve().parents[1]
_ANCHOR_NS = time.time_ns() - time.perf_counter_ns()

GAPS = ("send -> receive", "receive -> added", "added -> first token", "first token -> client first",
        "finish -> client end")


def now_us() -> float:
    """Microseconds since the Unix epoch on the monotonic clock (the trace's timebase)."""
    return (time.perf_counter_ns() + _ANCHOR_NS) / 1000


class TimedStream(RawSSEStream):
    """The lean client, noting when the first bytes of each answer arrive."""

    first_us: float | None = None

    def data_received(self, data: bytes) -> None:
        if self.first_us is None:
            self.first_us = now_us()
        super().data_received(data)


async def drive(base: str, model: str, clients: int, requests_per_client: int,
                max_tokens: int) -> tuple[list[dict[str, object]], float]:
    """Closed-loop streaming clients; each request's id and client-side moments, and the wall time."""
    rows: list[dict[str, object]] = []
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "debug_config": {"ignore_eos": True}}

    async def client() -> None:
        stream = TimedStream(base)
        # Connected before the first request is timed: its TCP handshake is not the server's time.
        await asyncio.get_running_loop().create_connection(lambda: stream, stream.host, stream.port)
        for _ in range(requests_per_client):
            stream.first_us = None
            sent = now_us()
            await stream.chat(body)
            end = now_us()
            request_id = re.search(rb'"id":"([^"]+)"', bytes(stream.buffer)).group(1).decode()
            rows.append({"request_id": request_id, "send": sent, "first": stream.first_us, "end": end})
        await stream.close()

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return rows, time.perf_counter() - began


def first_moments(events: list[dict]) -> dict[str, dict[str, float]]:
    """Each request lane's first timestamp of every event name."""
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    moments: dict[str, dict[str, float]] = {}
    for e in events:
        if e.get("ph") in ("i", "I", "B") and e.get("tid") in lanes:
            moments.setdefault(lanes[e["tid"]], {}).setdefault(e["name"], e["ts"])
    return moments


def gaps(rows: list[dict[str, object]], moments: dict[str, dict[str, float]]) -> dict[str, list[float]]:
    """The five gaps of every request whose trace holds its four engine-side moments, in µs."""
    out: dict[str, list[float]] = {name: [] for name in GAPS}
    needed = {"receive request", "request added to engine", "first token", "finish"}
    for row in rows:
        m = moments.get(str(row["request_id"]), {})
        if not needed <= m.keys():
            continue
        for name, value in zip(GAPS, (
            m["receive request"] - row["send"],
            m["request added to engine"] - m["receive request"],
            m["first token"] - m["request added to engine"],
            row["first"] - m["first token"],
            row["end"] - m["finish"],
        ), strict=True):
            out[name].append(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="demo, or a checkpoint folder")
    parser.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--engine-mode", choices=("process", "thread"), default="process")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--var-dir", default=str(REPO / "var" / "bench-latency"), help="database folder for the server")
    add_results_option(parser, "serve_latency")
    args = parser.parse_args()
    Path(args.var_dir).mkdir(parents=True, exist_ok=True)

    server, base = launch(["--model", args.model, "--enable-debug", "--enable-tracing", "--backend", args.backend,
                           "--engine-mode", args.engine_mode], args.var_dir)
    try:
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        # Warm-up (JIT, first touch); its requests stay in the trace but are not among the rows.
        asyncio.run(drive(base, model, args.clients, 2, args.max_tokens))
        rows, seconds = asyncio.run(drive(base, model, args.clients, args.requests_per_client, args.max_tokens))
        trace = httpx.post(f"{base}/debug/dump_event_trace", json={"model": model}, timeout=60).json()
    finally:
        server.terminate()
        server.wait(30)

    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    tokens = len(rows) * args.max_tokens
    print(f"{args.clients} clients, {len(rows)} requests: {tokens / seconds:.0f} tok/s through HTTP (tracing on)")
    results = ResultsFile(args.results, "serve_latency")
    where = {"model": args.model, "backend": args.backend, "engine_mode": args.engine_mode, "clients": args.clients,
             "max_tokens": args.max_tokens}
    results.add("through HTTP, tracing on", tokens / seconds, "tok/s", **where)
    for name, values in gaps(rows, first_moments(events)).items():
        if values:
            values.sort()
            p50, p90 = values[len(values) // 2] / 1000, values[int(0.9 * len(values))] / 1000
            print(f"  {name:28s} p50 {p50:7.2f} ms   "
                  f"p90 {p90:7.2f} ms   ({len(values)} requests)")
            results.add(f"{name} p50", p50, "ms", **where)
            results.add(f"{name} p90", p90, "ms", **where)


if __name__ == "__main__":
    main()
