"""Matrix multiply ``out = x @ W.T + bias`` for a linear layer ``W[out_features, in_features]``.

Both backends keep transformers' own layout, ``w[out, in]``: a dot product over ``in`` reads
both operands contiguously, which is what LLVM vectorises on the CPU and what lets a warp on
the GPU read a weight row in 16-byte chunks (:mod:`.wide_load`).

Two CUDA kernels:

* :func:`gemv_cuda` for few rows (decode): a warp per output column streams its weight row
  once per ``GEMV_ROWS`` rows of x, eight weights a load; the lanes' sums meet by shuffles.
* :func:`matmul_tiled_cuda` for many rows (prefill), and for rows :func:`gemv_cuda` cannot
  load in whole chunks: shared-memory tiles, each thread computing a 4x4 block of outputs, so
  each weight tile is read once per 4*blockDim.y rows.

Both accumulate in float32 whatever the weight dtype. ``bias`` is a zero-length array when
the layer has none.

Their CPU twin, :func:`matmul_cpu`, computes the same product from ``w[out, in]``: with up to
32 rows (a decode step) :func:`matmul_rows_cpu`, register-blocked, which streams each weight row
once, in four long sequential streams (faster than OpenBLAS's sgemm up to
``CPU_ROWS_KERNEL_MAX_ROWS`` rows: docs/perf-log/code-comments.md#matmul-rows-against-sgemm); with many
rows (prefill), BLAS sgemm. The compiled CPU step
of one token runs the MLP's gate/up projection as :func:`matmul_swiglu_cpu`, the SwiGLU in its
epilogue (CPU only: its reference is this product then ``silu_mul``).
"""
from typing import Any

import numpy as np
from numba import cuda, float32, njit, prange

from engines.runtime.model.kernels.fast_exp import exp_f32
from engines.runtime.model.kernels.launch_cost import LaunchCost, nbytes
from engines.runtime.model.kernels.wide_load import CHUNK, load8, SIMULATED
from engines.runtime.model.kernels.vector_width import has_512_bit_vectors, prefer_wide_vectors

# Inner dimension of a shared-memory tile; a block tile is (4*blockDim.y) x (4*blockDim.x).
TILE_K = 16
TILE_MAX = 64  # largest block tile side: blockDim up to (16, 16)
W_TILE_COLS = TILE_MAX + 1  # a padding column (matmul_tiled_cuda)
# Rows of x one GEMV block multiplies, kept in eight scalar accumulators per lane: a
# decode batch of up to 8 streams the weights once; a larger one re-reads them once per 8
# rows (from L2, where they fit).
GEMV_ROWS = 8
GEMV_MAX_WARPS = 8    # largest blockDim.y (output columns per block, a warp each)
GEMV_MAX_LANES = 32   # blockDim.x: a warp on a GPU


