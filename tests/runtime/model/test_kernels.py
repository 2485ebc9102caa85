"""Every CUDA kernel against its CPU twin, launched through ``CudaBackend`` exactly as the model
launches it.

Under the simulator (the default, see tests/conftest.py) shapes are tiny, because every CUDA
thread is a Python thread. With ``ENGINES_TEST_GPU=1`` on a machine with a GPU the same
tests run the real kernels at realistic sizes. Outputs are poisoned with NaN before each
launch so that an element the kernel forgot to write fails the comparison. float16 kernels
are compared with the twin run on the same values widened to float32: both accumulate in
float32, so the tolerance stays tight.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
import zlib

import numpy as np
import pytest
from numba import cuda

from engines.runtime.model.backend import (
    GPU_LAUNCH_SHAPES,
    SIMULATOR_LAUNCH_SHAPES,
    CpuBackend,
    CudaBackend,
    StepInputs,
    select_backend,
)
from engines.runtime.model.kernels import (add_rmsnorm, argmax, attention, embedding, kv_window, matmul, rope_kv,
                                           silu_mul)
from engines.runtime.model.kernels.rope_kv import rope_tables

pytestmark = pytest.mark.usefixtures("quick_simulator_barriers")

REAL_GPU = os.environ.get("ENGINES_TEST_GPU") == "1"
DTYPES = ("float32", "float16")
# Realistic sizes on a GPU (a Llama-3-8B-like layer), tiny ones under the simulator.
HIDDEN = 4096 if REAL_GPU else 24
VOCAB = 32000 if REAL_GPU else 37
HEAD_DIM = 128 if REAL_GPU else 8
Q_HEADS, KV_HEADS = (32, 8) if REAL_GPU else (4, 2)
PAGE_SIZE = 16 if REAL_GPU else 4


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Fresh random inputs per test, reproducible from the test's name."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def backend(dtype: str = "float32", **shape_overrides: object) -> CudaBackend:
    base = GPU_LAUNCH_SHAPES if REAL_GPU else SIMULATOR_LAUNCH_SHAPES
    shapes = type(base)(**{**base.__dict__, **shape_overrides})
    return CudaBackend(dtype, shapes)


def stored(array: np.ndarray, dtype: str) -> tuple[object, np.ndarray]:
    """``array`` in storage dtype on the device, and the same values as float32 for the twin."""
    host = array.astype(dtype)
    return cuda.to_device(host), host.astype(np.float32)


def poisoned(shape: tuple[int, ...], dtype: object = np.float32) -> object:
    fill = -1 if np.dtype(dtype).kind == "i" else np.nan
    return cuda.to_device(np.full(shape, fill, dtype=dtype))


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    assert np.isfinite(got).all(), "kernel left elements unwritten (NaN poison survived)"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_gather(rng: np.random.Generator, dtype: str) -> None:
    table_dev, table = stored(rng.standard_normal((VOCAB, HIDDEN)), dtype)
    ids = rng.integers(0, VOCAB, 7).astype(np.int32)
    out = poisoned((7, HIDDEN))
    backend(dtype).embedding(cuda.to_device(ids), table_dev, out)
    want = np.empty((7, HIDDEN), np.float32)
    embedding.embedding_gather_cpu(ids, table, want)
    np.testing.assert_array_equal(want, table[ids])
    assert_close(out.copy_to_host(), want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["plain", "residual", "gathered rows"])
def test_add_rmsnorm(rng: np.random.Generator, mode: str) -> None:
    tokens = 6
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
    residual = (rng.standard_normal((tokens, HIDDEN)) if mode != "plain" else np.zeros((0, HIDDEN))).astype(np.float32)
    rows = np.array([5, 0, 3], np.int32) if mode == "gathered rows" else np.arange(tokens, dtype=np.int32)
    eps = np.float32(1e-5)
    x_dev, out = cuda.to_device(x), poisoned((rows.shape[0], HIDDEN))
    backend().add_rmsnorm(x_dev, cuda.to_device(residual), cuda.to_device(rows), cuda.to_device(weight), eps, out)

    x_cpu, want = x.copy(), np.empty((rows.shape[0], HIDDEN), np.float32)
    add_rmsnorm.add_rmsnorm_cpu(x_cpu, residual, rows, weight, eps, want)
    summed = x + residual if mode != "plain" else x
    ref = summed[rows] / np.sqrt((summed[rows].astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * weight
    np.testing.assert_allclose(want, ref, rtol=1e-5, atol=1e-5)
    assert_close(out.copy_to_host(), want)
    # The residual add happens in place, on the normalised rows only.
    expect_x = x.copy()
    if mode != "plain":
        expect_x[rows] = summed[rows]
    np.testing.assert_allclose(x_dev.copy_to_host(), expect_x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(x_cpu, expect_x, rtol=1e-6, atol=1e-6)


MATMUL_CASES = {
    # (rows, inner, cols): inner and cols deliberately not multiples of the tile/block sizes.
    # gemv: inner a multiple of 8 loads in 16-byte chunks; 19 and 4100 go to the tiled kernel.
    "gemv": ([(1, 4096, 4096), (5, 4096, 1000), (16, 1024, 14336), (3, 2048, 32000), (9, 5632, 2048), (2, 4100, 7)]
             if REAL_GPU else [(1, 19, 10), (11, 40, 21), (1, 48, 5), (9, 24, 3)]),
    "tiled": [(64, 4096, 4096), (333, 4096, 1027)] if REAL_GPU else [(9, 40, 21)],
}


@pytest.mark.parametrize("kernel", ["gemv", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul(rng: np.random.Generator, kernel: str, dtype: str, with_bias: bool) -> None:
    be = backend(dtype, gemv_max_rows=10**9 if kernel == "gemv" else 0)
    for rows, inner, cols in MATMUL_CASES[kernel]:
        x = rng.standard_normal((rows, inner)).astype(np.float32)
        weight = (rng.standard_normal((cols, inner)) / math.sqrt(inner)).astype(dtype)  # HF [out, in]
        bias_dev, bias = stored(rng.standard_normal(cols if with_bias else 0), dtype)
        out = poisoned((rows, cols))
        be.matmul(cuda.to_device(x), be.store_linear(weight, dtype), bias_dev, out)
        want = np.empty((rows, cols), np.float32)
        matmul.matmul_cpu(x, weight.astype(np.float32), bias, want)
        assert_close(out.copy_to_host(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9, matmul.CPU_ROWS_KERNEL_MAX_ROWS, 45])
def test_cpu_matmul_paths(rng: np.random.Generator, rows: int) -> None:
    """Both CPU paths (the register-blocked kernel up to CPU_ROWS_KERNEL_MAX_ROWS rows, with its
    remainder rows in pairs and alone; BLAS beyond) against float64, with row and column counts
    that leave remainder blocks (150 columns: quarters of 37 rows and two columns left over)."""
    inner = 37
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    for cols, bias_on in [(23, False), (23, True), (150, False), (150, True)]:
        weight = rng.standard_normal((cols, inner)).astype(np.float32)
        bias = rng.standard_normal(cols).astype(np.float32) if bias_on else np.zeros(0, np.float32)
        out = np.full((rows, cols), np.nan, np.float32)
        matmul.matmul_cpu(x, weight, bias, out)
        want = x.astype(np.float64) @ weight.T.astype(np.float64) + (bias if bias.size else 0)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("four_row_blocks", [True, False])
def test_cpu_rows_kernel_in_blocks_of_four_rows_and_of_two(rng: np.random.Generator, four_row_blocks: bool) -> None:
    """``matmul_rows_cpu``'s two register blockings (the host's vector registers pick one, as the
    omitted argument's default: ``FOUR_ROW_BLOCKS``), whichever this host runs, against float64 at
    row counts that leave every tail (a pair, an odd row, both)."""
    inner, cols = 37, 150
    weight = rng.standard_normal((cols, inner)).astype(np.float32)
    bias = rng.standard_normal(cols).astype(np.float32)
    for rows in (1, 2, 3, 4, 5, 6, 7, 9, 16, 31, matmul.CPU_ROWS_KERNEL_MAX_ROWS):
        x = rng.standard_normal((rows, inner)).astype(np.float32)
        out = np.full((rows, cols), np.nan, np.float32)
        matmul.matmul_rows_cpu(x, weight, bias, out, four_row_blocks)
        want = x.astype(np.float64) @ weight.T.astype(np.float64) + bias
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"{rows} rows")


def test_four_row_blocks_where_numba_compiles_for_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocking follows the features numba compiles for: ``NUMBA_CPU_FEATURES`` when set."""
    from numba.core import config

    from engines.runtime.model.kernels import vector_width

    assert matmul.FOUR_ROW_BLOCKS == vector_width.has_512_bit_vectors()
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx,+avx2,+fma,+avx512f,+avx512bw")
    assert vector_width.has_512_bit_vectors()
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx,+avx2,+fma,-avx512f")
    assert not vector_width.has_512_bit_vectors()


