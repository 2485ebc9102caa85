"""GGUF tensors to float32: one numba kernel per ggml block format, blocks over the cores.

Each kernel reads a tensor's blocks (``uint8 [blocks, block_bytes]``, a view of the mapped file)
and writes ``float32 [blocks, block_elements]``, with the arithmetic of ggml's reference
``dequantize_row_*`` (``ggml-quants.c``) in the same order, so the values are the ones llama.cpp
and the ``gguf`` package compute (the tests diff every type against ``gguf.quants.dequantize``,
the plain reference, on random blocks and on a real file). fp16 block scales go through a
65,536-entry table (every half value as float32), which is exact for all of them, subnormals,
infinities and NaNs included. No fastmath: a fused multiply-add would round differently from the
reference.

The block layouts (ggml's ``block_q*`` structs, little-endian):

- ``Q4_0`` d, 16 nibble bytes: element j is ``(qs[j] & 15) - 8`` (j < 16) or ``(qs[j-16] >> 4) - 8``, times d;
- ``Q4_1`` d, m, 16 nibble bytes: ``q * d + m`` with the same nibbles;
- ``Q5_0`` / ``Q5_1``: as Q4_0 / Q4_1 with a fifth bit per element from a 32-bit ``qh`` (bit j), and
  an offset of 16 for Q5_0;
- ``Q8_0`` d, 32 int8: ``q * d``;
- the K-quants pack 256 elements in sub-blocks of 32 (Q4_K, Q5_K: 6-bit scale and min per
  sub-block, a super-block d and dmin) or 16 (Q6_K: int8 scales; Q2_K: 4-bit scale and min; Q3_K:
  6-bit signed scales), their low bits and high bits in separate arrays.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
from numba import float32, njit, prange

from engines.runtime.model.config import CheckpointError
from engines.runtime.model.quant.quant_types import GGMLType

__all__ = ["DEQUANTIZABLE", "dequantize", "half_table"]


@lru_cache(maxsize=1)
def half_table() -> np.ndarray:
    """Every IEEE half as float32, indexed by its 16 bits."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


_JIT: dict[str, Any] = dict(nogil=True, cache=True, parallel=True, fastmath=False)


@njit(inline="always")
def _half(table, blocks, b, at):
    """The fp16 value stored little-endian at byte ``at`` of block ``b``."""
    return table[np.int32(blocks[b, at]) | (np.int32(blocks[b, at + 1]) << 8)]


@njit(**_JIT)
def _q4_0(blocks, table, out):
    for b in prange(blocks.shape[0]):
        d = _half(table, blocks, b, 0)
        for j in range(16):
            q = np.int32(blocks[b, 2 + j])
            out[b, j] = d * float32((q & 15) - 8)
            out[b, j + 16] = d * float32((q >> 4) - 8)


@njit(**_JIT)
def _q4_1(blocks, table, out):
    for b in prange(blocks.shape[0]):
        d = _half(table, blocks, b, 0)
        m = _half(table, blocks, b, 2)
        for j in range(16):
            q = np.int32(blocks[b, 4 + j])
            out[b, j] = d * float32(q & 15) + m
            out[b, j + 16] = d * float32(q >> 4) + m


@njit(inline="always")
def _u32(blocks, b, at):
    return (np.uint32(blocks[b, at]) | (np.uint32(blocks[b, at + 1]) << np.uint32(8))
            | (np.uint32(blocks[b, at + 2]) << np.uint32(16)) | (np.uint32(blocks[b, at + 3]) << np.uint32(24)))


@njit(**_JIT)
def _q5_0(blocks, table, out):
    for b in prange(blocks.shape[0]):
        d = _half(table, blocks, b, 0)
        qh = _u32(blocks, b, 2)
        for j in range(16):
            q = np.int32(blocks[b, 6 + j])
            lo = np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4
            hi = np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
            out[b, j] = d * float32(((q & 15) | lo) - 16)
            out[b, j + 16] = d * float32(((q >> 4) | hi) - 16)


@njit(**_JIT)
def _q5_1(blocks, table, out):
    for b in prange(blocks.shape[0]):
        d = _half(table, blocks, b, 0)
        m = _half(table, blocks, b, 2)
        qh = _u32(blocks, b, 4)
        for j in range(16):
            q = np.int32(blocks[b, 8 + j])
            lo = np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4
            hi = np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
            out[b, j] = d * float32((q & 15) | lo) + m
            out[b, j + 16] = d * float32((q >> 4) | hi) + m


@njit(**_JIT)
def _q8_0(blocks, table, out):
    for b in prange(blocks.shape[0]):
        d = _half(table, blocks, b, 0)
        for j in range(32):
            out[b, j] = float32(np.int8(blocks[b, 2 + j])) * d


@njit(inline="always")
def _scale_min_k4(blocks, b, at, j):
    """Sub-block ``j``'s 6-bit scale and min from the 12 packed bytes at ``at`` (Q4_K, Q5_K)."""
    if j < 4:
        sc = np.int32(blocks[b, at + j]) & 63
        mn = np.int32(blocks[b, at + j + 4]) & 63
    else:
        sc = (np.int32(blocks[b, at + j + 4]) & 15) | ((np.int32(blocks[b, at + j - 4]) >> 6) << 4)
        mn = (np.int32(blocks[b, at + j + 4]) >> 4) | ((np.int32(blocks[b, at + j]) >> 6) << 4)
    return sc, mn


