"""Disaggregated serving against one server, and the KV transfer against a plain loopback copy.

1. **Load** (``--part load``): the same concurrent streaming completions (distinct random
   prompts, EOS ignored) through a router in front of a prefill and a decode server, and through
   one server. Rounds alternate; per side: TTFT p50/p99 and output tokens/s, medians over rounds.
2. **Transfer** (``--part transfer``): a window of K/V from this process to a decode server's
   engine's K/V listener (the ``kv_url`` of prep_recv's metadata: encode, checksums, HTTP, the
   engine process reading into the block, the page writes: the real path of a cross-server
   ``remote_send`` once the prefill engine has the block), against the same number
   of bytes sent over a plain loopback TCP socket to a process that only reads them. Alternated,
   medians; the goal is transfer / plain >= 0.5.

    .venv/bin/python bench/disagg.py
    .venv/bin/python bench/disagg.py --part transfer --tokens 512 1900
    .venv/bin/python bench/disagg.py --part load --split-cores
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from cpu_threads import THREAD_VARIABLES
from results_file import add_results_option, ResultsFile
from servers import REPO, free_port, launch  # bench/ is the script's folder, first on sys.path

sys.path.insert(0, str(REPO))

from engines.protocol.microserving import KVAppendMetadata  # noqa: E402
from engines.runtime import KVBlock, ModelIdentity, post_block, wire_size  # noqa: E402

SINK = r"""
import socket, sys
server = socket.socket(); server.bind(("127.0.0.1", int(sys.argv[1]))); server.listen(1)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    size = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
    buf = bytearray(1 << 20); view = memoryview(buf); got = 0
    while got < size:
        n = conn.recv_into(view)
        if not n: break
        got += n
    conn.sendall(b"k"); conn.close()
"""


# ------------------------------------------------------------------------------------------ load


async def stream_one(http: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """One streaming completion: (TTFT, output tokens)."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "debug_config": {"ignore_eos": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", f"{base}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise SystemExit(f"{base} answered {reply.status_code}: {(await reply.aread()).decode()[:300]}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and any(c.get("text") for c in event.get("choices") or []):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft or float("nan"), tokens


