"""What exporting OpenTelemetry request spans costs a server: requests/s of three servers side by side,
one without an endpoint (off), one exporting to a port nobody listens on (dead), one exporting to a
live OTLP/HTTP receiver (on), taking turns round by round (order rotated), medians of the rounds.

Each is ``manage.py serve --model demo`` (its engine in its own process) answering small
non-streaming completions from ``--concurrency`` clients. The receiver (a process of its own)
parses every export with opentelemetry-proto and counts the spans: the run checks that the live
server's spans all arrived (five a request) and that the dead one warned once. Beside the load: what
the off path costs a request (``engines.otel.begin`` returning None), and the span work a request
costs the server when on (begin, the outputs, the spans built and queued), in this process.

    .venv/bin/python bench/otel_overhead.py
    .venv/bin/python bench/otel_overhead.py --rounds 9 --requests 300 --concurrency 8
"""
from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path

from results_file import ResultsFile, add_results_option, this_machine  # bench/ is the script's folder
from servers import launch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(REPO))  # the micro-measures import engines.otel here
MODES = ("off", "dead", "on")
SPANS_PER_REQUEST = 5  # the request span, queue, preprocess, prefill, decode
#: Seconds between two rounds: the engine that ran last settles (its threads stop spinning).
PAUSE_S = 1.0


def receiver() -> None:
    """An OTLP/HTTP trace receiver: counts the spans of each ``POST /v1/traces``; ``GET`` says the count."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    count = 0
    lock = threading.Lock()
    reply = ExportTraceServiceResponse().SerializeToString()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            nonlocal count
            export = ExportTraceServiceRequest()
            export.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                count += sum(len(s.spans) for r in export.resource_spans for s in r.scope_spans)
            self._answer(reply, "application/x-protobuf")

        def do_GET(self) -> None:  # noqa: N802
            self._answer(str(count).encode(), "text/plain")

        def _answer(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


async def round_of(base: str, requests: int, concurrency: int, max_tokens: int) -> float:
    """``requests`` completions from ``concurrency`` clients; requests/s."""
    import httpx

    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0.0}
    left = requests

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            response = await http.post(f"{base}/v1/completions", json=body)
            assert response.status_code == 200, response.text

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as http:
        began = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return requests / (time.perf_counter() - began)


def off_path_ns() -> float:
    """What ``engines.otel.begin`` costs a request with no endpoint (ns): all the off path does."""
    from engines import otel

    otel.configure(None)
    number = 1_000_000
    return min(timeit.repeat(lambda: otel.begin(None, None, None, "demo"), number=number, repeat=5)) / number * 1e9


def span_work_us(endpoint: str, requests: int = 400) -> float:
    """The span work of one request when on, in this process (µs): begin (the traceparent read),
    three outputs observed, the five spans built, ended and queued. The export itself runs on the
    processor's thread (to the live receiver), flushed between repeats, and is not counted;
    ``requests`` a repeat stay within the processor's queue (2,048 spans), which drops the rest."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "debugsite.settings")
    import django

    django.setup()
    from engines import otel
    from engines.protocol import CompletionRequest
    from engines.runtime import ChoiceDelta, GenerationRequest, RequestOutput, RequestTimes, SamplingParams

    otel.configure(endpoint)
    body = CompletionRequest(model="demo", prompt="Once upon a time", max_tokens=4)
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}

    class Request:
        pass

    request = Request()
    request.headers = headers

    async def outputs(t: float) -> object:
        yield RequestOutput("r", [ChoiceDelta(0, "a", [1], None, None)])
        yield RequestOutput("r", [ChoiceDelta(0, "b", [2], None, None)])
        yield RequestOutput("r", [ChoiceDelta(0, "c", [3], None, "length")],
                            {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
                            times=RequestTimes(t, t + 1e-4, t + 2e-4, t + 3e-4, t + 4e-4))

    async def one() -> None:
        t = time.perf_counter()
        generation = GenerationRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), arrival_time=t)
        span = otel.begin(request, body, generation, "demo")
        assert span is not None
        async for _ in span.watch(outputs(t)):
            pass

    async def run() -> float:
        for _ in range(200):
            await one()
        best = float("inf")
        for _ in range(5):
            began = time.perf_counter()
            for _ in range(requests):
                await one()
            best = min(best, (time.perf_counter() - began) / requests)
            otel.force_flush()
        return best * 1e6

    try:
        return asyncio.run(run())
    finally:
        otel.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="requests a server a round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    add_results_option(parser, "otel_overhead")
    args = parser.parse_args()
    if args.receiver:
        receiver()
        return
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((line for line in cpu.splitlines() if line.startswith("Model name")), "Model name: unknown"))
    collector = subprocess.Popen([sys.executable, __file__, "--receiver"], stdout=subprocess.PIPE, text=True)
    try:
        measure(args, collector)
    finally:
        collector.terminate()


