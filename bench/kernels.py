"""Time each kernel of one decode step on its own, with the bytes it must move (llm.c's habit).

Every op is the backend's own method, the code the model runs, on a Llama layer's shapes:
``--shape demo`` (the demo model's, the default) or ``--shape llama-1b`` (Llama 3.2 1B), any
size overridden by its own flag. The step decodes one new token for each of ``--batch``
sequences, each with ``--context`` tokens already in the paged KV cache. For each op the
table gives the median time over ``--iters`` runs after a warm-up, how often a decode step
of ``--layers`` layers runs it, the bytes it must read and write at the least (weights,
activations, KV pages), the achieved GB/s, and GFLOP/s where the op does arithmetic worth
counting. Compare GB/s with the memory bandwidth: a decode step is memory-bound. An op whose
bytes fit in a cache reads them from there, on every run after the first.

Each op runs as the model runs a step, through ``run_step``: on a GPU a step of at most
64 tokens is a recorded CUDA graph replayed, so a time there includes one graph launch and
the wait for it, not numba's per-kernel launch cost.

    python bench/kernels.py                                   # CPU, demo shapes, batch 32
    python bench/kernels.py --shape llama-1b --batch 1 --context 1024 --iters 10
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

from results_file import add_results_option, ResultsFile  # bench/ is the script's folder, first on sys.path

# Layer shapes: hidden, query heads, kv heads, MLP intermediate, vocabulary, layers.
SHAPES: dict[str, dict[str, int]] = {
    "demo": {"hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1408, "vocab": 4096, "layers": 8},
    "llama-1b": {"hidden": 2048, "heads": 32, "kv_heads": 8, "intermediate": 8192, "vocab": 128256, "layers": 16},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                        help="weight and KV storage dtype (activations are float32; the cpu backend stores float32)")
    parser.add_argument("--shape", default="demo", choices=sorted(SHAPES),
                        help="layer shapes to start from (default: demo); the flags below override them")
    parser.add_argument("--hidden", type=int, help="hidden size")
    parser.add_argument("--heads", type=int, help="query heads")
    parser.add_argument("--kv-heads", type=int, help="key/value heads")
    parser.add_argument("--intermediate", type=int, help="MLP intermediate size")
    parser.add_argument("--vocab", type=int, help="vocabulary size (the LM head and argmax)")
    parser.add_argument("--layers", type=int, help="decoder layers (only for the whole step's estimate)")
    parser.add_argument("--batch", type=int, default=32, help="sequences in the decode step, one new token each")
    parser.add_argument("--context", type=int, default=256, help="tokens each sequence has in the KV cache")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=50, help="timed runs per op")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per op first")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads (default: all)")
    add_results_option(parser, "kernels")
    args = parser.parse_args(argv)
    for name, value in SHAPES[args.shape].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    from cpu_threads import use_threads  # bench/ is the script's folder, first on sys.path

    use_threads(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread settings above)

from engines.runtime import StepInputs, rope_tables, select_backend  # noqa: E402


@dataclass
class OpCase:
    """One op to time: what it runs, on what, how often a decode step runs it, and its traffic."""

    op: str
    shape: str
    run: Callable[[], None]
    per_step: int
    bytes_moved: int
    flops: int = 0


@dataclass
class OpResult:
    """One op's median time and the traffic it implies."""

    case: OpCase
    median_s: float

    @property
    def gb_per_s(self) -> float:
        return self.case.bytes_moved / self.median_s / 1e9

    @property
    def gflop_per_s(self) -> float:
        return self.case.flops / self.median_s / 1e9


