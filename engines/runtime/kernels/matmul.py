"""Matrix multiply ``out = x @ w_t + bias`` against a pre-transposed weight ``w_t[in, out]``.

Weights are stored transposed (``[in_features, out_features]``, C-contiguous) on both
backends: the CPU hands them straight to BLAS, and on the GPU consecutive threads read
consecutive output columns of one input row, so every weight load is coalesced. Two CUDA
kernels share that layout:

* :func:`matmul_tiled_cuda` for many rows (prefill): shared-memory tiles, each thread
  computing a 4x4 block of outputs, so each weight tile is read once per 4*blockDim.y rows.
* :func:`gemv_cuda` for few rows (decode): no tiles to fill, the whole block streams the
  weight once per ``GEMV_ROWS`` rows, splitting the input dimension across ``blockDim.y``.

Both accumulate in float32 whatever the weight dtype. ``bias`` is a zero-length array when
the layer has none.
"""
import numpy as np
from numba import cuda, float32

# Inner dimension of a shared-memory tile; a block tile is (4*blockDim.y) x (4*blockDim.x).
TILE_K = 16
TILE_MAX = 64  # largest block tile side: blockDim up to (16, 16)
# Rows of x one GEMV block multiplies, kept in four scalar accumulators per thread.
GEMV_ROWS = 4
GEMV_MAX_COLS = 32    # largest blockDim.x (output columns per block)
GEMV_MAX_SLICES = 16  # largest blockDim.y (slices of the input dimension per column)


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
    """Few-row ``out = x @ w_t + bias``. Block ``(cols, slices)`` (cols <= 32, slices <= 16),
    grid ``(ceil(N / cols), ceil(M / GEMV_ROWS))``.

    Thread (tx, ty) sums input indices ``k = ty, ty + slices, ...`` for column ``n`` and up
    to four rows; a warp (fixed ty) reads one contiguous run of a w_t row, and all its
    threads read the same x element (a broadcast). The slices are summed through shared
    memory at the end.
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
    # Rows past the end re-read the last row and are dropped at the end: cheaper than a
    # branch per multiply-add in the inner loop.
    last = rows - 1
    r0 = m0
    r1 = min(m0 + 1, last)
    r2 = min(m0 + 2, last)
    r3 = min(m0 + 3, last)
    a0 = float32(0.0)
    a1 = float32(0.0)
    a2 = float32(0.0)
    a3 = float32(0.0)
    if n < cols:
        for k in range(ty, inner, slices):
            w = float32(w_t[k, n])
            a0 += x[r0, k] * w
            a1 += x[r1, k] * w
            a2 += x[r2, k] * w
            a3 += x[r3, k] * w
    partial[ty, 0, tx] = a0
    partial[ty, 1, tx] = a1
    partial[ty, 2, tx] = a2
    partial[ty, 3, tx] = a3
    cuda.syncthreads()
    # Thread row ty < GEMV_ROWS finishes output row m0 + ty (slices >= GEMV_ROWS is not
    # required: the loop below covers the rows a short block lacks threads for).
    for r in range(ty, GEMV_ROWS, slices):
        m = m0 + r
        if m < rows and n < cols:
            total = float32(0.0)
            for s in range(slices):
                total += partial[s, r, tx]
            if bias.shape[0] > 0:
                total += float32(bias[n])
            out[m, n] = total


def matmul_cpu(x: np.ndarray, w_t: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """CPU twin of both CUDA kernels: BLAS sgemm into ``out`` (releases the GIL), plus bias."""
    np.matmul(x, w_t, out=out)
    if bias.shape[0]:
        out += bias


_SIGNATURE = "void(float32[:, ::1], {dt}[:, ::1], {dt}[::1], float32[:, ::1])"
CUDA_SIGNATURES = {
    matmul_tiled_cuda: _SIGNATURE,
    gemv_cuda: _SIGNATURE,
}
