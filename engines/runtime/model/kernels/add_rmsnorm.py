"""RMSNorm with the residual add fused in: ``x[r] += residual[r]; out[i] = rmsnorm(x[r]) * weight``
for ``r = rows[i]``.

Fusing the add saves a pass over the residual stream per sublayer: the row is read once,
updated in place and normalised while it is still in L1. The same kernel serves every norm
of the model:

* before each sublayer, ``rows`` is ``0 .. num_tokens-1`` (the step's identity rows);
* on the first layer ``residual`` has zero rows: nothing to add yet, a plain RMSNorm;
* the final norm gathers only the rows that need logits (each sequence's last token at
  prefill), so the LM head multiplies ``num_seqs`` rows instead of the whole chunk.

Arithmetic follows transformers' ``LlamaRMSNorm``: ``weight * (x * rsqrt(mean(x^2) + eps))``
in float32.
"""
import math
from typing import Any

import numpy as np
from numba import cuda, float32, njit

from engines.runtime.model.kernels.launch_cost import LaunchCost, nbytes

# Largest block the kernel is launched with; sizes the reduction scratch.
NORM_MAX_THREADS = 256


@cuda.jit(cache=True)
def add_rmsnorm_cuda(x, residual, rows, weight, eps, out):
    """Grid ``(len(rows),)``, block a power of two threads (<= NORM_MAX_THREADS).

    Each thread handles columns ``tid, tid + blockDim.x, ...`` in every phase, so it only
    ever re-reads values it wrote itself: the in-place add needs no barrier.
    """
    scratch = cuda.shared.array(NORM_MAX_THREADS, float32)
    i = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    step = cuda.blockDim.x
    row = rows[i]
    width = x.shape[1]
    add = residual.shape[0] > 0
    sum_sq = float32(0.0)
    for h in range(tid, width, step):
        v = x[row, h]
        if add:
            v += residual[row, h]
            x[row, h] = v
        sum_sq += v * v
    # Tree reduction in shared memory (the simulator has no warp shuffles; once per row).
    scratch[tid] = sum_sq
    cuda.syncthreads()
    stride = step // 2
    while stride > 0:
        if tid < stride:
            scratch[tid] += scratch[tid + stride]
        cuda.syncthreads()
        stride //= 2
    inv_rms = float32(1.0) / math.sqrt(scratch[0] / float32(width) + eps)
    for h in range(tid, width, step):
        out[i, h] = x[row, h] * inv_rms * weight[h]


@njit(nogil=True, cache=True, error_model="numpy", fastmath={"reassoc", "contract", "nsz", "arcp"})
def add_rmsnorm_cpu(x, residual, rows, weight, eps, out):
    """CPU twin of :func:`add_rmsnorm_cuda`."""
    width = x.shape[1]
    add = residual.shape[0] > 0
    for i in range(rows.shape[0]):
        row = rows[i]
        sum_sq = float32(0.0)
        for h in range(width):
            v = x[row, h]
            if add:
                v += residual[row, h]
                x[row, h] = v
            sum_sq += v * v
        inv_rms = float32(1.0) / math.sqrt(sum_sq / float32(width) + eps)
        for h in range(width):
            out[i, h] = x[row, h] * inv_rms * weight[h]


CUDA_SIGNATURES = {
    add_rmsnorm_cuda: "void(float32[:, ::1], float32[:, ::1], int32[::1], float32[::1], float32, float32[:, ::1])",
}


def launch_cost(args: tuple[Any, ...], kv_positions: int, attended: int) -> LaunchCost:
    """The backend's ``add_rmsnorm(x, residual, rows, weight, eps, out)``."""
    x, residual, rows, weight, _eps, out = args
    return "add_rmsnorm", 2 * nbytes(x) + nbytes(residual) + nbytes(weight) + nbytes(out), 5 * int(np.prod(x.shape))