@cuda.jit(cache=True)
def matmul_tiled_cuda(x, w, bias, out):
    """Tiled ``out = x @ w.T + bias`` from ``w[out, in]``. Block ``(bx, by)`` with bx, by <= 16;
    grid ``(ceil(N / (4*bx)), ceil(M / (4*by)))``. Thread (tx, ty) owns rows ``ty + i*by`` and
    columns ``tx + j*bx`` of the block tile (i, j < 4): strided, so that a warp reads
    consecutive shared-memory columns without bank conflicts.
    """
    x_tile = cuda.shared.array((TILE_MAX, TILE_K), float32)
    # One padding column: the loads below write a column of TILE_K elements per weight row,
    # which without it would all fall in one shared-memory bank.
    w_tile = cuda.shared.array((TILE_K, W_TILE_COLS), float32)
    acc = cuda.local.array(16, float32)
    bx = cuda.blockDim.x
    by = cuda.blockDim.y
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    tid = ty * bx + tx
    nthreads = bx * by
    tile_m = 4 * by
    tile_n = 4 * bx
    m0 = cuda.blockIdx.y * tile_m
    n0 = cuda.blockIdx.x * tile_n
    rows = x.shape[0]
    inner = x.shape[1]
    cols = w.shape[0]
    for e in range(16):
        acc[e] = float32(0.0)
    for k0 in range(0, inner, TILE_K):
        # Consecutive threads load consecutive k of one x row, and of one w row: coalesced
        # global reads. Out-of-range elements load as zero.
        for e in range(tid, tile_m * TILE_K, nthreads):
            r = e // TILE_K
            c = e % TILE_K
            v = float32(0.0)
            if m0 + r < rows and k0 + c < inner:
                v = x[m0 + r, k0 + c]
            x_tile[r, c] = v
        for e in range(tid, TILE_K * tile_n, nthreads):
            c = e // TILE_K
            r = e % TILE_K
            v = float32(0.0)
            if k0 + r < inner and n0 + c < cols:
                v = float32(w[n0 + c, k0 + r])
            w_tile[r, c] = v
        cuda.syncthreads()
        for kk in range(TILE_K):
            for i in range(4):
                a = x_tile[ty + i * by, kk]
                for j in range(4):
                    acc[i * 4 + j] += a * w_tile[kk, tx + j * bx]
        cuda.syncthreads()
    has_bias = bias.shape[0] > 0
    for i in range(4):
        m = m0 + ty + i * by
        for j in range(4):
            n = n0 + tx + j * bx
            if m < rows and n < cols:
                v = acc[i * 4 + j]
                if has_bias:
                    v += float32(bias[n])
                out[m, n] = v


@cuda.jit(device=True, inline=True)
def _dot8(w, x, m, k):
    """The dot of eight weights (a :func:`wide_load.load8` tuple) with ``x[m, k:k + 8]``."""
    v = load8(x, m, k)
    return (w[0] * v[0] + w[1] * v[1] + w[2] * v[2] + w[3] * v[3]
            + w[4] * v[4] + w[5] * v[5] + w[6] * v[6] + w[7] * v[7])


@cuda.jit(device=True, inline=True)
def _dot16(wa, wb, has_b, x, m, ka, kb):
    """``_dot8`` of chunk ``a``, plus chunk ``b``'s when it exists (``has_b``)."""
    total = _dot8(wa, x, m, ka)
    if has_b:
        total += _dot8(wb, x, m, kb)
    return total


@cuda.jit(device=True, inline=True)
def _accumulate(acc, r, nrows, wa, wb, has_b, x, m0, ka, kb):
    """Row ``r``'s accumulator after the two chunks, if the block has that row."""
    if r < nrows:
        acc += _dot16(wa, wb, has_b, x, m0 + r, ka, kb)
    return acc


@cuda.jit(device=True, inline=True)
def _store_row(v, r, nrows, partial, warp, lane, lanes, out, m0, n, cols, add):
    """Row ``r``'s sum over the lanes, plus ``add`` (the bias), into ``out`` (by lane 0)."""
    if r < nrows:
        total = _lanes_sum(v, partial, warp, r, lane, lanes)
        if lane == 0 and n < cols:
            out[m0 + r, n] = total + add


@cuda.jit(device=True, inline=True)
def _lanes_sum(v, partial, warp, r, lane, lanes):
    """The sum of ``v`` over the warp's lanes, valid in lane 0. On a GPU by shuffles; the
    simulator has none, so there through ``partial[warp, r, :]`` in shared memory."""
    if SIMULATED:
        partial[warp, r, lane] = v
        cuda.syncthreads()
        total = float32(0.0)
        if lane == 0:
            for i in range(lanes):
                total += partial[warp, r, i]
        cuda.syncthreads()
        return total
    for offset in (16, 8, 4, 2, 1):
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
    return v


