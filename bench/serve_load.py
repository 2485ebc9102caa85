"""Serving overhead under load: tokens/s through HTTP vs the engine alone, TTFT, debug-endpoint latency.

For each client count (default 16 and 64) the same requests run twice in one run:

1. **engine alone**: an in-process ``AsyncEngine`` (the demo model, or ``--model``; same sizing),
   one coroutine per client calling ``generate`` directly;
2. **through HTTP**: ``manage.py serve`` in a subprocess, one streaming
   ``/v1/chat/completions`` client per connection (httpx), while a side task
   polls ``/debug/dump_engine_metrics`` (every 100 ms) to time it under load.

The two alternate (``--repeats`` times) so that load drifting on a shared machine
hits both sides alike; the client's own CPU use counts against HTTP, as it would
on one box.

Every request ignores EOS (``debug_config.ignore_eos`` over HTTP, ``SamplingParams.ignore_eos``
for the engine alone), so each produces exactly ``--max-tokens`` tokens and both sides do
identical work. Reported: output tokens/s of each, their ratio (HTTP / engine; the goal is
>= 0.9), TTFT p50/p99 of both, and the metrics endpoint's p99 latency while serving (and, for
comparison, ``AsyncEngine.metrics()``'s in the engine-alone runs).

    .venv/bin/python bench/serve_load.py                  # 16 and 64 clients
    .venv/bin/python bench/serve_load.py --clients 16 --max-tokens 128 --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from cpu_threads import use_threads  # bench/ is the script's folder, first on sys.path
from results_file import add_results_option, ResultsFile
from servers import launch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT = [{"role": "user", "content": "Tell me everything you know about lighthouses and the people who keep them."}]


@dataclass
class PhaseResult:
    """One load phase: throughput, time to first token, (HTTP only) metrics-endpoint latency, and CPU use.

    CPU seconds are split by where they went: ``engine_cpu_s`` every thread of the process that
    holds the engine except its main thread (the engine thread or the engine process's reader,
    the numba/BLAS workers) plus its child processes (the engine process),
    ``loop_cpu_s`` that process's main thread (the server's event loop; for the engine alone
    the client coroutines), ``client_cpu_s`` the HTTP load generator (this process).
    """

    tokens: int
    seconds: float
    ttft_s: list[float] = field(default_factory=list)
    metrics_latency_s: list[float] = field(default_factory=list)
    engine_cpu_s: float = 0.0
    loop_cpu_s: float = 0.0
    client_cpu_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def thread_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of ``pid``'s main thread, and of all its other threads and its child processes
    (the engine process) together (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    main = others = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            children = (task / "children").read_text().split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        if int(task.name) == pid:
            main += seconds
        else:
            others += seconds
        for child in children:
            others += sum(thread_cpu(int(child)))
    return main, others


def timed(pid: int, run, with_client: bool = False) -> PhaseResult:
    """Run a phase coroutine and charge the CPU that ``pid`` (and, for HTTP, this process) spent."""
    main0, others0 = thread_cpu(pid)
    client0 = os.times()
    result = asyncio.run(run)
    main1, others1 = thread_cpu(pid)
    client1 = os.times()
    result.loop_cpu_s = main1 - main0
    result.engine_cpu_s = others1 - others0
    if with_client:
        result.client_cpu_s = (client1.user - client0.user) + (client1.system - client0.system)
    return result


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1), linearly interpolated between order statistics; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


# ------------------------------------------------------------------------- engine alone


async def run_engine_alone(engine, clients: int, requests_per_client: int, max_tokens: int,
                           poll_interval: float | None = None) -> PhaseResult:
    """The same requests as the HTTP phase, straight into ``AsyncEngine.generate``, with
    ``AsyncEngine.metrics()`` timed every ``poll_interval`` s (the engine's side of the debug call)."""
    from engines.runtime import GenerationRequest, SamplingParams

    tokenizer = engine.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(PROMPT), add_special_tokens=False)
    ttfts: list[float] = []
    tokens = 0
    counter = 0

    async def client() -> None:
        nonlocal tokens, counter
        for _ in range(requests_per_client):
            counter += 1
            request = GenerationRequest(
                request_id=f"bench-{counter}", prompt=list(prompt),
                sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            )
            start = time.perf_counter()
            first = True
            async for output in engine.generate(request):
                if first and any(c.token_ids for c in output.choices):
                    ttfts.append(time.perf_counter() - start)
                    first = False
                if output.usage is not None:
                    tokens += output.usage["completion_tokens"]

    metrics_latency: list[float] = []
    done = asyncio.Event()

    async def poller() -> None:
        while not done.is_set():
            begin = time.perf_counter()
            await engine.metrics()
            metrics_latency.append(time.perf_counter() - begin)
            await asyncio.sleep(poll_interval)

    poll_task = asyncio.create_task(poller()) if poll_interval else None
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    seconds = time.perf_counter() - start
    done.set()
    if poll_task is not None:
        await poll_task
    return PhaseResult(tokens=tokens, seconds=seconds, ttft_s=ttfts, metrics_latency_s=metrics_latency)


