"""Greedy sampling on the device: the index of each row's largest logit.

Copying ``num_seqs`` int32 ids back instead of ``num_seqs x vocab`` float32 logits is what
makes greedy decode cheap on the GPU. Ties go to the lowest index (as ``numpy.argmax``).
"""
from typing import Any

import numpy as np
from numba import cuda, float32, int32, njit

from engines.runtime.model.kernels.launch_cost import LaunchCost, nbytes

# Largest block the kernel is launched with; sizes the reduction scratch.
ARGMAX_MAX_THREADS = 256


@cuda.jit(cache=True)
def argmax_cuda(logits, out):
    """Grid ``(rows,)``, block a power of two threads; ``out[r] = argmax(logits[r])``."""
    best_value = cuda.shared.array(ARGMAX_MAX_THREADS, float32)
    best_index = cuda.shared.array(ARGMAX_MAX_THREADS, int32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    step = cuda.blockDim.x
    vocab = logits.shape[1]
    # Start from a real element (the thread's first, or the row's last) so a row of all
    # -inf still yields an in-range index.
    index = min(tid, vocab - 1)
    value = logits[row, index]
    for j in range(tid + step, vocab, step):
        v = logits[row, j]
        if v > value:
            value = v
            index = j
    best_value[tid] = value
    best_index[tid] = index
    cuda.syncthreads()
    stride = step // 2
    while stride > 0:
        if tid < stride:
            other_value = best_value[tid + stride]
            other_index = best_index[tid + stride]
            if other_value > best_value[tid] or (other_value == best_value[tid] and other_index < best_index[tid]):
                best_value[tid] = other_value
                best_index[tid] = other_index
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        out[row] = best_index[0]


@njit(nogil=True, cache=True, fastmath=False)
def argmax_cpu(logits, out):
    """CPU twin of :func:`argmax_cuda`."""
    for row in range(logits.shape[0]):
        index = 0
        value = logits[row, 0]
        for j in range(1, logits.shape[1]):
            if logits[row, j] > value:
                value = logits[row, j]
                index = j
        out[row] = index


CUDA_SIGNATURES = {
    argmax_cuda: "void(float32[:, ::1], int32[::1])",
}


def launch_cost(args: tuple[Any, ...], kv_positions: int, attended: int) -> LaunchCost:
    """The backend's ``argmax(logits, out)``."""
    logits, out = args
    return "argmax", nbytes(logits) + nbytes(out), int(np.prod(logits.shape))
