"""Offline engine throughput, and the cost of tracing, on the demo model.

Two measurements, each side by side in one run:
1. Offline throughput: N requests with mixed prompt and output lengths go into the
   engine at once; report generated tokens/s and total (prompt + generated) tokens/s.
2. Tracing on vs off: the same workload alternately with and without the trace
   recorder; median throughput of each and the ratio (goal >= 0.98).

    .venv/bin/python bench/engine_throughput.py                       # CPU, defaults
    .venv/bin/python bench/engine_throughput.py --backend cuda --dtype float16
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results_file import add_results_option, ResultsFile  # noqa: E402
from engines.runtime import (  # noqa: E402
    demo_checkpoint_path,
    Engine,
    EngineConfig,
    GenerationRequest,
    LlamaModel,
    load_checkpoint,
    SamplingParams,
    TraceRecorder,
)


def workload(num_requests: int, vocab: int, seed: int, max_prompt: int, max_output: int) -> list[tuple[list[int], int]]:
    """Mixed lengths: prompts 8..max_prompt, outputs 8..max_output, log-uniform like real traffic."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_requests):
        p = int(np.exp(rng.uniform(np.log(8), np.log(max_prompt))))
        o = int(np.exp(rng.uniform(np.log(8), np.log(max_output))))
        out.append((list(map(int, rng.integers(300, vocab - 10, size=p))), o))
    return out


def run(engine: Engine, jobs: list[tuple[list[int], int]], tag: str) -> tuple[float, int, int]:
    """Run every job to completion; (seconds, prompt tokens, generated tokens)."""
    for i, (prompt, out_len) in enumerate(jobs):
        engine.add_request(GenerationRequest(
            f"{tag}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)))
    generated = 0
    t0 = time.perf_counter()
    while engine.has_work:
        for out in engine.step():
            generated += sum(len(c.token_ids) for c in out.choices)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(p) for p, _ in jobs), generated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--requests", type=int, default=256, help="offline throughput workload size")
    ap.add_argument("--trace-requests", type=int, default=64, help="workload size of each tracing on/off run")
    ap.add_argument("--repeat", type=int, default=5, help="alternating on/off runs for the tracing ratio")
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--prefill-chunk-size", type=int, default=512)
    add_results_option(ap, "engine_throughput")
    args = ap.parse_args()
    results = ResultsFile(args.results, "engine_throughput")

    ckpt = load_checkpoint(demo_checkpoint_path())
    model = LlamaModel.from_checkpoint(ckpt, backend=args.backend, dtype=args.dtype)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_total_tokens=args.max_num_seqs * 512,
                          prefill_chunk_size=args.prefill_chunk_size, enable_prefix_cache=False)
    print(f"# demo model ({ckpt.num_parameters / 1e6:.1f}M params), backend {model.backend_name}, "
          f"dtype {args.dtype}, {platform.processor() or platform.machine()}, {os.cpu_count()} cpus")

    warm = Engine(model, ckpt, config)
    run(warm, workload(8, ckpt.config.vocab_size, 99, 64, 16), "warm")  # compile kernels first

    jobs = workload(args.requests, ckpt.config.vocab_size, 0, args.max_prompt, args.max_output)
    secs, prompt_toks, gen = run(Engine(model, ckpt, config), jobs, "offline")
    print(f"offline: {args.requests} requests, {prompt_toks} prompt + {gen} generated tokens in {secs:.2f} s: "
          f"{gen / secs:.1f} generated tok/s, {(prompt_toks + gen) / secs:.1f} total tok/s")
    setting = {"backend": model.backend_name, "dtype": args.dtype}
    for metric, value, unit in (("generated", gen / secs, "tok/s"), ("total", (prompt_toks + gen) / secs, "tok/s"),
                                ("wall", secs, "s"), ("prompt tokens", prompt_toks, "tokens"),
                                ("generated tokens", gen, "tokens")):
        results.add(metric, value, unit, workload="offline", requests=args.requests, **setting)

    jobs = workload(args.trace_requests, ckpt.config.vocab_size, 1, args.max_prompt, args.max_output)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    events = 0
    for i in range(args.repeat):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            tracer = TraceRecorder(engine="demo", model="demo", backend=model.backend_name) if mode == "on" else None
            secs, prompt_toks, gen = run(Engine(model, ckpt, config, tracer), jobs, f"t{i}{mode}")
            rates[mode].append((prompt_toks + gen) / secs)
            if tracer is not None:
                events = tracer.event_count
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"tracing: {args.trace_requests} requests x {args.repeat} alternating runs; median total tok/s "
          f"off {off:.1f}, on {on:.1f}; ratio on/off {on / off:.3f} ({events} events per traced run)")
    for metric, value, unit in (("tracing off", off, "tok/s"), ("tracing on", on, "tok/s"),
                                ("on/off", on / off, "ratio"), ("events per traced run", events, "events")):
        results.add(metric, value, unit, workload="tracing on/off", requests=args.trace_requests, runs=args.repeat,
                    **setting)


if __name__ == "__main__":
    main()
