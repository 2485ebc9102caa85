"""``out = x @ W.T + bias`` with ``W`` kept quantized in the row-major layout
(``quantized_weight.QuantizedWeight``: Q8_0, Q4_0, Q4_1), dequantized in the kernel: memory holds,
and a decode step reads, the file's bytes, not float32's four per element (a quarter of them for
Q8_0, an eighth for Q4_0). The CPU backend reads a matrix whose rows come in whole groups of 16
interleaved instead (``interleaved_dot``, faster at every row count); what is here serves the rest,
and the CUDA backend's layout.

On the CPU, a decode step's few rows (up to ``matmul.CPU_ROWS_KERNEL_MAX_ROWS``) go through
``quantized_dot.quantized_dot_rows_cpu``: the activations quantized to int8 too, each block's dot
one integer instruction (llama.cpp's scheme; its module says why and what it costs). Many rows
(prefill) go through BLAS sgemm, a panel of weight rows dequantized at a time
(:func:`quantized_matmul_cpu`), so no float32 copy of the whole weight is ever made.

:func:`quantized_matmul_rows_cpu` is the few-row product with float32 activations, the CUDA GEMV's
CPU twin: four weight rows at a time, in ``matmul_rows_cpu``'s four long streams (``n, n + q,
n + 2q, n + 3q``), dequantized into a small float32 tile that stays in L1, then
``matmul.four_weight_rows``, the float32 kernel's own register-blocked loop, on the tile. It was
the CPU's decode path until the integer one beat it (0.6x float32's speed at one row:
docs/perf-log/quantized-weights.md).

The CUDA backend's kernels: :func:`quantized_gemv_cuda` for every row count (a prefill's rows in
groups of ``GEMV_ROWS``) and :func:`quantized_embedding_cuda` for the table's rows. The GEMV: a
warp per output column reads its quantized row (consecutive lanes, consecutive bytes), each lane
dequantizing its element in registers for up to ``GEMV_ROWS`` rows of ``x``, and the lanes' sums
are added at the end. Both accumulate in float32. Scales go through ``half_table`` (every half as
float32): exact, subnormals included.

The reference for both is the dequantize-then-float32 path: ``QuantizedWeight.dequantize`` (the
loader's own dequantization of the file's blocks) and a float32 matmul (tests diff them).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, get_num_threads, njit, prange

from engines.runtime.model.quant.dequantize import half_table
from engines.runtime.model.kernels.matmul import CPU_ROWS_KERNEL_MAX_ROWS, FOUR_ROW_BLOCKS, add_bias, four_weight_rows
# (dequantize_rows_cpu lives beside the IR it calls: numba's cache keys a function by its own file.)
from engines.runtime.model.kernels.quantized_dot import dequantize_rows_cpu, quantized_dot_rows_cpu
from engines.runtime.model.kernels.vector_width import prefer_wide_vectors
from engines.runtime.model.quant.quantized_weight import BLOCK, QuantizedWeight

__all__ = ["dequantize_rows_cpu", "quantized_embedding_cpu", "quantized_embedding_cuda", "quantized_gemv_cuda",
           "quantized_matmul_cpu", "quantized_matmul_reference", "quantized_matmul_rows_cpu", "panel_rows",
           "rows_kernel_chunks"]

_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
#: A prefill's float32 panel of dequantized weight rows for sgemm, in bytes (``panel_rows``): larger
#: panels let BLAS use its threads: 256-row panels (0.6 MB at SmolLM2's in = 576) gained 1.1x from a
#: second thread in a 512-token prefill, 8 MB ones 1.5x (docs/perf-log/quantized-weights.md).
PANEL_BYTES = 8 << 20
#: The fewest rows a panel has, however long the rows.
PANEL_MIN_ROWS = 256
#: Chunks of four-row blocks per numba thread in the rows kernel: each chunk allocates its tile once.
CHUNKS_PER_THREAD = 8
GEMV_ROWS = 8  # rows of x a CUDA block multiplies (eight accumulators a lane)
GEMV_MAX_WARPS = 8  # largest blockDim.y of the GEMV (output columns a block)
WARP = 32


@njit(inline="always")
def dequantize_row(quants, scales, minima, table, n, out_row):
    """Row ``n`` of the weight as float32 into ``out_row`` (1-D, ``in`` long). The type follows from
    the arrays: int8 quants as long as the row are Q8_0; nibbles without minima Q4_0, with Q4_1."""
    blocks = out_row.shape[0] // BLOCK
    if quants.shape[1] == out_row.shape[0]:
        for b in range(blocks):
            d = table[scales[n, b]]
            for j in range(BLOCK):
                out_row[BLOCK * b + j] = float32(quants[n, BLOCK * b + j]) * d
    elif minima.shape[1] == 0:
        for b in range(blocks):
            d = table[scales[n, b]]
            for j in range(BLOCK // 2):
                q = np.int32(np.uint8(quants[n, 16 * b + j]))
                out_row[BLOCK * b + j] = float32((q & 15) - 8) * d
                out_row[BLOCK * b + 16 + j] = float32((q >> 4) - 8) * d
    else:
        for b in range(blocks):
            d = table[scales[n, b]]
            m = table[minima[n, b]]
            for j in range(BLOCK // 2):
                q = np.int32(np.uint8(quants[n, 16 * b + j]))
                out_row[BLOCK * b + j] = float32(q & 15) * d + m
                out_row[BLOCK * b + 16 + j] = float32(q >> 4) * d + m


@njit(nogil=True, cache=True, parallel=True, fastmath=_FASTMATH)
def quantized_matmul_rows_cpu(x, quants, scales, minima, table, bias, out, chunks,
                              four_row_blocks=FOUR_ROW_BLOCKS):
    """``out = x @ W.T + bias`` for few rows of ``x``, ``W`` quantized (see the module's docstring),
    its blocks of four weight rows in ``chunks`` parts over numba's threads (each allocates its tile
    once; :func:`rows_kernel_chunks`)."""
    rows, inner = x.shape
    cols = scales.shape[0]
    q = cols // 4
    chunks = max(1, min(q, chunks))
    for chunk in prange(chunks):
        prefer_wide_vectors()
        tile = np.empty((4, inner), np.float32)
        for block in range(chunk * q // chunks, (chunk + 1) * q // chunks):
            n1, n2, n3 = block + q, block + 2 * q, block + 3 * q
            dequantize_row(quants, scales, minima, table, block, tile[0])
            dequantize_row(quants, scales, minima, table, n1, tile[1])
            dequantize_row(quants, scales, minima, table, n2, tile[2])
            dequantize_row(quants, scales, minima, table, n3, tile[3])
            four_weight_rows(x, tile[0], tile[1], tile[2], tile[3], out, block, n1, n2, n3, four_row_blocks)
    row = np.empty(inner, np.float32)
    for n in range(4 * q, cols):  # the columns past the blocks of four
        dequantize_row(quants, scales, minima, table, n, row)
        for m in range(rows):
            s = float32(0.0)
            for k in range(inner):
                s += x[m, k] * row[k]
            out[m, n] = s
    add_bias(out, bias, 0, cols)


@njit(nogil=True, cache=True, fastmath=False)
def quantized_embedding_cpu(token_ids, quants, scales, minima, table, out):
    """``out[t] = W[token_ids[t]]`` for a quantized embedding table: the rows dequantized (exactly)."""
    for t in range(token_ids.shape[0]):
        dequantize_row(quants, scales, minima, table, token_ids[t], out[t])


def rows_kernel_chunks() -> int:
    """The parts :func:`quantized_matmul_rows_cpu` splits its work into: a few a thread, so that the
    thread that finishes last waits little (numba's thread count, read here: read in compiled code,
    it would keep the kernel out of numba's cache)."""
    return CHUNKS_PER_THREAD * get_num_threads()


def panel_rows(inner: int) -> int:
    """Weight rows of ``inner`` elements a prefill dequantizes at a time (``PANEL_BYTES`` of float32)."""
    return max(PANEL_MIN_ROWS, PANEL_BYTES // (4 * inner))


def quantized_matmul_cpu(x: np.ndarray, weight: QuantizedWeight, bias: np.ndarray, out: np.ndarray) -> None:
    """CPU ``out = x @ W.T + bias`` (float32 ``x`` and ``out``): :func:`quantized_matmul_rows_cpu` up
    to ``matmul.CPU_ROWS_KERNEL_MAX_ROWS`` rows, BLAS sgemm on dequantized panels beyond."""
    table = half_table()
    if x.shape[0] <= CPU_ROWS_KERNEL_MAX_ROWS:
        quantized_dot_rows_cpu(x, weight.quants, weight.scales, weight.minima, table, bias, out,
                               rows_kernel_chunks())
        return
    cols = weight.shape[0]
    rows = panel_rows(x.shape[1])
    panel = np.empty((min(rows, cols), x.shape[1]), np.float32)
    product = np.empty((x.shape[0], panel.shape[0]), np.float32)
    for first in range(0, cols, rows):
        count = min(rows, cols - first)
        dequantize_rows_cpu(weight.quants, weight.scales, weight.minima, table, first, panel[:count])
        np.matmul(x, panel[:count].T, out=product[:, :count])
        out[:, first:first + count] = product[:, :count]
    if bias.shape[0]:
        out += bias


def quantized_matmul_reference(x: np.ndarray, weight: QuantizedWeight, bias: np.ndarray) -> np.ndarray:
    """The plain path every kernel here is diffed against: the weight dequantized as the loader
    does it, then a float32 product (float64 sums, rounded once)."""
    product = x.astype(np.float64) @ weight.dequantize().astype(np.float64).T
    if bias.shape[0]:
        product += bias
    return product.astype(np.float32)


@cuda.jit(device=True, inline=True)
def _weight_element(quants, scales, minima, table, n, k):
    """Element ``k`` of weight row ``n`` as float32 (the layouts of ``dequantize_row``)."""
    b = k // BLOCK
    d = table[scales[n, b]]
    if quants.shape[1] == scales.shape[1] * BLOCK:
        return float32(quants[n, k]) * d
    j = k % BLOCK
    byte = np.int32(np.uint8(quants[n, 16 * b + j % 16]))
    nibble = (byte & 15) if j < 16 else (byte >> 4)
    if minima.shape[1] == 0:
        return float32(nibble - 8) * d
    return float32(nibble) * d + table[minima[n, b]]


@cuda.jit(cache=True)
def quantized_gemv_cuda(x, quants, scales, minima, table, bias, out):
    """Few-row ``out = x @ W.T + bias``, ``W`` quantized. Block ``(32, warps)`` (warps <=
    ``GEMV_MAX_WARPS``), grid ``(ceil(N / warps), ceil(M / GEMV_ROWS))``: warp ``ty`` of block ``bx``
    owns output column ``bx * warps + ty`` and rows ``by * GEMV_ROWS ..``; lane ``tx`` sums elements
    ``tx, tx + 32, ..`` of the column's weight row (a warp's loads read consecutive bytes) for each
    row, and the lanes' sums are added through shared memory (lane r of the warp adds row r's)."""
    partial = cuda.shared.array((GEMV_MAX_WARPS, GEMV_ROWS, WARP), float32)
    lane = cuda.threadIdx.x
    warp = cuda.threadIdx.y
    n = cuda.blockIdx.x * cuda.blockDim.y + warp
    m0 = cuda.blockIdx.y * GEMV_ROWS
    rows = x.shape[0]
    inner = x.shape[1]
    cols = scales.shape[0]
    acc = cuda.local.array(GEMV_ROWS, float32)
    for r in range(GEMV_ROWS):
        acc[r] = float32(0.0)
    if n < cols:  # the whole warp agrees: it is one column
        for k in range(lane, inner, WARP):
            w = _weight_element(quants, scales, minima, table, n, k)
            for r in range(GEMV_ROWS):
                if m0 + r < rows:
                    acc[r] += x[m0 + r, k] * w
    for r in range(GEMV_ROWS):
        partial[warp, r, lane] = acc[r]
    cuda.syncthreads()
    m = m0 + lane
    if lane < GEMV_ROWS and n < cols and m < rows:
        total = float32(0.0)
        for i in range(WARP):
            total += partial[warp, lane, i]
        if bias.shape[0] > 0:
            total += float32(bias[n])
        out[m, n] = total


@cuda.jit(cache=True)
def quantized_embedding_cuda(token_ids, quants, scales, minima, table, out):
    """``out[t] = W[token_ids[t]]`` for a quantized table (the CPU twin: :func:`quantized_embedding_cpu`).
    Grid ``(num_tokens, ceil(in / blockDim.x))``, a thread an element."""
    t = cuda.blockIdx.x
    k = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if k < out.shape[1]:
        out[t, k] = _weight_element(quants, scales, minima, table, token_ids[t], k)


#: ``{dt}`` here is the quants' dtype: int8 for Q8_0, uint8 (nibbles) for Q4_0 and Q4_1.
SIGNATURE_DTYPES = ("int8", "uint8")
CUDA_SIGNATURES = {
    quantized_gemv_cuda: "void(float32[:, ::1], {dt}[:, ::1], uint16[:, ::1], uint16[:, ::1], float32[::1], "
                         "float32[::1], float32[:, ::1])",
    quantized_embedding_cuda: "void(int32[::1], {dt}[:, ::1], uint16[:, ::1], uint16[:, ::1], float32[::1], "
                              "float32[:, ::1])",
}