def start_engine(args: argparse.Namespace):
    """The in-process engine of the "engine alone" runs, sized like the server's."""
    from engines.startup import ModelSpec, build_engines
    from engines.runtime import EngineConfig

    (engine,) = build_engines([ModelSpec.parse(args.model)], EngineConfig(**sizing(args)), backend=args.backend)
    engine.start()
    return engine


# ------------------------------------------------------------------------------- HTTP


async def run_http(base: str, model: str, clients: int, requests_per_client: int, max_tokens: int,
                   poll_interval: float | None, client_kind: str) -> PhaseResult:
    """N streaming chat clients on their own connections, plus a metrics poller every ``poll_interval`` s."""
    ttfts: list[float] = []
    metrics_latency: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "debug_config": {"ignore_eos": True}}

    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        async def client() -> None:
            nonlocal tokens
            stream = RawSSEStream(base) if client_kind == "raw" else HttpxSSEStream(http)
            try:
                for _ in range(requests_per_client):
                    ttft, completion_tokens = await stream.chat(body)
                    ttfts.append(ttft)
                    tokens += completion_tokens
            finally:
                await stream.close()

        done = asyncio.Event()

        async def poller() -> None:
            while not done.is_set():
                start = time.perf_counter()
                response = await http.post("/debug/dump_engine_metrics", content=b"{}")
                response.raise_for_status()
                metrics_latency.append(time.perf_counter() - start)
                await asyncio.sleep(poll_interval)

        poll_task = asyncio.create_task(poller()) if poll_interval else None
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        seconds = time.perf_counter() - start
        done.set()
        if poll_task is not None:
            await poll_task
    return PhaseResult(tokens=tokens, seconds=seconds, ttft_s=ttfts, metrics_latency_s=metrics_latency)


