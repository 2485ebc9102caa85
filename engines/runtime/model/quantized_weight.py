"""A linear layer's weight kept in ggml's block quantization (Q8_0, Q4_0, Q4_1), for the kernels
that read it quantized (``kernels.quantized_matmul``).

GGUF stores each row of a weight as blocks of 32 elements: a block's fp16 scale (Q4_1: and its
fp16 minimum), then its quants. The loader repacks a tensor once into three arrays, the quants of
a row in one contiguous run and its scales (and minima) in another: the same bytes, the same
values, nothing rounded again. Why: in the file a block's quants start 2 (Q8_0, Q4_0) or 4 (Q4_1)
bytes into a 34-, 18- or 20-byte block, so a row's quants are no array a compiled loop can read
in vectors; split, they are, and a block's 32 int8 (or 16 nibble bytes) follow the last block's.

- ``Q8_0``: ``quants`` int8 ``[out, in]``; element k of row n is ``quants[n, k] * scale[n, k // 32]``.
- ``Q4_0``: ``quants`` uint8 ``[out, in // 2]``, block b's 16 bytes at ``[n, 16b : 16b + 16]``; byte j
  holds element ``32b + j`` (low nibble) and ``32b + 16 + j`` (high), each ``(nibble - 8) * scale``.
- ``Q4_1``: the same nibbles, each ``nibble * scale + minimum``.

``scales`` and ``minima`` are uint16 ``[out, in // 32]``, the halves' bits (``minima`` has no columns
but for Q4_1); the kernels widen them through ``gguf.dequantize.half_table``, exactly.
:meth:`QuantizedWeight.dequantize` is the reference every kernel is diffed against: the file's
blocks again (:meth:`to_blocks`) through the loader's own dequantization.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engines.runtime.model.gguf.dequantize import dequantize
from engines.runtime.model.gguf.quant_types import GGML_TYPE_BY_NAME, GGMLType

__all__ = ["BLOCK", "HostWeight", "QUANTIZED_TYPES", "QuantizedWeight"]

#: Elements in one block of every type here.
BLOCK = 32
#: The ggml types a weight can be kept in (the others are dequantized at load).
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1")
# Where a block's parts lie in the file: (scale, minimum or None, first quant byte).
_LAYOUT = {"Q8_0": (0, None, 2), "Q4_0": (0, None, 2), "Q4_1": (0, 2, 4)}


@dataclass(frozen=True)
class QuantizedWeight:
    """One ``[out, in]`` weight in the repacked block layout (the module's docstring)."""

    ggml_type: str
    quants: np.ndarray
    scales: np.ndarray
    minima: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)``: the float matrix this weight stands for."""
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def size(self) -> int:
        """Elements of the float matrix (as ``ndarray.size``: parameter counts)."""
        out, inner = self.shape
        return out * inner

    @property
    def nbytes(self) -> int:
        """The bytes the kernels read: the file's, to the byte."""
        return self.quants.nbytes + self.scales.nbytes + self.minima.nbytes

    @classmethod
    def from_blocks(cls, raw: np.ndarray, ggml_type: GGMLType | str, shape: tuple[int, int]) -> QuantizedWeight:
        """Repack a GGUF tensor's bytes (``uint8``, ``shape`` ``[out, in]`` with ``in`` a multiple of 32)
        of ``ggml_type`` (or its name)."""
        if isinstance(ggml_type, str):
            ggml_type = GGML_TYPE_BY_NAME[ggml_type]
        if ggml_type.name not in QUANTIZED_TYPES:
            raise ValueError(f"{ggml_type.name} is not kept quantized: one of {', '.join(QUANTIZED_TYPES)} is")
        out, inner = shape
        if inner % BLOCK:
            raise ValueError(f"a row of {inner} elements is not whole blocks of {BLOCK}")
        blocks = np.asarray(raw, np.uint8).reshape(out, inner // BLOCK, ggml_type.block_bytes)
        scale_at, minimum_at, quants_at = _LAYOUT[ggml_type.name]

        def halves(at: int) -> np.ndarray:
            return np.ascontiguousarray(blocks[:, :, at:at + 2]).view("<u2").reshape(out, inner // BLOCK)

        quants = np.ascontiguousarray(blocks[:, :, quants_at:]).reshape(out, -1)
        if ggml_type.name == "Q8_0":
            quants = quants.view(np.int8)
        minima = halves(minimum_at) if minimum_at is not None else np.zeros((out, 0), np.uint16)
        return cls(ggml_type.name, quants, halves(scale_at), minima)

    def to_blocks(self) -> np.ndarray:
        """The GGUF bytes this weight was repacked from (``uint8``, flat)."""
        out, inner = self.shape
        kind = GGML_TYPE_BY_NAME[self.ggml_type]
        blocks = np.empty((out, inner // BLOCK, kind.block_bytes), np.uint8)
        scale_at, minimum_at, quants_at = _LAYOUT[self.ggml_type]
        blocks[:, :, scale_at:scale_at + 2] = self.scales.astype("<u2").view(np.uint8).reshape(out, -1, 2)
        if minimum_at is not None:
            blocks[:, :, minimum_at:minimum_at + 2] = self.minima.astype("<u2").view(np.uint8).reshape(out, -1, 2)
        blocks[:, :, quants_at:] = self.quants.view(np.uint8).reshape(out, inner // BLOCK, -1)
        return blocks.reshape(-1)

    def dequantize(self) -> np.ndarray:
        """float32 ``[out, in]``: the reference for the kernels (the loader's dequantization)."""
        return dequantize(self.to_blocks(), GGML_TYPE_BY_NAME[self.ggml_type], self.shape)

    def rows(self, index: np.ndarray | slice) -> QuantizedWeight:
        """The weight of rows ``index`` (whole rows move with their blocks: the loader's row
        permutations and splits)."""
        return QuantizedWeight(self.ggml_type, np.ascontiguousarray(self.quants[index]),
                               np.ascontiguousarray(self.scales[index]), np.ascontiguousarray(self.minima[index]))

    @staticmethod
    def concatenate(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one type, one after the other (q/k/v, gate/up fused)."""
        kinds = {p.ggml_type for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse weights of types {sorted(kinds)} into one")
        return QuantizedWeight(kinds.pop(), *(np.concatenate([getattr(p, name) for p in parts])
                                              for name in ("quants", "scales", "minima")))


#: A weight as loaded into host memory: a float array, or a matrix kept quantized.
HostWeight = np.ndarray | QuantizedWeight