@cuda.jit(cache=True)
def gemv_cuda(x, w, bias, out):
    """Few-row ``out = x @ w.T + bias`` from ``w[out, in]``, rows of 16-byte multiples
    (``wide_load.loadable``). Block ``(32, warps)`` (on the simulator ``(lanes, warps)``, warps
    <= ``GEMV_MAX_WARPS``), grid ``(ceil(M / GEMV_ROWS), ceil(N / warps))``.

    A warp owns one output column ``n`` (one weight row) for up to ``GEMV_ROWS`` rows of ``x``:
    its lanes read the row in 16-byte chunks (eight float16 or float32 weights a load,
    :func:`wide_load.load8`), two chunks a lane before either is used, so that a warp keeps
    1 KB (float16) in flight; each lane keeps one accumulator a row, summed across the warp
    at the end. The row groups are the grid's fastest dimension, so the groups that read one
    weight row run side by side and the re-reads of a larger batch come from L2.
    """
    partial = cuda.shared.array((GEMV_MAX_WARPS, GEMV_ROWS, GEMV_MAX_LANES), float32)  # the simulator's sums
    lane = cuda.threadIdx.x
    warp = cuda.threadIdx.y
    lanes = cuda.blockDim.x
    n = cuda.blockIdx.y * cuda.blockDim.y + warp
    m0 = cuda.blockIdx.x * GEMV_ROWS
    inner = x.shape[1]
    cols = w.shape[0]
    nrows = min(GEMV_ROWS, x.shape[0] - m0)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = float32(0.0)
    if n < cols:
        stride = lanes * CHUNK
        for ka in range(lane * CHUNK, inner, 2 * stride):
            kb = ka + stride
            has_b = kb < inner
            wa = load8(w, n, ka)
            wb = load8(w, n, kb if has_b else ka)
            a0 = _accumulate(a0, 0, nrows, wa, wb, has_b, x, m0, ka, kb)
            a1 = _accumulate(a1, 1, nrows, wa, wb, has_b, x, m0, ka, kb)
            a2 = _accumulate(a2, 2, nrows, wa, wb, has_b, x, m0, ka, kb)
            a3 = _accumulate(a3, 3, nrows, wa, wb, has_b, x, m0, ka, kb)
            a4 = _accumulate(a4, 4, nrows, wa, wb, has_b, x, m0, ka, kb)
            a5 = _accumulate(a5, 5, nrows, wa, wb, has_b, x, m0, ka, kb)
            a6 = _accumulate(a6, 6, nrows, wa, wb, has_b, x, m0, ka, kb)
            a7 = _accumulate(a7, 7, nrows, wa, wb, has_b, x, m0, ka, kb)
    add = float32(0.0)
    if n < cols and bias.shape[0] > 0:
        add = float32(bias[n])
    # Every lane takes part in each sum (the shuffles need the whole warp); lane 0 writes.
    _store_row(a0, 0, nrows, partial, warp, lane, lanes, out, m0, n, cols, add)
    _store_row(a1, 1, nrows, partial, warp, lane, lanes, out, m0, n, cols, add)
    _store_row(a2, 2, nrows, partial, warp, lane, lanes, out, m0, n, cols, add)
    _store_row(a3, 3, nrows, partial, warp, lane, lanes, out, m0, n, cols, add)
    _store_row(a4, 4, nrows, partial, warp, lane, lanes, out, m0, n, cols, add)
    _store_row(a5, 5, nrows, partial, warp, lane, lanes, out, m0, n, cols, add)
    _store_row(a6, 6, nrows, partial, warp, lane, lanes, out, m0, n, cols, add)
    _store_row(a7, 7, nrows, partial, warp, lane, lanes, out, m0, n, cols, add)


