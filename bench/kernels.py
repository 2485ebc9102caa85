"""Time each kernel of one decode step on its own, with the bytes it must move (llm.c's habit).

Every op is the backend's own method, the code the model runs, on a Llama layer's shapes
(the demo model's by default): a decode step of ``--batch`` sequences, each with ``--context``
tokens already in the paged KV cache. For each op the table gives the median time over
``--iters`` runs after a warm-up, the bytes it must read and write at the least (weights,
activations, KV pages), the achieved GB/s, and GFLOP/s where the op does arithmetic worth
counting. Compare GB/s with the machine's memory bandwidth: a decode step is memory-bound.

    python bench/kernels.py                                   # CPU, demo shapes, batch 32
    python bench/kernels.py --batch 1 --context 1024
    python bench/kernels.py --backend cuda --dtype float16    # on a GPU machine

Threads: ``--threads`` (default: all cores) is given to OpenBLAS and numba; it must be set
before numpy is imported, which is why the arguments are parsed first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                        help="weight and KV storage dtype (activations are float32)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default: the demo model's)")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    parser.add_argument("--intermediate", type=int, default=1408, help="MLP intermediate size")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size (the LM head and argmax)")
    parser.add_argument("--batch", type=int, default=32, help="sequences in the decode step (one new token each)")
    parser.add_argument("--context", type=int, default=256, help="tokens each sequence has in the KV cache")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=50, help="timed runs per op")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per op first")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads (default: all)")
    return parser.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    from cpu_threads import use_threads  # bench/ is the script's folder, first on sys.path

    use_threads(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread settings above)

from engines.runtime import StepInputs, rope_tables, select_backend  # noqa: E402


@dataclass
class OpResult:
    """One op's timing and the traffic it implies."""

    op: str
    shape: str
    median_s: float
    bytes_moved: int
    flops: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / self.median_s / 1e9

    @property
    def gflop_per_s(self) -> float:
        return self.flops / self.median_s / 1e9