def usage_tokens(body: bytes) -> int:
    """``completion_tokens`` of the usage event, the last ``data:`` event before ``[DONE]``."""
    events = [e for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    if len(events) < 2 or events[-1] != b"data: [DONE]":
        raise RuntimeError(f"the stream did not end with a usage event and [DONE]: {body[-200:]!r}")
    return json.loads(events[-2][len(b"data: "):])["usage"]["completion_tokens"]


class HttpxSSEStream:
    """One streaming request at a time through httpx (what a Python client would use)."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def chat(self, body: dict) -> tuple[float, int]:
        start = time.perf_counter()
        ttft = 0.0
        received = bytearray()
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for data in response.aiter_raw():
                if not ttft:
                    ttft = time.perf_counter() - start
                received += data
        return ttft, usage_tokens(bytes(received))

    async def close(self) -> None:
        pass


class RawSSEStream(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that posts a streaming request and collects its chunked
    body with a buffer append per chunk: a load generator that takes as little CPU as it can from
    the server it shares the machine with (as wrk does in C). It checks what it counts: a 200,
    the chunked body's end, the usage event."""

    def __init__(self, base: str) -> None:
        self.host, _, port = base.removeprefix("http://").partition(":")
        self.port = int(port or 80)
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.first: asyncio.Future | None = None
        self.done: asyncio.Future | None = None

    async def chat(self, body: dict) -> tuple[float, int]:
        loop = asyncio.get_running_loop()
        if self.transport is None or self.transport.is_closing():
            await loop.create_connection(lambda: self, self.host, self.port)
        payload = json.dumps(body).encode()
        self.buffer.clear()
        self.first, self.done = loop.create_future(), loop.create_future()
        start = time.perf_counter()
        self.transport.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (self.host.encode(), len(payload), payload))
        await self.first
        ttft = time.perf_counter() - start
        await self.done
        head, _, chunked = bytes(self.buffer).partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"HTTP error: {head[:200]!r}")
        return ttft, usage_tokens(_dechunk(chunked))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.first is not None and not self.first.done():
            self.first.set_result(None)
        # The last chunk of a chunked body; SSE data ends in a blank line, never in this.
        if self.buffer.endswith(b"\r\n0\r\n\r\n") and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        for future in (self.first, self.done):
            if future is not None and not future.done():
                future.set_exception(ConnectionError(f"the server closed the connection: {exc}"))

    async def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body."""
    out = bytearray()
    pos = 0
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """``manage.py serve`` with the same sizing, debug on (for the metrics endpoint), tracing off."""
    command = ["--model", args.model, "--enable-debug", "--backend", args.backend, "--engine-mode", args.engine_mode]
    for key, value in sizing(args).items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    return launch(command, args.var_dir)


def sizing(args: argparse.Namespace) -> dict[str, int]:
    """Engine sizing shared by both phases, so they serve the same way."""
    return {"max_num_seqs": args.max_num_seqs, "max_total_tokens": args.max_total_tokens,
            "prefill_chunk_size": args.prefill_chunk_size}


# ------------------------------------------------------------------------------- main


def merge(results: list[PhaseResult]) -> PhaseResult:
    """Several runs as one: tokens and seconds add up, samples pool."""
    return PhaseResult(
        tokens=sum(r.tokens for r in results),
        seconds=sum(r.seconds for r in results),
        ttft_s=[t for r in results for t in r.ttft_s],
        metrics_latency_s=[t for r in results for t in r.metrics_latency_s],
        engine_cpu_s=sum(r.engine_cpu_s for r in results),
        loop_cpu_s=sum(r.loop_cpu_s for r in results),
        client_cpu_s=sum(r.client_cpu_s for r in results),
    )


def measure(args: argparse.Namespace, engine, server: subprocess.Popen, base: str,
            clients: int) -> dict[str, object]:
    """Warm both sides up, then alternate engine-alone and HTTP runs so drifting machine load hits both."""
    asyncio.run(run_engine_alone(engine, clients, 1, 4))  # JIT and first-touch costs are not what we measure
    asyncio.run(run_http(base, engine.name, clients, 1, 4, poll_interval=None, client_kind=args.client))
    alone_runs, http_runs = [], []
    for _ in range(args.repeats):
        alone_runs.append(timed(os.getpid(), run_engine_alone(engine, clients, args.requests_per_client,
                                                              args.max_tokens, poll_interval=args.poll_interval)))
        http_runs.append(timed(server.pid, run_http(base, engine.name, clients, args.requests_per_client,
                                                    args.max_tokens, poll_interval=args.poll_interval,
                                                    client_kind=args.client),
                               with_client=True))
    alone, http = merge(alone_runs), merge(http_runs)
    return {
        "clients": clients,
        "requests": clients * args.requests_per_client * args.repeats,
        "max_tokens": args.max_tokens,
        "engine_tok_s": round(alone.tokens_per_s, 1),
        "http_tok_s": round(http.tokens_per_s, 1),
        "ratio": round(http.tokens_per_s / alone.tokens_per_s, 3) if alone.tokens_per_s else 0.0,
        "run_ratios": [round(h.tokens_per_s / a.tokens_per_s, 3) for a, h in zip(alone_runs, http_runs, strict=True)],
        "engine_ttft_p50_ms": round(1000 * percentile(alone.ttft_s, 0.5), 1),
        "engine_ttft_p99_ms": round(1000 * percentile(alone.ttft_s, 0.99), 1),
        "http_ttft_p50_ms": round(1000 * percentile(http.ttft_s, 0.5), 1),
        "http_ttft_p99_ms": round(1000 * percentile(http.ttft_s, 0.99), 1),
        "metrics_p99_ms": round(1000 * percentile(http.metrics_latency_s, 0.99), 1),
        "engine_metrics_p99_ms": round(1000 * percentile(alone.metrics_latency_s, 0.99), 1),
        "metrics_calls": len(http.metrics_latency_s),
        # CPU time per generated token, in microseconds: where the cores went.
        "engine_cpu_us_per_token": round(1e6 * alone.engine_cpu_s / alone.tokens),
        "http_engine_cpu_us_per_token": round(1e6 * http.engine_cpu_s / http.tokens),
        "http_server_loop_cpu_us_per_token": round(1e6 * http.loop_cpu_s / http.tokens),
        "http_client_cpu_us_per_token": round(1e6 * http.client_cpu_s / http.tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="alternating engine/HTTP runs per client count")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="demo",
                        help="what both sides serve: demo, or a checkpoint folder (optionally PATH:NAME)")
    parser.add_argument("--poll-interval", type=float, default=0.1,
                        help="seconds between /debug/dump_engine_metrics calls during the HTTP runs")
    parser.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--engine-mode", choices=("process", "thread"), default="process",
                        help="the server's engine loop: in its own process (serve's default) or on a thread")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw",
                        help="load generator: raw HTTP/1.1 over asyncio (lean) or httpx")
    parser.add_argument("--threads", type=int,
                        help="compute threads of the CPU engine, both sides (default: one per core)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--prefill-chunk-size", type=int, default=512)
    parser.add_argument("--var-dir", default=str(REPO / "var" / "bench"), help="database folder for the server")
    parser.add_argument("--json", help="also write the results here")
    add_results_option(parser, "serve_load")
    args = parser.parse_args()
    results = ResultsFile(args.results, "serve_load")
    if args.threads:
        use_threads(args.threads)  # before numba loads, here and (inherited) in the server and its engine process
    Path(args.var_dir).mkdir(parents=True, exist_ok=True)

    engine = start_engine(args)
    server, base = start_server(args)
    rows = []
    try:
        for clients in args.clients:
            row = measure(args, engine, server, base, clients)
            rows.append(row)
            print(
                f"{clients:>3} clients: engine {row['engine_tok_s']:>7.1f} tok/s | HTTP {row['http_tok_s']:>7.1f} tok/s"
                f" | ratio {row['ratio']:.3f} (runs {row['run_ratios']}) | TTFT p50/p99 engine "
                f"{row['engine_ttft_p50_ms']}/{row['engine_ttft_p99_ms']} ms, HTTP {row['http_ttft_p50_ms']}/"
                f"{row['http_ttft_p99_ms']} ms | dump_engine_metrics p99 {row['metrics_p99_ms']} ms "
                f"({row['metrics_calls']} calls; AsyncEngine.metrics() alone {row['engine_metrics_p99_ms']} ms)\n"
                f"     CPU us/token: engine alone {row['engine_cpu_us_per_token']}; HTTP: engine "
                f"{row['http_engine_cpu_us_per_token']}, server event loop {row['http_server_loop_cpu_us_per_token']}, "
                f"client {row['http_client_cpu_us_per_token']}",
                flush=True,
            )
            record(results, args, row)
    finally:
        server.terminate()
        server.wait(30)
        engine.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


#: A row's figures as the results file names them: (metric, the row's key, unit).
FIGURES = (
    ("engine alone", "engine_tok_s", "tok/s"), ("HTTP", "http_tok_s", "tok/s"), ("HTTP/engine", "ratio", "ratio"),
    ("engine TTFT p50", "engine_ttft_p50_ms", "ms"), ("engine TTFT p99", "engine_ttft_p99_ms", "ms"),
    ("HTTP TTFT p50", "http_ttft_p50_ms", "ms"), ("HTTP TTFT p99", "http_ttft_p99_ms", "ms"),
    ("dump_engine_metrics p99", "metrics_p99_ms", "ms"), ("AsyncEngine.metrics() p99", "engine_metrics_p99_ms", "ms"),
    ("CPU a token: engine alone", "engine_cpu_us_per_token", "µs"),
    ("CPU a token: HTTP, engine", "http_engine_cpu_us_per_token", "µs"),
    ("CPU a token: HTTP, server event loop", "http_server_loop_cpu_us_per_token", "µs"),
    ("CPU a token: HTTP, load client", "http_client_cpu_us_per_token", "µs"),
)


def record(results: ResultsFile, args: argparse.Namespace, row: dict[str, object]) -> None:
    """One client count's figures into the results file."""
    where = {"model": args.model, "backend": args.backend, "engine_mode": args.engine_mode,
             "threads": args.threads or "all", "client": args.client, "max_tokens": args.max_tokens,
             "clients": row["clients"]}
    for metric, key, unit in FIGURES:
        results.add(metric, row[key], unit, **where)


if __name__ == "__main__":
    main()