async def load_round(base: str, clients: int, per_client: int, prompt_len: int, max_tokens: int,
                     rng: np.random.Generator) -> dict[str, float]:
    prompts = [list(map(int, rng.integers(300, 4000, size=prompt_len))) for _ in range(clients * per_client)]
    ttfts: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(timeout=600) as http:
        async def client(i: int) -> None:
            nonlocal tokens
            for j in range(per_client):
                ttft, n = await stream_one(http, base, prompts[i * per_client + j], max_tokens)
                ttfts.append(ttft)
                tokens += n
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        seconds = time.perf_counter() - t0
    ttfts.sort()
    return {"tokens_per_s": tokens / seconds, "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]}


def run_load(args: argparse.Namespace) -> dict:
    serve = ["--enable-debug", "--backend", "cpu", "--max-num-seqs", str(args.clients), "--max-total-tokens",
             str(args.max_total_tokens), "--prefill-chunk-size", "512"]
    procs = []
    try:
        single, single_url = launch(serve, args.var_dir / "single")
        # --split-cores: the prefill and decode engines one compute thread each (the single server keeps
        # all), so the two halves do not oversubscribe a small machine's cores.
        split = {name: "1" for name in THREAD_VARIABLES} if args.split_cores else None
        prefill, prefill_url = launch(serve, args.var_dir / "prefill", env=split)
        decode, decode_url = launch(serve, args.var_dir / "decode", env=split)
        procs = [single, prefill, decode]
        router, router_url = launch(["--router", "disagg", "--prefill-url", prefill_url, "--decode-url", decode_url],
                                    args.var_dir / "router")
        procs.append(router)
        rng = np.random.default_rng(0)
        sides: dict[str, list[dict[str, float]]] = {"single": [], "disaggregated": []}
        asyncio.run(load_round(single_url, 2, 1, args.prompt_len, 4, rng))  # warm both paths
        asyncio.run(load_round(router_url, 2, 1, args.prompt_len, 4, rng))
        for r in range(args.rounds):
            for name, url in (("single", single_url), ("disaggregated", router_url))[:: 1 if r % 2 == 0 else -1]:
                sides[name].append(asyncio.run(load_round(url, args.clients, args.per_client, args.prompt_len,
                                                          args.max_tokens, rng)))
                print(name, {k: round(v, 4) for k, v in sides[name][-1].items()}, flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    summary = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in sides.items()}
    summary["ratio_tokens_per_s"] = summary["disaggregated"]["tokens_per_s"] / summary["single"]["tokens_per_s"]
    summary["ratio_ttft_p50"] = summary["disaggregated"]["ttft_p50_s"] / summary["single"]["ttft_p50_s"]
    return summary


# -------------------------------------------------------------------------------------- transfer


def plain_copy(port: int, body: list[bytes]) -> float:
    """Seconds to send ``body``'s bytes to the sink over loopback TCP and hear it has them all."""
    import socket

    size = sum(len(c) for c in body)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(size.to_bytes(8, "little"))
        for chunk in body:
            sock.sendall(chunk)
        assert sock.recv(1) == b"k"
    return time.perf_counter() - t0


def kv_transfer(http: httpx.Client, base: str, tokens: int, rng: np.random.Generator) -> tuple[float, int]:
    """Reserve ``tokens`` on the decode server, then time one streamed transfer into it."""
    prompt = list(map(int, rng.integers(300, 4000, size=tokens + 1)))
    user = f"bench-{rng.integers(1 << 62)}"
    prep = http.post(f"{base}/microserving/prep_recv", json={"model": "demo", "prompt": prompt, "user": user,
                                                              "end": tokens})
    prep.raise_for_status()
    metadata = KVAppendMetadata.decode(prep.json()["kv_append_metadata"])
    ident = ModelIdentity(**metadata.identity)
    shape = (ident.num_layers, ident.num_kv_heads, tokens, ident.head_dim)
    block = KVBlock(user, metadata.receiver.ticket, 0, tokens, ident,
                    rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
    t0 = time.perf_counter()
    post_block(metadata.receiver.kv_url, block)
    seconds = time.perf_counter() - t0
    http.post(f"{base}/debug/reset_engine", json={"model": "demo"}).raise_for_status()  # frees the pages
    return seconds, wire_size(block)


def run_transfer(args: argparse.Namespace) -> dict:
    port = free_port()
    sink = subprocess.Popen([sys.executable, "-c", SINK, str(port)], stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    decode, base = launch(["--enable-debug", "--backend", "cpu", "--max-total-tokens", "4096"],
                          args.var_dir / "transfer")
    rng = np.random.default_rng(1)
    results = {}
    try:
        with httpx.Client(timeout=120) as http:
            kv_transfer(http, base, 64, rng)  # warm
            for tokens in args.tokens:
                ours, plain = [], []
                for _ in range(args.rounds):
                    seconds, size = kv_transfer(http, base, tokens, rng)
                    ours.append(size / seconds)
                    body = [bytes(1 << 20)] * (size >> 20) + [bytes(size & ((1 << 20) - 1))]
                    plain.append(size / plain_copy(port, body))
                row = {"bytes": size, "transfer_MBps": statistics.median(ours) / 1e6,
                       "plain_MBps": statistics.median(plain) / 1e6}
                row["ratio"] = row["transfer_MBps"] / row["plain_MBps"]
                results[str(tokens)] = row
                print(tokens, {k: round(v, 3) for k, v in row.items()}, flush=True)
    finally:
        decode.terminate()
        sink.kill()
        decode.wait(30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("load", "transfer", "both"), default="both")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--per-client", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--split-cores", action="store_true",
                        help="one compute thread for each of the prefill and decode engines")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 1900],
                        help="window sizes of the transfer part (16 KiB a token on the demo model)")
    parser.add_argument("--var-dir", type=Path, default=REPO / "var" / "bench-disagg")
    parser.add_argument("--json", type=Path, help="also write the results here")
    add_results_option(parser, "disagg")
    args = parser.parse_args()
    results = ResultsFile(args.results, "disagg")
    out = {}
    if args.part in ("transfer", "both"):
        out["transfer"] = run_transfer(args)
        for tokens, row in out["transfer"].items():
            for metric, value, unit in (("K/V transfer", row["transfer_MBps"], "MB/s"),
                                        ("plain loopback", row["plain_MBps"], "MB/s"),
                                        ("transfer/plain", row["ratio"], "ratio"),
                                        ("window", row["bytes"] / 1e6, "MB")):
                results.add(metric, value, unit, part="transfer", window_tokens=int(tokens))
    if args.part in ("load", "both"):
        out["load"] = run_load(args)
        where = {"part": "load", "split_cores": args.split_cores, "clients": args.clients,
                 "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
        for side in ("single", "disaggregated"):
            for metric, key, unit in (("output", "tokens_per_s", "tok/s"), ("TTFT p50", "ttft_p50_s", "s"),
                                      ("TTFT p99", "ttft_p99_s", "s")):
                results.add(metric, out["load"][side][key], unit, setup=side, **where)
        results.add("disaggregated/single, tok/s", out["load"]["ratio_tokens_per_s"], "ratio", **where)
        results.add("disaggregated/single, TTFT p50", out["load"]["ratio_ttft_p50"], "ratio", **where)
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