@pytest.mark.parametrize("rows", [1, 3])
def test_cpu_matmul_with_swiglu_epilogue_equals_matmul_then_silu_mul(rng: np.random.Generator, rows: int) -> None:
    """The fused gate/up projection and SwiGLU of the compiled CPU step against its reference,
    the two kernels it replaces, and against float64: one row (where the step uses it) and more,
    intermediate sizes whose halves are odd and even, the benchmark's 1408. An odd intermediate
    size (no whole pairs in a block) is refused."""
    for inner, intermediate in [(37, 6), (37, 10), (64, 96), (512, 1408)]:
        x = rng.standard_normal((rows, inner)).astype(np.float32)
        weight = (rng.standard_normal((2 * intermediate, inner)) / math.sqrt(inner) * 3).astype(np.float32)
        fused = np.full((rows, intermediate), np.nan, np.float32)
        matmul.matmul_swiglu_cpu(x, weight, fused)
        gate_up, want = np.empty((rows, 2 * intermediate), np.float32), np.empty((rows, intermediate), np.float32)
        matmul.matmul_rows_cpu(x, weight, np.zeros(0, np.float32), gate_up)
        silu_mul.silu_mul_cpu(gate_up, want)
        np.testing.assert_allclose(fused, want, rtol=1e-4, atol=1e-5)  # sums in another order
        product = x.astype(np.float64) @ weight.T.astype(np.float64)
        gate, up = product[:, :intermediate], product[:, intermediate:]
        np.testing.assert_allclose(fused, gate / (1 + np.exp(-gate)) * up, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="4k rows"):
        matmul.matmul_swiglu_cpu(x, np.ones((2 * 7, inner), np.float32), np.empty((rows, 7), np.float32))