# Row counts up to which matmul_rows_cpu beats OpenBLAS on a 2-core Xeon, for in/out features
# 512..4096 (docs/perf-log/code-comments.md#matmul-rows-against-sgemm); past it, sgemm's blocking wins.
CPU_ROWS_KERNEL_MAX_ROWS = 32
# Reassociation lets LLVM vectorise the dot products over ``in``.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
#: Whether matmul_rows_cpu multiplies four input rows at a time (sixteen accumulators) or two
#: (eight): four where the CPU has AVX-512's 32 vector registers; with AVX2's 16, sixteen
#: accumulators and their operands do not fit, and LLVM keeps six of them on the stack.
FOUR_ROW_BLOCKS = has_512_bit_vectors()


@njit(nogil=True, cache=True, fastmath=_FASTMATH)
def _last_columns(x, w, out, first):
    """The blocked kernels' epilogue: output columns ``first ..`` one at a time (no bias)."""
    rows, inner = x.shape
    for n in range(first, w.shape[0]):
        wn = w[n]
        for m in range(rows):
            xm = x[m]
            s = float32(0.0)
            for k in range(inner):
                s += xm[k] * wn[k]
            out[m, n] = s


@njit(nogil=True, cache=True, fastmath=False)
def add_bias(out, bias, first, end):
    """``out[:, first:end] += bias[first:end]`` (nothing for a zero-length bias)."""
    if bias.shape[0] > 0:
        for m in range(out.shape[0]):
            for n in range(first, end):
                out[m, n] += bias[n]


@njit(inline="always", fastmath=_FASTMATH)
def _row_dot_four(xm, w0, w1, w2, w3):
    """One input row against four weight rows: four dot products in one pass over ``xm``."""
    s0 = s1 = s2 = s3 = float32(0.0)
    for k in range(xm.shape[0]):
        a = xm[k]
        s0 += a * w0[k]
        s1 += a * w1[k]
        s2 += a * w2[k]
        s3 += a * w3[k]
    return s0, s1, s2, s3


@njit(inline="always", fastmath=_FASTMATH)
def row_blocks(x, w, bias, out, first, end):
    """:func:`matmul_rows_cpu` for one row ``x`` (1-D), its blocks ``first .. end - 1`` only: output
    columns ``b, b + q, b + 2q, b + 3q`` of each block ``b`` (``q = out // 4``), bias added. The
    share of one member of a thread team (cpu_step); the columns past ``4q`` are
    :func:`row_last_columns`'."""
    q = w.shape[0] // 4
    has_bias = bias.shape[0] > 0
    for block in range(first, end):
        s0, s1, s2, s3 = _row_dot_four(x, w[block], w[block + q], w[block + 2 * q], w[block + 3 * q])
        if has_bias:
            s0 += bias[block]
            s1 += bias[block + q]
            s2 += bias[block + 2 * q]
            s3 += bias[block + 3 * q]
        out[block] = s0
        out[block + q] = s1
        out[block + 2 * q] = s2
        out[block + 3 * q] = s3


