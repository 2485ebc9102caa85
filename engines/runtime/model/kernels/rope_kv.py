"""RoPE + KV append, fused: rotate each token's q and k by its position, then write k and v
into the token's slot of the paged KV cache.

Layouts: ``qkv[t]`` is the fused projection output ``[q heads | k heads | v heads]``, each
head ``head_dim`` wide; ``k_cache``/``v_cache`` are
``[layers, pages, kv_heads, page_size, head_dim]``, so one head's keys within a page are
contiguous for attention to stream. Token ``t`` of sequence ``s`` at position ``p`` goes to
page ``page_table[s, p // page_size]``, slot ``p % page_size``.

Rotation is Llama's "rotate half" form (as transformers' ``apply_rotary_pos_emb``): for
``i < head_dim/2``, ``(x[i], x[i+half]) -> (x[i]*cos - x[i+half]*sin, x[i+half]*cos + x[i]*sin)``.
q is rotated in place in ``qkv``; attention reads it from there.
"""
from typing import Any

import numpy as np
from numba import cuda, njit

from engines.runtime.model.kernels.launch_cost import LaunchCost, nbytes


def rope_tables(head_dim: int, rope_theta: float, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables ``[max_positions, head_dim // 2]`` (float32).

    Computed in float32 the way transformers does (``inv_freq`` in float32, one float32
    product with the position, then cos/sin), so the angles round identically.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(rope_theta) ** exponents)
    angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.ascontiguousarray(np.cos(angles)), np.ascontiguousarray(np.sin(angles))


@cuda.jit(cache=True)
def rope_kv_append_cuda(qkv, positions, token_seq, page_table, cos, sin, k_cache, v_cache, layer, num_q_heads):
    """Grid ``(num_tokens, num_q_heads + num_kv_heads)``, block ``head_dim // 2`` threads:
    block (t, h) rotates q head h in place (h < num_q_heads), or rotates kv head
    ``h - num_q_heads``'s k into the cache and copies its v.
    """
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    i = cuda.threadIdx.x
    num_kv_heads = k_cache.shape[2]
    page_size = k_cache.shape[3]
    head_dim = k_cache.shape[4]
    half = head_dim // 2
    pos = positions[t]
    c = cos[pos, i]
    s = sin[pos, i]
    if h < num_q_heads:
        base = h * head_dim
        x1 = qkv[t, base + i]
        x2 = qkv[t, base + half + i]
        qkv[t, base + i] = x1 * c - x2 * s
        qkv[t, base + half + i] = x2 * c + x1 * s
    else:
        kv_head = h - num_q_heads
        page = page_table[token_seq[t], pos // page_size]
        slot = pos % page_size
        k_base = (num_q_heads + kv_head) * head_dim
        v_base = (num_q_heads + num_kv_heads + kv_head) * head_dim
        x1 = qkv[t, k_base + i]
        x2 = qkv[t, k_base + half + i]
        k_cache[layer, page, kv_head, slot, i] = x1 * c - x2 * s
        k_cache[layer, page, kv_head, slot, half + i] = x2 * c + x1 * s
        v_cache[layer, page, kv_head, slot, i] = qkv[t, v_base + i]
        v_cache[layer, page, kv_head, slot, half + i] = qkv[t, v_base + half + i]


@njit(nogil=True, cache=True, error_model="numpy", fastmath=False)
def rotate_q_head(row, h, head_dim, c, s):
    """Rotate q head ``h`` (``head_dim`` wide) of the projection row ``row`` in place by the
    position's ``c``/``s`` (a row of :func:`rope_tables`)."""
    half = head_dim // 2
    x1 = row[h * head_dim:h * head_dim + half]
    x2 = row[h * head_dim + half:(h + 1) * head_dim]
    for i in range(half):
        a = x1[i]
        b = x2[i]
        x1[i] = a * c[i] - b * s[i]
        x2[i] = b * c[i] + a * s[i]


@njit(nogil=True, cache=True, error_model="numpy", fastmath=False)
def append_kv_head(row, kv_head, num_q_heads, num_kv_heads, c, s, key, value):
    """kv head ``kv_head`` of the projection row ``row``: its k rotated into the cache row ``key``
    (``head_dim`` wide), its v copied into ``value``."""
    head_dim = key.shape[0]
    half = head_dim // 2
    k_base = (num_q_heads + kv_head) * head_dim
    v_base = (num_q_heads + num_kv_heads + kv_head) * head_dim
    x1 = row[k_base:k_base + half]
    x2 = row[k_base + half:k_base + head_dim]
    for i in range(half):
        key[i] = x1[i] * c[i] - x2[i] * s[i]
        key[half + i] = x2[i] * c[i] + x1[i] * s[i]
    for i in range(head_dim):  # not a slice assignment: see kernels/__init__.py
        value[i] = row[v_base + i]


@njit(nogil=True, cache=True, error_model="numpy", fastmath=False)
def rope_kv_append_cpu(qkv, positions, token_seq, page_table, cos, sin, k_cache, v_cache, layer, num_q_heads):
    """CPU twin of :func:`rope_kv_append_cuda`. The loops run over 1-D slices (a head's halves,
    a cache slot's row), which LLVM vectorises, where indexing the 2-D and 5-D arrays element by
    element was not (docs/perf-log/cpu-anchors.md#2026-11-25-vectorised-exp)."""
    num_kv_heads = k_cache.shape[2]
    page_size = k_cache.shape[3]
    head_dim = k_cache.shape[4]
    for t in range(qkv.shape[0]):
        pos = positions[t]
        c = cos[pos]
        s = sin[pos]
        row = qkv[t]
        for h in range(num_q_heads):
            rotate_q_head(row, h, head_dim, c, s)
        page = page_table[token_seq[t], pos // page_size]
        slot = pos % page_size
        for kv_head in range(num_kv_heads):
            append_kv_head(row, kv_head, num_q_heads, num_kv_heads, c, s, k_cache[layer, page, kv_head, slot],
                           v_cache[layer, page, kv_head, slot])


CUDA_SIGNATURES = {
    rope_kv_append_cuda: (
        "void(float32[:, ::1], int32[::1], int32[::1], int32[:, ::1], float32[:, ::1], float32[:, ::1],"
        " {dt}[:, :, :, :, ::1], {dt}[:, :, :, :, ::1], int64, int64)"
    ),
}


def launch_cost(args: tuple[Any, ...], kv_positions: int, attended: int) -> LaunchCost:
    """The backend's ``rope_kv_append(qkv, step, cos, sin, k_cache, v_cache, layer, num_q_heads)``."""
    qkv = args[0]
    return "rope_kv_append", 2 * nbytes(qkv), 3 * int(np.prod(qkv.shape))