def ragged_step(rng: np.random.Generator, cached: list[int], new: list[int], num_pages: int) -> tuple[StepInputs, int]:
    """Host metadata for sequences with ``cached[i]`` tokens already stored and ``new[i]``
    new ones, on shuffled, non-contiguous pages."""
    order = rng.permutation(num_pages).astype(np.int32)
    pages_needed = [-(-(c + n) // PAGE_SIZE) for c, n in zip(cached, new, strict=True)]
    table = np.full((len(new), max(pages_needed) + 1), -1, np.int32)
    taken = 0
    for s, count in enumerate(pages_needed):
        table[s, :count] = order[taken:taken + count]
        taken += count
    token_seq = np.repeat(np.arange(len(new), dtype=np.int32), new)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, new, strict=True)]).astype(np.int32)
    rows = np.arange(len(token_seq), dtype=np.int32)
    step = StepInputs(token_ids=rows, positions=positions, token_seq=token_seq, page_table=table, rows=rows,
                      logit_rows=rows)
    return step, len(token_seq)


def device_step(step: StepInputs) -> StepInputs:
    return StepInputs(**{k: cuda.to_device(v) for k, v in step.__dict__.items()})


# (cached, new) per sequence; several key chunks
SEQS = ([40, 0, 257], [1, 64, 3]) if REAL_GPU else ([13, 0, 2], [1, 6, 3])
#: (head_splits, key_splits) of the CPU attention twin's work items, as cpu_attention_splits may
#: choose them and beyond: every kv-head divisor, key slices (more than a short context has
#: pages: empty ones), and both at once.
SPLITS = [(h, 1) for h in range(1, KV_HEADS + 1) if KV_HEADS % h == 0] + [(1, 2), (1, 3), (1, 7), (2, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_append(rng: np.random.Generator, dtype: str) -> None:
    step, tokens = ragged_step(rng, *SEQS, num_pages=24)
    qkv = rng.standard_normal((tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    cos, sin = rope_tables(HEAD_DIM, 10000.0, 512)
    cache_shape = (2, 24, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k_dev, v_dev = poisoned(cache_shape, dtype), poisoned(cache_shape, dtype)
    qkv_dev = cuda.to_device(qkv)
    backend(dtype).rope_kv_append(qkv_dev, device_step(step), cuda.to_device(cos), cuda.to_device(sin),
                                  k_dev, v_dev, 1, Q_HEADS)

    k, v = np.full(cache_shape, np.nan, np.float32), np.full(cache_shape, np.nan, np.float32)
    qkv_cpu = qkv.copy()
    rope_kv.rope_kv_append_cpu(qkv_cpu, step.positions, step.token_seq, step.page_table, cos, sin, k, v, 1, Q_HEADS)
    # The twin against transformers' formula, for one token and head.
    t, pos, half = 2, step.positions[2], HEAD_DIM // 2
    x = qkv[t, :HEAD_DIM]
    angle = pos * (1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    expect = x * np.cos(np.r_[angle, angle]) + np.r_[-x[half:], x[:half]] * np.sin(np.r_[angle, angle])
    np.testing.assert_allclose(qkv_cpu[t, :HEAD_DIM], expect, rtol=1e-4, atol=1e-4)

    assert_close(qkv_dev.copy_to_host(), qkv_cpu)
    written = ~np.isnan(k)
    assert written.sum() == tokens * KV_HEADS * HEAD_DIM  # exactly the new tokens' slots, layer 1 only
    got_k, got_v = k_dev.copy_to_host().astype(np.float32), v_dev.copy_to_host().astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got_k), ~written)
    tol = 1e-6 if dtype == "float32" else 1e-3
    np.testing.assert_allclose(got_k[written], k[written].astype(dtype).astype(np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(got_v[written], v[written].astype(dtype).astype(np.float32), rtol=0, atol=0)


def dense_attention(qkv: np.ndarray, step: StepInputs, k: np.ndarray, v: np.ndarray, layer: int) -> np.ndarray:
    """Plain float64 causal softmax attention, gathering each sequence's keys page by page."""
    out = np.zeros((qkv.shape[0], Q_HEADS * HEAD_DIM))
    group = Q_HEADS // KV_HEADS
    for t in range(qkv.shape[0]):
        n = step.positions[t] + 1
        pages = step.page_table[step.token_seq[t]]
        keys = np.stack([k[layer, pages[j // PAGE_SIZE], :, j % PAGE_SIZE] for j in range(n)])    # [n, kvh, d]
        values = np.stack([v[layer, pages[j // PAGE_SIZE], :, j % PAGE_SIZE] for j in range(n)])
        for h in range(Q_HEADS):
            q = qkv[t, h * HEAD_DIM:(h + 1) * HEAD_DIM].astype(np.float64)
            s = keys[:, h // group] @ q / math.sqrt(HEAD_DIM)
            p = np.exp(s - s.max())
            out[t, h * HEAD_DIM:(h + 1) * HEAD_DIM] = p @ values[:, h // group] / p.sum()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention(rng: np.random.Generator, dtype: str) -> None:
    step, tokens = ragged_step(rng, *SEQS, num_pages=48)
    cache_shape = (2, 48, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k_dev, k = stored(rng.standard_normal(cache_shape), dtype)
    v_dev, v = stored(rng.standard_normal(cache_shape), dtype)
    qkv = rng.standard_normal((tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    scale = np.float32(HEAD_DIM ** -0.5)
    out = poisoned((tokens, Q_HEADS * HEAD_DIM))
    backend(dtype).attention(cuda.to_device(qkv), device_step(step), k_dev, v_dev, 1, Q_HEADS, scale, out)

    want = np.empty((tokens, Q_HEADS * HEAD_DIM), np.float32)
    attention.paged_attention_cpu(qkv, step.positions, step.token_seq, step.page_table, k, v, 1, Q_HEADS, scale, want,
                                  1, 1)
    np.testing.assert_allclose(want, dense_attention(qkv, step, k, v, 1), rtol=1e-4, atol=1e-5)
    assert_close(out.copy_to_host(), want, rtol=1e-4, atol=1e-5)
    # The CPU twin's other shapes of work: single-threaded, each token's kv heads in slices, its
    # keys in slices (more than a short context has pages among them: empty ones), and both.
    for head_splits, key_splits in SPLITS:
        for kernel in (attention.paged_attention_serial_cpu, attention.paged_attention_cpu):
            other = np.full((tokens, Q_HEADS * HEAD_DIM), np.nan, np.float32)
            kernel(qkv, step.positions, step.token_seq, step.page_table, k, v, 1, Q_HEADS, scale, other, head_splits,
                   key_splits)
            np.testing.assert_allclose(other, want, rtol=1e-5, atol=1e-6)


def test_paged_attention_reads_four_pages_side_by_side(rng: np.random.Generator) -> None:
    """Every work item of the CPU twin, a token's keys whole or a slice of them, reads its whole
    pages four at a time (pages j, j + n/4, j + n/2, j + 3n/4), the rest one by one: contexts of
    exactly four whole pages, of more with a partial last one, of fewer, and a chunk whose tokens
    split differently, on shuffled pages; slices of eight and more pages take the four streams."""
    cached = [4 * PAGE_SIZE - 1, 9 * PAGE_SIZE + 2, 2, 37]
    new = [1, 3, 1, 1]
    step, tokens = ragged_step(rng, cached, new, num_pages=64)
    cache_shape = (2, 64, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k = rng.standard_normal(cache_shape).astype(np.float32)
    v = rng.standard_normal(cache_shape).astype(np.float32)
    qkv = rng.standard_normal((tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    scale = np.float32(HEAD_DIM ** -0.5)
    want = dense_attention(qkv, step, k, v, 1)
    assert (step.positions + 1 >= 4 * PAGE_SIZE).sum() >= 4  # most tokens take the four-page path
    for head_splits, key_splits in SPLITS:
        for kernel in (attention.paged_attention_serial_cpu, attention.paged_attention_cpu):
            got = np.full((tokens, Q_HEADS * HEAD_DIM), np.nan, np.float32)
            kernel(qkv, step.positions, step.token_seq, step.page_table, k, v, 1, Q_HEADS, scale, got, head_splits,
                   key_splits)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_whole_pages_past_the_groups_of_four_go_in_one_more_group(rng: np.random.Generator) -> None:
    """Two or three whole pages past a token's groups of four are read as its last four whole
    pages side by side, the ones already weighed given no weight; one is read alone: contexts of
    4q + r whole pages (r = 0..3, q = 1, 2), with and without a partial last page, every split."""
    cached = [PAGE_SIZE * (4 * q + r) - 1 + extra for q in (1, 2) for r in range(4) for extra in (0, 3)]
    step, tokens = ragged_step(rng, cached, [1] * len(cached), num_pages=200)
    cache_shape = (2, 200, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k = rng.standard_normal(cache_shape).astype(np.float32)
    v = rng.standard_normal(cache_shape).astype(np.float32)
    qkv = rng.standard_normal((tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    want = dense_attention(qkv, step, k, v, 1)
    for head_splits, key_splits in ((1, 1), *SPLITS):
        for kernel in (attention.paged_attention_serial_cpu, attention.paged_attention_cpu):
            got = np.full((tokens, Q_HEADS * HEAD_DIM), np.nan, np.float32)
            kernel(qkv, step.positions, step.token_seq, step.page_table, k, v, 1, Q_HEADS,
                   np.float32(HEAD_DIM ** -0.5), got, head_splits, key_splits)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cached", [4 * PAGE_SIZE - 1, 9 * PAGE_SIZE + 2, 2])
def test_paged_attention_of_one_token_reads_four_pages_side_by_side(rng: np.random.Generator, cached: int) -> None:
    """Batch 1 on one thread (one token, its heads unsplit) takes the four-page path too: contexts
    of exactly four whole pages, of more with a partial last one, and of fewer than four."""
    step, tokens = ragged_step(rng, [cached], [1], num_pages=16)
    cache_shape = (2, 16, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k = rng.standard_normal(cache_shape).astype(np.float32)
    v = rng.standard_normal(cache_shape).astype(np.float32)
    qkv = rng.standard_normal((tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    want = dense_attention(qkv, step, k, v, 1)
    for kernel in (attention.paged_attention_serial_cpu, attention.paged_attention_cpu):
        got = np.full((tokens, Q_HEADS * HEAD_DIM), np.nan, np.float32)
        kernel(qkv, step.positions, step.token_seq, step.page_table, k, v, 1, Q_HEADS,
               np.float32(HEAD_DIM ** -0.5), got, 1, 1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_attention_splits_run_small_steps_single_threaded() -> None:
    """``cpu_attention_splits``: (0, 0) (single-threaded) below the work threshold, else the
    head and key slices for the thread count: keys where each slice holds four whole pages."""
    positions = np.array([79], np.int32)  # 80 keys (5 pages of 16), 8 q heads of 64: 81,920 multiply-adds
    work = 80 * 8 * 64 * 2
    assert attention.cpu_attention_splits(positions, 8, 8, 16, 64, work + 1, 2) == (0, 0)
    assert attention.cpu_attention_splits(positions, 8, 8, 16, 64, work, 2) == (2, 1)  # short: heads
    assert attention.cpu_attention_splits(np.array([79, 5, 9], np.int32), 8, 8, 16, 64, 0, 2) == (1, 1)
    assert attention.cpu_attention_splits(positions, 8, 8, 16, 64, 0, 4) == (4, 1)
    assert attention.cpu_attention_splits(np.array([127], np.int32), 8, 8, 16, 64, 0, 2) == (1, 2)  # 8 pages
    assert attention.cpu_attention_splits(np.array([126], np.int32), 8, 8, 16, 64, 0, 2) == (2, 1)  # 7 whole
    assert attention.cpu_attention_splits(np.array([1000, 300], np.int32), 8, 8, 16, 64, 0, 4) == (1, 2)
    assert attention.cpu_attention_splits(np.array([1000, 100], np.int32), 8, 8, 16, 64, 0, 4) == (2, 1)


def test_head_splits_give_every_thread_an_item_in_equal_slices() -> None:
    assert attention.head_splits(8, 8, 2) == 1   # enough tokens: whole tokens
    assert attention.head_splits(1, 8, 2) == 2   # batch 1 on two threads: halves
    assert attention.head_splits(1, 8, 3) == 4   # three threads: the next divisor of 8
    assert attention.head_splits(1, 6, 4) == 6
    assert attention.head_splits(2, 8, 16) == 8  # never more slices than heads
    assert attention.head_splits(0, 8, 2) == 2


def test_slices_of_a_token_s_keys_merge_to_its_attention_whatever_the_scores(rng: np.random.Generator) -> None:
    """Key slices whose maxima differ by far more than exp's range (each slice's sum would
    underflow against the largest), and a NaN score in one slice only: the merged result is the
    whole context's softmax, and the NaN reaches the output as it does unsliced."""
    step, tokens = ragged_step(rng, [9 * PAGE_SIZE + 3], [1], num_pages=16)
    cache_shape = (2, 16, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k = rng.standard_normal(cache_shape).astype(np.float32)
    v = rng.standard_normal(cache_shape).astype(np.float32)
    k[1, step.page_table[0, 7]] *= 200.0  # a page of the second slice: scores ~200x the first slice's
    qkv = rng.standard_normal((tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    scale = np.float32(HEAD_DIM ** -0.5)
    want = dense_attention(qkv, step, k, v, 1)
    for kernel in (attention.paged_attention_serial_cpu, attention.paged_attention_cpu):
        got = np.full((tokens, Q_HEADS * HEAD_DIM), np.nan, np.float32)
        kernel(qkv, step.positions, step.token_seq, step.page_table, k, v, 1, Q_HEADS, scale, got, 1, 2)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    k[1, step.page_table[0, 1], 0, 3, 0] = np.nan  # kv head 0, in the first slice only
    for splits in (1, 2):
        got = np.zeros((tokens, Q_HEADS * HEAD_DIM), np.float32)
        attention.paged_attention_cpu(qkv, step.positions, step.token_seq, step.page_table, k, v, 1, Q_HEADS, scale,
                                      got, 1, splits)
        group_width = Q_HEADS // KV_HEADS * HEAD_DIM
        assert np.isnan(got[0, :group_width]).all() and not np.isnan(got[0, group_width:]).any()


def test_silu_mul(rng: np.random.Generator) -> None:
    width = 14336 if REAL_GPU else 13
    gate_up = (rng.standard_normal((5, 2 * width)) * 4).astype(np.float32)
    out = poisoned((5, width))
    backend().silu_mul(cuda.to_device(gate_up), out)
    want = np.empty((5, width), np.float32)
    silu_mul.silu_mul_cpu(gate_up, want)
    g, u = gate_up[:, :width].astype(np.float64), gate_up[:, width:]
    np.testing.assert_allclose(want, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
    assert_close(out.copy_to_host(), want)
    serial = np.empty((5, width), np.float32)
    silu_mul.silu_mul_serial_cpu(gate_up, serial)
    np.testing.assert_array_equal(serial, want)


def test_argmax(rng: np.random.Generator) -> None:
    logits = rng.standard_normal((4, VOCAB)).astype(np.float32)
    logits[1, [3, VOCAB - 2]] = 50.0        # a tie: the lower index wins
    logits[2, VOCAB - 1] = 60.0             # the maximum in the last column
    logits[3] = -np.inf                     # nothing finite: index 0
    out = poisoned((4,), np.int32)
    backend().argmax(cuda.to_device(logits), out)
    want = np.empty(4, np.int32)
    argmax.argmax_cpu(logits, want)
    np.testing.assert_array_equal(want, [np.argmax(logits[0]), 3, VOCAB - 1, 0])
    np.testing.assert_array_equal(out.copy_to_host(), want)


def test_select_backend() -> None:
    # "auto" means a real GPU: never the simulator.
    assert isinstance(select_backend("auto"), CudaBackend if REAL_GPU else CpuBackend)
    assert isinstance(select_backend("cpu"), CpuBackend)
    gpu = select_backend("cuda", "float16")  # allowed under the simulator: how tests reach the CUDA path
    assert isinstance(gpu, CudaBackend) and gpu.dtype == "float16" and gpu.simulated is not REAL_GPU
    with pytest.raises(ValueError, match="float16"):
        select_backend("cpu", "float16")
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend("tpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_window_gather_and_scatter(rng: np.random.Generator, dtype: str) -> None:
    """A window of positions across three shuffled pages (partly filled first and last pages),
    against the plain per-token indexing; a scatter keeps the slots outside the window, and
    takes a source sliced along tokens (the part of a block a cache lacks)."""
    layers, pages, slots = 2, 6, PAGE_SIZE
    store = rng.standard_normal((layers, pages, KV_HEADS, slots, HEAD_DIM)).astype(dtype)
    page_table = np.array([4, 1, 3], np.int64)
    begin, end = 2, 2 * slots + 1
    positions = np.arange(begin, end)
    token_pages = page_table[positions // slots].astype(np.int32)
    token_slots = (positions % slots).astype(np.int32)
    want = store[:, token_pages, :, token_slots, :].transpose(1, 2, 0, 3)  # advanced indices first

    # The CPU backend stores float32 only: its twin runs on the same values widened.
    out_cpu = np.full(want.shape, np.nan, np.float32)
    kv_window.kv_window_gather_cpu(store.astype(np.float32), token_pages, token_slots, out_cpu)
    np.testing.assert_array_equal(out_cpu, want.astype(np.float32))
    out_dev = cuda.to_device(np.full(want.shape, np.nan, dtype))
    grid, block = kv_window.launch_shape(layers, KV_HEADS, len(positions), HEAD_DIM)
    kv_window.kv_window_gather_cuda[grid, block](cuda.to_device(store), cuda.to_device(token_pages),
                                                 cuda.to_device(token_slots), out_dev)
    np.testing.assert_array_equal(out_dev.copy_to_host(), want)

    block_src = rng.standard_normal((layers, KV_HEADS, len(positions) + 3, HEAD_DIM)).astype(dtype)
    src = block_src[:, :, 3:]  # not contiguous: a slice along tokens
    expected = store.copy()
    expected[:, token_pages, :, token_slots, :] = src.transpose(2, 0, 1, 3)
    on_host = store.astype(np.float32)
    kv_window.kv_window_scatter_cpu(src.astype(np.float32), token_pages, token_slots, on_host)
    np.testing.assert_array_equal(on_host, expected.astype(np.float32))
    on_dev = cuda.to_device(store)
    kv_window.kv_window_scatter_cuda[grid, block](cuda.to_device(block_src)[:, :, 3:], cuda.to_device(token_pages),
                                                  cuda.to_device(token_slots), on_dev)
    np.testing.assert_array_equal(on_dev.copy_to_host(), expected)
    assert np.array_equal(expected[:, 4, :, :begin], store[:, 4, :, :begin])  # slots before the window kept


def test_threaded_and_single_threaded_twins_keep_caches_of_their_own(tmp_path) -> None:
    """numba keys its disk cache by the Python function and the signature, not by ``parallel``:
    twins of one body must be distinct functions, or the second compiled loads the first's
    code (the single-threaded attention used to run threaded). A fresh process compiles the
    single-threaded twins into an empty cache; the next must find no entry for the threaded ones."""
    import subprocess
    import sys

    call = (
        "import numpy as np\n"
        "from engines.runtime.model.kernels import attention, silu_mul\n"
        "qkv = np.ones((2, 24), np.float32); out = np.empty((2, 8), np.float32)\n"
        "cache = np.ones((1, 2, 2, 4, 4), np.float32); pos = np.array([0, 1], np.int32)\n"
        "seq = np.zeros(2, np.int32); table = np.zeros((1, 2), np.int32)\n"
        "for name in NAMES:\n"
        "    kernel = getattr(attention, 'paged_attention_' + name)\n"
        "    kernel(qkv, pos, seq, table, cache, cache, 0, 2, np.float32(0.5), out, 1, 1)\n"
        "    twin = getattr(silu_mul, 'silu_mul_' + name)\n"
        "    twin(np.ones((2, 8), np.float32), np.empty((2, 4), np.float32))\n"
        "    print(name, sum(kernel.stats.cache_hits.values()), sum(twin.stats.cache_hits.values()))\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_ENABLE_CUDASIM", None)

    def run(names: list[str]) -> str:
        proc = subprocess.run([sys.executable, "-c", f"NAMES = {names!r}\n" + call], env=env, capture_output=True,
                              text=True, timeout=300, cwd=Path(__file__).resolve().parents[3])
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert run(["serial_cpu"]) == "serial_cpu 0 0\n"
    assert run(["cpu", "serial_cpu"]) == "cpu 0 0\nserial_cpu 1 1\n"  # its own entry: a miss; the serial's: a hit