def measure(args: argparse.Namespace, collector: subprocess.Popen) -> None:
    assert collector.stdout is not None
    live = f"http://127.0.0.1:{collector.stdout.readline().strip()}/v1/traces"
    # Bound, never listening, for the whole run: connections are refused, and no server started
    # meanwhile can take the port (bench/servers.py picks free ports too).
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{closed.getsockname()[1]}/v1/traces"
    flags = {"off": [], "dead": ["--otlp-traces-endpoint", dead], "on": ["--otlp-traces-endpoint", live]}
    env = {k: "" for k in os.environ if k.startswith("OTEL_")}
    servers = {}
    with tempfile.TemporaryDirectory(prefix="bench-otel-") as var:
        try:
            for mode in MODES:
                servers[mode] = launch(["--model", "demo", "--backend", "cpu", "--metrics-snapshot-interval", "0",
                                        *flags[mode]], var, env)
            rates: dict[str, list[float]] = {mode: [] for mode in MODES}
            sent = {mode: 0 for mode in MODES}
            for round_ in range(args.rounds + 1):  # the first warms every server up, uncounted
                for mode in MODES[round_ % 3:] + MODES[:round_ % 3]:
                    time.sleep(PAUSE_S)
                    rate = asyncio.run(round_of(servers[mode][1], args.requests, args.concurrency, args.max_tokens))
                    sent[mode] += args.requests
                    if round_:
                        rates[mode].append(rate)
                if round_:
                    print(f"round {round_}: " + ", ".join(f"{m} {rates[m][-1]:.1f}" for m in MODES), flush=True)
        finally:
            for process, _ in servers.values():
                process.send_signal(signal.SIGTERM)  # a drain, then the spans left are exported
            stderr = {mode: servers[mode][0].communicate(timeout=60)[1] for mode in servers}
    import httpx

    spans = int(httpx.get(live.replace("/v1/traces", "/")).text)
    closed.close()
    told = [line for line in stderr["dead"].splitlines() if "OpenTelemetry: exporting request spans" in line]
    warnings = len(told)
    print("the dead endpoint's server said:", *told, sep="\n  ")
    expected = sent["on"] * SPANS_PER_REQUEST
    print(f"received {spans} spans from the live server's {sent['on']} requests (expected {expected}); "
          f"the dead endpoint's server warned {warnings} time(s)")
    if spans != expected or warnings != 1 or "OpenTelemetry" in stderr["off"]:
        raise SystemExit("the spans did not arrive as they should: the figures would not mean what they say")
    median = {mode: statistics.median(values) for mode, values in rates.items()}
    cost_us = {mode: (1 / median[mode] - 1 / median["off"]) * 1e6 for mode in MODES}
    off_ns = off_path_ns()
    span_us = span_work_us(live)
    print(f"median requests/s of {args.rounds} rounds ({args.requests} requests, {args.concurrency} clients, "
          f"max_tokens {args.max_tokens}): " + ", ".join(f"{m} {median[m]:.1f}" for m in MODES))
    print(f"vs off: dead {median['dead'] / median['off']:.3f} ({cost_us['dead']:+.0f} µs a request), "
          f"on {median['on'] / median['off']:.3f} ({cost_us['on']:+.0f} µs a request)")
    print(f"off path: {off_ns:.0f} ns a request; span work when on: {span_us:.0f} µs a request "
          f"({this_machine()['cpu']})")
    results = ResultsFile(args.results, "otel_overhead")
    params = {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "rounds": args.rounds}
    labels = {"off": "off (no endpoint)", "dead": "on, endpoint down", "on": "on, exporting"}
    for mode in MODES:
        results.add("requests/s", median[mode], "req/s", mode=labels[mode], **params)
        if mode != "off":
            results.add("vs off", median[mode] / median["off"], "ratio", mode=labels[mode], **params)
    results.add("off path a request", off_ns, "ns", mode=labels["off"], **params)
    results.add("span work a request", span_us, "µs", mode=labels["on"], **params)


if __name__ == "__main__":
    main()