@njit(nogil=True, cache=True, fastmath=_FASTMATH)
def row_last_columns(x, w, bias, out):
    """The columns :func:`row_blocks` leaves (past ``4 * (out // 4)``) of one row (2-D views, one row)."""
    first = 4 * (w.shape[0] // 4)
    _last_columns(x, w, out, first)
    add_bias(out, bias, first, w.shape[0])


@njit(inline="always", fastmath=_FASTMATH, error_model="numpy")
def swiglu_block(x, w, out, block, q):
    """Block ``block`` of :func:`matmul_swiglu_cpu` for one row ``x`` (1-D): gates ``block`` and
    ``block + q`` and their ups, ``out[block]`` and ``out[block + q]``."""
    s0, s1, s2, s3 = _row_dot_four(x, w[block], w[block + q], w[block + 2 * q], w[block + 3 * q])
    out[block] = s0 / (float32(1.0) + exp_f32(-s0)) * s2
    out[block + q] = s1 / (float32(1.0) + exp_f32(-s1)) * s3


@njit(inline="always", fastmath=_FASTMATH)
def four_weight_rows(x, w0, w1, w2, w3, out, n0, n1, n2, n3, four_row_blocks):
    """Every row of ``x`` against four weight rows ``w0 .. w3`` (1-D), into output columns
    ``n0 .. n3``: :func:`matmul_rows_cpu`'s work for one block (no bias), which the quantized
    kernels (``quantized_matmul``) run on weight rows they dequantized. Rows in fours (sixteen
    accumulators) where ``four_row_blocks``, then in pairs (eight), then the odd one."""
    rows, inner = x.shape
    rows4 = rows - rows % 4 if four_row_blocks else 0
    for m in range(0, rows4, 4):
        x0 = x[m]
        x1 = x[m + 1]
        x2 = x[m + 2]
        x3 = x[m + 3]
        s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = float32(0.0)
        s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = float32(0.0)
        for k in range(inner):
            a0 = x0[k]
            a1 = x1[k]
            a2 = x2[k]
            a3 = x3[k]
            b0 = w0[k]
            b1 = w1[k]
            b2 = w2[k]
            b3 = w3[k]
            s00 += a0 * b0
            s01 += a0 * b1
            s02 += a0 * b2
            s03 += a0 * b3
            s10 += a1 * b0
            s11 += a1 * b1
            s12 += a1 * b2
            s13 += a1 * b3
            s20 += a2 * b0
            s21 += a2 * b1
            s22 += a2 * b2
            s23 += a2 * b3
            s30 += a3 * b0
            s31 += a3 * b1
            s32 += a3 * b2
            s33 += a3 * b3
        out[m, n0] = s00
        out[m, n1] = s01
        out[m, n2] = s02
        out[m, n3] = s03
        out[m + 1, n0] = s10
        out[m + 1, n1] = s11
        out[m + 1, n2] = s12
        out[m + 1, n3] = s13
        out[m + 2, n0] = s20
        out[m + 2, n1] = s21
        out[m + 2, n2] = s22
        out[m + 2, n3] = s23
        out[m + 3, n0] = s30
        out[m + 3, n1] = s31
        out[m + 3, n2] = s32
        out[m + 3, n3] = s33
    # The rows left in pairs (eight accumulators), then the odd one.
    for m in range(rows4, rows - 1, 2):
        x0 = x[m]
        x1 = x[m + 1]
        s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = float32(0.0)
        for k in range(inner):
            a0 = x0[k]
            a1 = x1[k]
            b0 = w0[k]
            b1 = w1[k]
            b2 = w2[k]
            b3 = w3[k]
            s00 += a0 * b0
            s01 += a0 * b1
            s02 += a0 * b2
            s03 += a0 * b3
            s10 += a1 * b0
            s11 += a1 * b1
            s12 += a1 * b2
            s13 += a1 * b3
        out[m, n0] = s00
        out[m, n1] = s01
        out[m, n2] = s02
        out[m, n3] = s03
        out[m + 1, n0] = s10
        out[m + 1, n1] = s11
        out[m + 1, n2] = s12
        out[m + 1, n3] = s13
    if (rows - rows4) % 2:
        m = rows - 1
        s0, s1, s2, s3 = _row_dot_four(x[m], w0, w1, w2, w3)
        out[m, n0] = s0
        out[m, n1] = s1
        out[m, n2] = s2
        out[m, n3] = s3


@njit(nogil=True, cache=True, parallel=True, fastmath=_FASTMATH)
def matmul_rows_cpu(x, w, bias, out, four_row_blocks=FOUR_ROW_BLOCKS):
    """``out = x @ w.T + bias`` for few rows of ``x``, ``w`` in ``[out, in]`` layout.

    Register blocking: each step of the ``in`` loop loads four weight rows and four input
    rows and feeds sixteen accumulators (``four_row_blocks``; else two input rows and eight
    accumulators, see ``FOUR_ROW_BLOCKS`` and docs/perf-log/cpu-anchors.md#2026-11-26-zen3-two-row-blocks),
    so a weight row is read from memory once and the
    input rows (small) stay in the caches. Omitted, ``four_row_blocks`` is a constant of the
    compiled code. The four weight rows of a block are
    ``n``, ``n + q``, ``n + 2q`` and ``n + 3q`` (``q = out // 4``), not four neighbours: block
    after block, each of the four then reads on where it left off, four long sequential
    streams that the hardware prefetcher runs ahead of, where neighbours made every block four
    fresh 2 KB streams it never got ahead of (docs/perf-log/cpu-anchors.md#2026-11-25-long-weight-streams).
    Blocks are spread over numba's threads, and vectorised with 512-bit
    vectors where the CPU has them (``vector_width``: at 8 to 32 rows the loop is bound by
    arithmetic).
    """
    cols = w.shape[0]
    q = cols // 4
    for block in prange(q):
        prefer_wide_vectors()
        four_weight_rows(x, w[block], w[block + q], w[block + 2 * q], w[block + 3 * q], out,
                         block, block + q, block + 2 * q, block + 3 * q, four_row_blocks)
    _last_columns(x, w, out, 4 * q)
    add_bias(out, bias, 0, cols)


@njit(nogil=True, cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def matmul_swiglu_cpu(x, w, out):
    """``out = silu(gate) * up`` where ``[gate | up] = x @ w.T``: the MLP's gate/up projection with
    its SwiGLU in the epilogue, for a CPU decode step of one token. Its reference is
    :func:`matmul_rows_cpu` then ``silu_mul.silu_mul_cpu`` (the twins of ``gemv_cuda`` and
    ``silu_mul_cuda``); tests diff the two.

    Weight rows are read in :func:`matmul_rows_cpu`'s four streams, ``n, n + q, n + 2q, n + 3q``
    with ``q = 2 * intermediate / 4``: gates ``n`` and ``n + q`` and their two ups, so a block
    holds whole (gate, up) pairs, the ``[gate | up]`` product is never stored and read back, and
    no second parallel loop runs (docs/perf-log/cpu-anchors.md#2026-11-26-fused-swiglu). One input
    row at a time against four weight rows, as
    :func:`matmul_rows_cpu` does its last odd row: right for one token, load-bound for many
    (its 4x4 blocks pay there). ``w`` needs a multiple of four rows (an even intermediate size).
    """
    rows = x.shape[0]
    cols = w.shape[0]
    if cols % 4 or out.shape[1] * 2 != cols or out.shape[0] != rows:
        raise ValueError("matmul_swiglu_cpu: w needs 4k rows [gate | up] and out [rows, 2k]")
    q = cols // 4
    for block in prange(q):
        for m in range(rows):
            swiglu_block(x[m], w, out[m], block, q)


def matmul_cpu(x: np.ndarray, w: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """CPU twin of both CUDA kernels, from ``w[out, in]``: :func:`matmul_rows_cpu` up to
    ``CPU_ROWS_KERNEL_MAX_ROWS`` rows, BLAS sgemm (which releases the GIL) beyond."""
    if x.shape[0] <= CPU_ROWS_KERNEL_MAX_ROWS:
        matmul_rows_cpu(x, w, bias, out)
        return
    np.matmul(x, w.T, out=out)
    if bias.shape[0]:
        out += bias


_SIGNATURE = "void(float32[:, ::1], {dt}[:, ::1], {dt}[::1], float32[:, ::1])"
CUDA_SIGNATURES = {
    matmul_tiled_cuda: _SIGNATURE,
    gemv_cuda: _SIGNATURE,
}


def launch_cost(args: tuple[Any, ...], kv_positions: int, attended: int) -> LaunchCost:
    """The backend's ``matmul(x, weight, bias, out)``, named by its shape (each a row of a profile)."""
    x, weight, _bias, out = args
    rows, k, n = x.shape[0], x.shape[1], out.shape[1]
    return f"matmul {k}x{n}", nbytes(weight) + nbytes(x) + nbytes(out), 2 * rows * k * n