@njit(**_JIT)
def _q4_k_or_q5_k(blocks, table, out, qs_at, qh_at):
    # Q4_K: d, dmin, scales[12], qs[128]; sub-block s (32 elements) is the low (s even) or high
    # nibbles of qs[32 * (s // 2):][:32]. Q5_K (qh_at >= 0) puts qh[32] before qs, and bit s of
    # qh[l] is element l's fifth bit.
    for b in prange(blocks.shape[0]):
        d = _half(table, blocks, b, 0)
        dmin = _half(table, blocks, b, 2)
        for s in range(8):
            sc, mn = _scale_min_k4(blocks, b, 4, s)
            d1 = d * float32(sc)
            m1 = dmin * float32(mn)
            shift = 4 * (s & 1)
            base = qs_at + 32 * (s >> 1)
            for l in range(32):  # noqa: E741 - ggml's name for the element in a chunk
                q = (np.int32(blocks[b, base + l]) >> shift) & 15
                if qh_at >= 0:
                    q |= ((np.int32(blocks[b, qh_at + l]) >> s) & 1) << 4
                out[b, 32 * s + l] = d1 * float32(q) - m1


@njit(**_JIT)
def _q6_k(blocks, table, out):
    # ql[128], qh[64], scales[16] (int8), d: two halves of 128 elements; in half h, the 32-element
    # chunk j (0..3) takes nibble j // 2 of ql[64h + 32 (j % 2) + l] and bits 2j..2j+1 of qh[32h + l].
    for b in prange(blocks.shape[0]):
        d = _half(table, blocks, b, 208)
        for h in range(2):
            for j in range(4):
                ql_base = 64 * h + 32 * (j & 1)
                ql_shift = 4 * (j >> 1)
                for l in range(32):  # noqa: E741 - as in the layout comment above (and ggml)
                    e = 128 * h + 32 * j + l
                    lo = (np.int32(blocks[b, ql_base + l]) >> ql_shift) & 15
                    hi = (np.int32(blocks[b, 128 + 32 * h + l]) >> (2 * j)) & 3
                    scale = d * float32(np.int8(blocks[b, 192 + e // 16]))
                    out[b, e] = scale * float32((lo | (hi << 4)) - 32)


@njit(**_JIT)
def _q2_k(blocks, table, out):
    # scales[16] (4-bit scale | 4-bit min), qs[64], d, dmin: element e takes 2 bits of
    # qs[32 (e // 128) + e % 32], shifted by 2 ((e // 32) % 4).
    for b in prange(blocks.shape[0]):
        d = _half(table, blocks, b, 80)
        dmin = _half(table, blocks, b, 82)
        for e in range(256):
            packed = np.int32(blocks[b, e // 16])
            dl = d * float32(packed & 15)
            ml = dmin * float32(packed >> 4)
            q = (np.int32(blocks[b, 16 + 32 * (e // 128) + e % 32]) >> (2 * ((e // 32) % 4))) & 3
            out[b, e] = dl * float32(q) - ml


@njit(**_JIT)
def _q3_k(blocks, table, out):
    # hmask[32], qs[64], scales[12] (16 signed 6-bit scales), d: Q2_K's 2-bit layout, minus 4 where
    # bit (e // 32) of hmask[e % 32] is clear.
    for b in prange(blocks.shape[0]):
        d = _half(table, blocks, b, 108)
        for e in range(256):
            i = e // 16
            if i < 8:
                low = np.int32(blocks[b, 96 + i]) & 15
            else:
                low = np.int32(blocks[b, 96 + i - 8]) >> 4
            high = (np.int32(blocks[b, 104 + i % 4]) >> (2 * (i // 4))) & 3
            dl = d * float32((low | (high << 4)) - 32)
            q = (np.int32(blocks[b, 32 + 32 * (e // 128) + e % 32]) >> (2 * ((e // 32) % 4))) & 3
            if (np.int32(blocks[b, e % 32]) >> (e // 32)) & 1 == 0:
                q -= 4
            out[b, e] = dl * float32(q)


_BLOCK_KERNELS = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q6_K": _q6_k,
    "Q4_K": lambda blocks, table, out: _q4_k_or_q5_k(blocks, table, out, 16, -1),
    "Q5_K": lambda blocks, table, out: _q4_k_or_q5_k(blocks, table, out, 48, 16),
}

#: Every ggml type :func:`dequantize` reads.
DEQUANTIZABLE = frozenset({"F32", "F16", "BF16"}) | frozenset(_BLOCK_KERNELS)


def dequantize(raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, ...], *,
               keep_float16: bool = False) -> np.ndarray:
    """``raw`` (a tensor's bytes, ``uint8``) as a float32 array of ``shape``.

    ``keep_float16`` returns an F16 tensor as float16 (what the safetensors loader does: the
    engine converts to its dtype, once). Raises :class:`CheckpointError` for a type with no kernel.
    """
    name = ggml_type.name
    count = int(np.prod(shape, dtype=np.int64))
    if name == "F32":
        return raw.view("<f4").reshape(shape).copy()
    if name == "F16":
        half = raw.view("<f2").reshape(shape)
        return half.copy() if keep_float16 else half.astype(np.float32)
    if name == "BF16":
        # bfloat16 is the top half of a float32.
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    kernel = _BLOCK_KERNELS.get(name)
    if kernel is None:
        raise CheckpointError(f"ggml type {name} is not supported: this engine reads "
                              f"{', '.join(sorted(DEQUANTIZABLE))}")
    num_blocks = count // ggml_type.block_elements
    blocks = raw.reshape(num_blocks, ggml_type.block_bytes)
    out = np.empty((num_blocks, ggml_type.block_elements), np.float32)
    kernel(blocks, half_table(), out)
    return out.reshape(shape)
