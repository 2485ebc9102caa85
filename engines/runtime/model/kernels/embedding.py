"""Embedding gather: each token's hidden state starts as its row of the embedding table."""
from typing import Any

from numba import cuda, float32, njit

from engines.runtime.model.kernels.launch_cost import LaunchCost, nbytes


@cuda.jit(cache=True)
def embedding_gather_cuda(token_ids, table, out):
    """``out[t, :] = table[token_ids[t], :]``, widened to float32.

    Grid ``(num_tokens, ceil(hidden / blockDim.x))``, one thread per element.
    """
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if h < out.shape[1]:
        out[t, h] = float32(table[token_ids[t], h])


@njit(nogil=True, cache=True, fastmath=False)
def embedding_gather_cpu(token_ids, table, out):
    """CPU twin of :func:`embedding_gather_cuda`."""
    for t in range(token_ids.shape[0]):
        row = table[token_ids[t]]
        for h in range(out.shape[1]):
            out[t, h] = row[h]


CUDA_SIGNATURES = {
    embedding_gather_cuda: "void(int32[::1], {dt}[:, ::1], float32[:, ::1])",
}


def launch_cost(args: tuple[Any, ...], kv_positions: int, attended: int) -> LaunchCost:
    """The backend's ``embedding(token_ids, table, out)``: each row read and written once (a gather)."""
    token_ids, _table, out = args
    return "embedding", 2 * nbytes(out) + nbytes(token_ids), 0
