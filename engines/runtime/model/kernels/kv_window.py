"""A window of tokens' K (or V) between the paged cache and a per-token block.

Disaggregated serving moves the K/V of positions ``[begin:end]`` of one sequence between
engines as a block ``[num_layers, num_kv_heads, n, head_dim]`` (page layouts may differ between
engines). ``gather`` copies a window out of the pages, ``scatter`` writes one in; ``token_pages``
and ``token_slots`` give each token's page and slot. On a GPU both run on the device, so a
window costs one kernel (and, to or from the host, one contiguous copy) instead of a copy per
page and layer; between two engines on one GPU the block never leaves the device.
"""
from numba import cuda, njit


@cuda.jit(cache=True)
def kv_window_gather_cuda(store, token_pages, token_slots, out):
    """``out[l, h, t] = store[l, token_pages[t], h, token_slots[t]]``. Grid ``(n, layers * kv_heads)``,
    threads over ``head_dim``."""
    t = cuda.blockIdx.x
    heads = out.shape[1]
    layer, head = cuda.blockIdx.y // heads, cuda.blockIdx.y % heads
    page, slot = token_pages[t], token_slots[t]
    for d in range(cuda.threadIdx.x, out.shape[3], cuda.blockDim.x):
        out[layer, head, t, d] = store[layer, page, head, slot, d]


@cuda.jit(cache=True)
def kv_window_scatter_cuda(src, token_pages, token_slots, store):
    """``store[l, token_pages[t], h, token_slots[t]] = src[l, h, t]``; the grid of the gather."""
    t = cuda.blockIdx.x
    heads = src.shape[1]
    layer, head = cuda.blockIdx.y // heads, cuda.blockIdx.y % heads
    page, slot = token_pages[t], token_slots[t]
    for d in range(cuda.threadIdx.x, src.shape[3], cuda.blockDim.x):
        store[layer, page, head, slot, d] = src[layer, head, t, d]


@njit(nogil=True, cache=True, fastmath=False)
def kv_window_gather_cpu(store, token_pages, token_slots, out):
    """CPU twin of :func:`kv_window_gather_cuda`. Serial: it runs between steps, right after
    BLAS calls whose spinning threads would stall a parallel loop, and one core copies a window at
    memory speed anyway."""
    for layer in range(out.shape[0]):
        for head in range(out.shape[1]):
            for t in range(out.shape[2]):
                src = store[layer, token_pages[t], head, token_slots[t]]
                for d in range(out.shape[3]):  # not a slice assignment: see kernels/__init__.py
                    out[layer, head, t, d] = src[d]


@njit(nogil=True, cache=True, fastmath=False)
def kv_window_scatter_cpu(src, token_pages, token_slots, store):
    """CPU twin of :func:`kv_window_scatter_cuda`."""
    for layer in range(src.shape[0]):
        for head in range(src.shape[1]):
            for t in range(src.shape[2]):
                dst = store[layer, token_pages[t], head, token_slots[t]]
                for d in range(src.shape[3]):
                    dst[d] = src[layer, head, t, d]


def launch_shape(num_layers: int, num_kv_heads: int, num_tokens: int, head_dim: int) -> tuple[tuple[int, int], int]:
    """Grid and block of both CUDA kernels."""
    return (num_tokens, num_layers * num_kv_heads), min(head_dim, 128)


CUDA_SIGNATURES = {
    kv_window_gather_cuda: "void({dt}[:, :, :, :, ::1], int32[::1], int32[::1], {dt}[:, :, :, ::1])",
    # The source may be a slice along tokens of a block (the part of a window a cache lacks).
    kv_window_scatter_cuda: "void({dt}[:, :, :, :], int32[::1], int32[::1], {dt}[:, :, :, :, ::1])",
}