def time_op(be: Any, case: OpCase, tokens: int, sync: Callable[[], None], warmup: int, iters: int) -> float:
    """Median seconds of the op run as a one-op step (each run waited for with ``sync``)."""
    def step() -> None:
        be.run_step((case,), tokens, case.run)  # the case is this op's graph key on a GPU

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_cases(be: Any, args: argparse.Namespace) -> list[OpCase]:
    """One layer's weights, a filled KV cache and a decode step's inputs; each op of the step."""
    rng = np.random.default_rng(0)
    H, I, V, L = args.hidden, args.intermediate, args.vocab, args.layers  # noqa: E741 - shape letters, as papers write them
    nq, nkv, hd = args.heads, args.kv_heads, args.hidden // args.heads
    B, C, P = args.batch, args.context, args.page_size
    T = B  # decode: one new token per sequence
    wsz = np.dtype(args.dtype).itemsize
    f32 = 4

    def uniform(*shape: int, scale: float = 1.0) -> np.ndarray:
        # Uniform, not normal: the LM head and embedding of a large vocabulary are a gigabyte
        # each, and the values do not change the time.
        values = rng.random(shape, dtype=np.float32)
        values -= 0.5
        values *= 2 * scale
        return values

    def weights(*shape: int) -> Any:
        return be.store_linear(uniform(*shape, scale=0.02), args.dtype)

    def activation(*shape: int) -> Any:
        return be.to_storage(uniform(*shape), "float32")

    qkv_w, o_w = weights((nq + 2 * nkv) * hd, H), weights(H, nq * hd)
    gate_up_w, down_w, lm_head = weights(2 * I, H), weights(H, I), weights(V, H)
    table = be.to_storage(uniform(V, H), args.dtype)
    norm_w = be.to_storage(np.ones(H, np.float32), args.dtype)
    no_bias = be.to_storage(np.zeros(0, np.float32), "float32")
    pages_per_seq = -(-(C + 1) // P)
    kv_shape = (1, B * pages_per_seq, nkv, P, hd)
    k_cache, v_cache = (be.to_storage(uniform(*kv_shape), args.dtype) for _ in range(2))
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

    def matmul(name: str, x: Any, w: Any, out: Any, cols: int, inner: int, per_step: int) -> OpCase:
        return OpCase(name, f"[{T}x{inner}] @ [{cols}x{inner}]^T", lambda: be.matmul(x, w, no_bias, out), per_step,
                      cols * inner * wsz + T * (inner + cols) * f32, 2 * T * inner * cols)

    return [
        OpCase("embedding", f"{T} rows of [{V}x{H}]", lambda: be.embedding(step.token_ids, table, hidden), 1,
               T * H * (wsz + f32)),
        OpCase("add_rmsnorm", f"[{T}x{H}]", lambda: be.add_rmsnorm(hidden, residual, step.rows, norm_w, eps, normed),
               2 * L + 1, T * H * f32 * 4 + H * wsz, 5 * T * H),
        matmul("matmul qkv", normed, qkv_w, qkv, (nq + 2 * nkv) * hd, H, L),
        OpCase("rope_kv_append", f"{T} tokens, {nq}+{nkv} heads x {hd}",
               lambda: be.rope_kv_append(qkv, step, cos, sin, k_cache, v_cache, 0, nq), L,
               T * ((nq + 2 * nkv) * hd * f32 + nq * hd * f32 + 2 * nkv * hd * wsz), 3 * T * (nq + nkv) * hd),
        OpCase("attention", f"{B} seqs x {C + 1} ctx, {nq}/{nkv} heads x {hd}",
               lambda: be.attention(qkv, step, k_cache, v_cache, 0, nq, scale, attn), L,
               2 * B * (C + 1) * nkv * hd * wsz + T * nq * hd * f32 * 2, 4 * T * nq * (C + 1) * hd),
        matmul("matmul o", attn, o_w, delta, H, nq * hd, L),
        matmul("matmul gate_up", normed, gate_up_w, gate_up, 2 * I, H, L),
        OpCase("silu_mul", f"[{T}x{2 * I}] -> [{T}x{I}]", lambda: be.silu_mul(gate_up, act), L,
               T * 3 * I * f32, 4 * T * I),
        matmul("matmul down", act, down_w, delta, H, I, L),
        matmul("matmul lm_head", normed, lm_head, logits, V, H, 1),
        OpCase("argmax", f"[{T}x{V}]", lambda: be.argmax(logits, tokens_out), 1, T * V * f32 + T * 4),
    ]


def main() -> None:
    args = ARGS or parse_args()
    try:
        be = select_backend(args.backend, args.dtype)
    except ValueError as exc:
        raise SystemExit(f"kernels.py: {exc}") from None
    if args.backend == "cuda":
        from numba import cuda

        sync: Callable[[], None] = cuda.synchronize
    else:
        def sync() -> None:
            return None

    results = [OpResult(case, time_op(be, case, args.batch, sync, args.warmup, args.iters))
               for case in decode_cases(be, args)]
    print(f"backend {args.backend}, {args.dtype} storage, {args.threads} threads; {args.shape} shapes: hidden "
          f"{args.hidden}, heads {args.heads}/{args.kv_heads}, intermediate {args.intermediate}, vocab {args.vocab}; "
          f"decode batch {args.batch} over {args.context} cached tokens; median of {args.iters}")
    print(f"{'op':<16} {'shape':<36} {'µs':>9} {'x/step':>6} {'KB moved':>10} {'GB/s':>8} {'GFLOP/s':>8}")
    for r in results:
        c = r.case
        gflops = f"{r.gflop_per_s:8.1f}" if c.flops else f"{'':>8}"
        print(f"{c.op:<16} {c.shape:<36} {r.median_s * 1e6:9.1f} {c.per_step:>6} {c.bytes_moved / 1024:10.1f} "
              f"{r.gb_per_s:8.2f} {gflops}")
    step_s = sum(r.median_s * r.case.per_step for r in results)
    print(f"a decode step of {args.layers} layers, from these: {step_s * 1e3:.2f} ms, "
          f"{args.batch / step_s:.0f} tokens/s")
    out = ResultsFile(args.results, "kernels")
    setting = {"backend": args.backend, "dtype": args.dtype, "shape": args.shape, "batch": args.batch,
               "context": args.context, "threads": args.threads}
    for r in results:
        out.add("time", r.median_s * 1e6, "µs", op=r.case.op, **setting)
        out.add("bandwidth", r.gb_per_s, "GB/s", op=r.case.op, **setting)
        if r.case.flops:
            out.add("arithmetic", r.gflop_per_s, "GFLOP/s", op=r.case.op, **setting)
    out.add("time", step_s * 1e6, "µs", op=f"decode step of {args.layers} layers (sum)", **setting)


if __name__ == "__main__":
    main()