def time_op(run: Callable[[], None], sync: Callable[[], None], warmup: int, iters: int) -> float:
    """Median seconds of ``run()`` (each run waited for with ``sync``)."""
    for _ in range(warmup):
        run()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(args: argparse.Namespace) -> list[OpResult]:
    """Build one layer's weights, a filled KV cache and a decode step's inputs; time every op."""
    rng = np.random.default_rng(0)
    be = select_backend(args.backend, args.dtype)
    H, I, V = args.hidden, args.intermediate, args.vocab
    hd = H // args.heads
    nq, nkv = args.heads, args.kv_heads
    B, C, P = args.batch, args.context, args.page_size
    T = B  # decode: one new token per sequence
    wsz = np.dtype(args.dtype).itemsize
    f32 = 4

    def weights(*shape: int) -> Any:
        return be.store_linear(rng.standard_normal(shape, dtype=np.float32) * 0.02, args.dtype)

    def activation(*shape: int) -> Any:
        return be.to_storage(rng.standard_normal(shape, dtype=np.float32), "float32")

    qkv_w, o_w = weights((nq + 2 * nkv) * hd, H), weights(H, nq * hd)
    gate_up_w, down_w, lm_head = weights(2 * I, H), weights(H, I), weights(V, H)
    table = be.to_storage(rng.standard_normal((V, H), dtype=np.float32), args.dtype)
    norm_w = be.to_storage(np.ones(H, np.float32), args.dtype)
    no_bias = be.to_storage(np.zeros(0, np.float32), "float32")
    pages_per_seq = -(-(C + 1) // P)
    kv_shape = (1, B * pages_per_seq, nkv, P, hd)
    k_cache = be.to_storage(rng.standard_normal(kv_shape, dtype=np.float32), args.dtype)
    v_cache = be.to_storage(rng.standard_normal(kv_shape, dtype=np.float32), args.dtype)
    cos, sin = (be.to_storage(a, "float32") for a in rope_tables(hd, 10000.0, C + 1))
    step = be.upload_step(StepInputs(
        token_ids=rng.integers(0, V, T).astype(np.int32),
        positions=np.full(T, C, np.int32),  # the new token sits after C cached ones
        token_seq=np.arange(T, dtype=np.int32),
        page_table=np.arange(B * pages_per_seq, dtype=np.int32).reshape(B, pages_per_seq),
        rows=np.arange(T, dtype=np.int32),
        logit_rows=np.arange(T, dtype=np.int32),
    ))
    hidden, residual, normed = activation(T, H), activation(T, H), activation(T, H)
    qkv, attn, delta = activation(T, (nq + 2 * nkv) * hd), activation(T, nq * hd), activation(T, H)
    gate_up, act, logits = activation(T, 2 * I), activation(T, I), activation(T, V)
    tokens_out = be.empty((T,), np.int32)
    eps, scale = np.float32(1e-5), np.float32(hd ** -0.5)
    if args.backend == "cuda":
        from numba import cuda

        sync: Callable[[], None] = cuda.synchronize
    else:
        def sync() -> None:
            return None

    def matmul_case(name: str, x: Any, w: Any, out: Any, rows: int, cols: int, inner: int) -> tuple:
        return (name, f"[{rows}x{inner}] @ [{cols}x{inner}]^T", lambda: be.matmul(x, w, no_bias, out),
                cols * inner * wsz + rows * (inner + cols) * f32, 2 * rows * inner * cols)

    kv_bytes = 2 * B * (C + 1) * nkv * hd * wsz
    cases = [
        ("embedding", f"{T} rows of [{V}x{H}]", lambda: be.embedding(step.token_ids, table, hidden),
         T * H * (wsz + f32), 0),
        ("add_rmsnorm", f"[{T}x{H}]", lambda: be.add_rmsnorm(hidden, residual, step.rows, norm_w, eps, normed),
         T * H * f32 * 4 + H * wsz, 5 * T * H),
        matmul_case("matmul qkv", normed, qkv_w, qkv, T, (nq + 2 * nkv) * hd, H),
        ("rope_kv_append", f"{T} tokens, {nq}+{nkv} heads x {hd}",
         lambda: be.rope_kv_append(qkv, step, cos, sin, k_cache, v_cache, 0, nq),
         T * ((nq + 2 * nkv) * hd * f32 + nq * hd * f32 + 2 * nkv * hd * wsz), 6 * T * (nq + nkv) * hd // 2),
        ("attention", f"{B} seqs x {C + 1} ctx, {nq}/{nkv} heads x {hd}",
         lambda: be.attention(qkv, step, k_cache, v_cache, 0, nq, scale, attn),
         kv_bytes + T * nq * hd * f32 * 2, 4 * T * nq * (C + 1) * hd),
        matmul_case("matmul o", attn, o_w, delta, T, H, nq * hd),
        matmul_case("matmul gate_up", normed, gate_up_w, gate_up, T, 2 * I, H),
        ("silu_mul", f"[{T}x{2 * I}] -> [{T}x{I}]", lambda: be.silu_mul(gate_up, act), T * 3 * I * f32, 4 * T * I),
        matmul_case("matmul down", act, down_w, delta, T, H, I),
        matmul_case("matmul lm_head", normed, lm_head, logits, T, V, H),
        ("argmax", f"[{T}x{V}]", lambda: be.argmax(logits, tokens_out), T * V * f32 + T * 4, 0),
    ]
    return [OpResult(name, shape, time_op(run, sync, args.warmup, args.iters), nbytes, flops)
            for name, shape, run, nbytes, flops in cases]


def main() -> None:
    args = ARGS or parse_args()
    results = bench(args)
    print(f"backend {args.backend}, {args.dtype} storage, {args.threads} threads; hidden {args.hidden}, "
          f"heads {args.heads}/{args.kv_heads}, intermediate {args.intermediate}, vocab {args.vocab}; "
          f"decode batch {args.batch} over {args.context} cached tokens; median of {args.iters}")
    print(f"{'op':<16} {'shape':<34} {'µs':>9} {'KB moved':>10} {'GB/s':>8} {'GFLOP/s':>8}")
    for r in results:
        gflops = f"{r.gflop_per_s:8.1f}" if r.flops else f"{'':>8}"
        print(f"{r.op:<16} {r.shape:<34} {r.median_s * 1e6:9.1f} {r.bytes_moved / 1024:10.1f} "
              f"{r.gb_per_s:8.2f} {gflops}")
    total = sum(r.median_s for r in results)
    print(f"{'one layer + head':<51} {total * 1e6:9.1f}")


if __name__ == "__main__":
    main()
