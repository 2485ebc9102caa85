"""A quantized weight with its rows interleaved in groups of ``GROUP``, the layout the CPU's
integer dots read (``kernels.interleaved_dot``).

:class:`~engines.runtime.model.quant.quantized_weight.QuantizedWeight` keeps a row's quants in one run,
so a vector of a block's bytes holds partial sums of one output, which every row of the step must
then add across lanes, and a block's scale is spread over lanes for each row. Interleaved, the same
bytes lie so that one 64-byte load holds four bytes of each of 16 weight rows: one ``vpdpbusd``
with four activation bytes broadcast adds to 16 outputs at once, each lane an output, and a block's
16 scales are one vector (llama.cpp's repacked GEMV/GEMM does the same for its Q4_0 and Q8_0).

Group ``g`` holds rows ``16g .. 16g + 15``; for block ``b`` (of ``blocks = in / 32``) its bytes are
``quants[g, b * B : (b + 1) * B]`` (``B = 16 * bytes a block``: 512 for Q8_0, 256 for Q4_0/Q4_1),
laid as ``[part, row, 4]``: part ``p``'s 64 bytes are four bytes of each row, row by row:

- Q8_0: part ``p`` (0..7) holds each row's quants ``32b + 4p .. 32b + 4p + 3``;
- Q4_0, Q4_1: part ``p`` (0..3) holds each row's packed bytes ``16b + 4p .. 16b + 4p + 3``, whose low
  nibbles are elements ``32b + 4p ..`` and high nibbles ``32b + 16 + 4p ..`` (GGUF's own pairing).

``scales`` (and ``minima``: Q4_1) are uint16 ``[groups, blocks * 16]``: block ``b``'s 16 halves at
``[g, 16b : 16b + 16]``, row by row. Nothing is rounded: the bytes are the file's, moved
(:meth:`InterleavedWeight.to_quantized` moves them back, the tests' way to the reference).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.runtime.model.quant.quantized_weight import BLOCK, BlockArrays, QuantizedWeight

__all__ = ["GROUP", "InterleavedWeight", "interleavable"]

#: Weight rows a group interleaves: a 512-bit vector's int32 lanes.
GROUP = 16
#: Bytes of a row a part holds: a ``vpdpbusd`` lane's four.
PART_BYTES = 4


def _bytes_per_block(ggml_type: str) -> int:
    return BLOCK if ggml_type == "Q8_0" else BLOCK // 2


def interleavable(weight: QuantizedWeight) -> bool:
    """Whether ``weight``'s rows come in whole groups (every matrix of the Llama models we serve)."""
    return weight.shape[0] % GROUP == 0


def _moved(array: np.ndarray, shape: tuple[int, ...], axes: tuple[int, ...], rows: int) -> np.ndarray:
    """``array`` seen as ``shape``, its axes in ``axes`` order, as ``rows`` C-contiguous rows (an
    empty ``minima`` stays empty)."""
    if array.size == 0:
        return np.zeros((rows, 0), array.dtype)
    return np.ascontiguousarray(array.reshape(shape).transpose(axes).reshape(rows, -1))


@dataclass(frozen=True)
class InterleavedWeight(BlockArrays):
    """One ``[out, in]`` quantized weight in the interleaved layout (the module's docstring)."""

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)``: the float matrix this weight stands for."""
        return self.scales.shape[0] * GROUP, self.scales.shape[1] // GROUP * BLOCK

    @classmethod
    def from_quantized(cls, weight: QuantizedWeight) -> InterleavedWeight:
        """``weight``'s bytes interleaved (``interleavable(weight)`` must hold)."""
        if not interleavable(weight):
            raise ValueError(f"{weight.shape[0]} rows are not whole groups of {GROUP}")
        out, inner = weight.shape
        groups, blocks = out // GROUP, inner // BLOCK
        parts = _bytes_per_block(weight.ggml_type) // PART_BYTES
        quants = _moved(weight.quants, (groups, GROUP, blocks, parts, PART_BYTES), (0, 2, 3, 1, 4), groups)
        scales, minima = (_moved(a, (groups, GROUP, blocks), (0, 2, 1), groups) for a in (weight.scales, weight.minima))
        return cls(weight.ggml_type, quants, scales, minima, weight.converted_from)

    def to_quantized(self) -> QuantizedWeight:
        """The row-major :class:`QuantizedWeight` these bytes came from."""
        out, inner = self.shape
        groups, blocks = out // GROUP, inner // BLOCK
        parts = _bytes_per_block(self.ggml_type) // PART_BYTES
        quants = _moved(self.quants, (groups, blocks, parts, GROUP, PART_BYTES), (0, 3, 1, 2, 4), out)
        scales, minima = (_moved(a, (groups, blocks, GROUP), (0, 2, 1), out) for a in (self.scales, self.minima))
        return QuantizedWeight(self.ggml_type, quants, scales, minima, self.converted_from)

    def dequantize(self) -> np.ndarray:
        """The weight as float32 ``[out, in]``: the loader's values (the kernels' reference)."""
        return self.to_quantized().dequantize()
