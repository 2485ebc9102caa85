"""Matrix multiply ``out = x @ W.T + bias`` for a linear layer ``W[out_features, in_features]``.

Each backend stores W in the layout its kernels stream best. The GPU keeps it transposed,
``w_t[in, out]``: consecutive threads read consecutive output columns of one input row, so
every weight load is coalesced. The CPU keeps transformers' own ``w[out, in]``: a dot
product over ``in`` reads both operands contiguously, which is what LLVM vectorises.

Two CUDA kernels share the GPU layout:

* :func:`matmul_tiled_cuda` for many rows (prefill): shared-memory tiles, each thread
  computing a 4x4 block of outputs, so each weight tile is read once per 4*blockDim.y rows.
* :func:`gemv_cuda` for few rows (decode): no tiles to fill, the whole block streams the
  weight once per ``GEMV_ROWS`` rows, splitting the input dimension across ``blockDim.y``.

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
import numpy as np
from numba import cuda, float32, njit, prange

from engines.runtime.model.kernels.fast_exp import exp_f32
from engines.runtime.model.kernels.vector_width import has_512_bit_vectors, prefer_wide_vectors

# Inner dimension of a shared-memory tile; a block tile is (4*blockDim.y) x (4*blockDim.x).
TILE_K = 16
TILE_MAX = 64  # largest block tile side: blockDim up to (16, 16)
# Rows of x one GEMV block multiplies, kept in eight scalar accumulators per thread: a
# decode batch of up to 8 streams the weights once; a larger one re-reads them once per 8
# rows (from L2, where they fit).
GEMV_ROWS = 8
GEMV_MAX_COLS = 32    # largest blockDim.x (output columns per block)
GEMV_MAX_SLICES = 32  # largest blockDim.y (slices of the input dimension per column)


@cuda.jit(cache=True)
def matmul_tiled_cuda(x, w_t, bias, out):
    """Tiled ``out = x @ w_t + bias``. Block ``(bx, by)`` with bx, by <= 16; grid
    ``(ceil(N / (4*bx)), ceil(M / (4*by)))``. Thread (tx, ty) owns rows ``ty + i*by`` and
    columns ``tx + j*bx`` of the block tile (i, j < 4): strided, so that a warp reads
    consecutive shared-memory columns without bank conflicts.
    """
    x_tile = cuda.shared.array((TILE_MAX, TILE_K), float32)
    w_tile = cuda.shared.array((TILE_K, TILE_MAX), float32)
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
    cols = w_t.shape[1]
    for e in range(16):
        acc[e] = float32(0.0)
    for k0 in range(0, inner, TILE_K):
        # Consecutive threads load consecutive k of one x row, then consecutive n of one
        # w_t row: coalesced global reads. Out-of-range elements load as zero.
        for e in range(tid, tile_m * TILE_K, nthreads):
            r = e // TILE_K
            c = e % TILE_K
            v = float32(0.0)
            if m0 + r < rows and k0 + c < inner:
                v = x[m0 + r, k0 + c]
            x_tile[r, c] = v
        for e in range(tid, TILE_K * tile_n, nthreads):
            r = e // tile_n
            c = e % tile_n
            v = float32(0.0)
            if k0 + r < inner and n0 + c < cols:
                v = float32(w_t[k0 + r, n0 + c])
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


@cuda.jit(cache=True)
def gemv_cuda(x, w_t, bias, out):
    """Few-row ``out = x @ w_t + bias``. Block ``(cols, slices)`` (cols <= 32, slices <= 32),
    grid ``(ceil(N / cols), ceil(M / GEMV_ROWS))``.

    Thread (tx, ty) sums input indices ``k = ty, ty + slices, ...`` for column ``n`` and up
    to ``GEMV_ROWS`` rows; a warp (fixed ty) reads one contiguous run of a w_t row, and all
    its threads read the same x element (a broadcast). A skinny product is bound by memory
    latency, not bandwidth, so each iteration issues four independent weight loads before
    using them. The slices are summed through shared memory at the end.
    """
    partial = cuda.shared.array((GEMV_MAX_SLICES, GEMV_ROWS, GEMV_MAX_COLS), float32)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    slices = cuda.blockDim.y
    n = cuda.blockIdx.x * cuda.blockDim.x + tx
    m0 = cuda.blockIdx.y * GEMV_ROWS
    rows = x.shape[0]
    inner = x.shape[1]
    cols = w_t.shape[1]
    # Rows past the end re-read the last row and are dropped at the end, and input indices
    # past the end re-read the last one with a zero weight: cheaper than branches in the
    # inner loop.
    last_row = rows - 1
    r0 = m0
    r1 = min(m0 + 1, last_row)
    r2 = min(m0 + 2, last_row)
    r3 = min(m0 + 3, last_row)
    r4 = min(m0 + 4, last_row)
    r5 = min(m0 + 5, last_row)
    r6 = min(m0 + 6, last_row)
    r7 = min(m0 + 7, last_row)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = float32(0.0)
    if n < cols:
        last_k = inner - 1
        for k0 in range(ty, inner, 4 * slices):
            k1 = min(k0 + slices, last_k)
            k2 = min(k0 + 2 * slices, last_k)
            k3 = min(k0 + 3 * slices, last_k)
            w0 = float32(w_t[k0, n])
            w1 = float32(w_t[k1, n]) * float32(k0 + slices <= last_k)
            w2 = float32(w_t[k2, n]) * float32(k0 + 2 * slices <= last_k)
            w3 = float32(w_t[k3, n]) * float32(k0 + 3 * slices <= last_k)
            a0 += x[r0, k0] * w0 + x[r0, k1] * w1 + x[r0, k2] * w2 + x[r0, k3] * w3
            a1 += x[r1, k0] * w0 + x[r1, k1] * w1 + x[r1, k2] * w2 + x[r1, k3] * w3
            a2 += x[r2, k0] * w0 + x[r2, k1] * w1 + x[r2, k2] * w2 + x[r2, k3] * w3
            a3 += x[r3, k0] * w0 + x[r3, k1] * w1 + x[r3, k2] * w2 + x[r3, k3] * w3
            a4 += x[r4, k0] * w0 + x[r4, k1] * w1 + x[r4, k2] * w2 + x[r4, k3] * w3
            a5 += x[r5, k0] * w0 + x[r5, k1] * w1 + x[r5, k2] * w2 + x[r5, k3] * w3
            a6 += x[r6, k0] * w0 + x[r6, k1] * w1 + x[r6, k2] * w2 + x[r6, k3] * w3
            a7 += x[r7, k0] * w0 + x[r7, k1] * w1 + x[r7, k2] * w2 + x[r7, k3] * w3
    partial[ty, 0, tx] = a0
    partial[ty, 1, tx] = a1
    partial[ty, 2, tx] = a2
    partial[ty, 3, tx] = a3
    partial[ty, 4, tx] = a4
    partial[ty, 5, tx] = a5
    partial[ty, 6, tx] = a6
    partial[ty, 7, tx] = a7
    cuda.syncthreads()
    # Thread row ty finishes output rows m0 + ty, m0 + ty + slices, ... (a block may have
    # fewer slices than GEMV_ROWS).
    for r in range(ty, GEMV_ROWS, slices):
        m = m0 + r
        if m < rows and n < cols:
            total = float32(0.0)
            for s in range(slices):
                total += partial[s, r, tx]
            if bias.shape[0] > 0:
                total += float32(bias[n])
            out[m, n] = total


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


@njit(nogil=True, cache=True)
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
