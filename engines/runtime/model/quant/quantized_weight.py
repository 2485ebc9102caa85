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
but for Q4_1); the kernels widen them through ``dequantize.half_table``, exactly.
:meth:`QuantizedWeight.dequantize` is the reference every kernel is diffed against: the file's
blocks again (:meth:`to_blocks`) through the loader's own dequantization.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engines.runtime.model.quant.dequantize import dequantize
from engines.runtime.model.quant.quant_types import GGML_TYPE_BY_NAME, GGMLType

__all__ = ["BLOCK", "BlockArrays", "CONVERTED_TYPES", "HostWeight", "QUANTIZED_TYPES", "QuantizedWeight"]

#: Elements in one block of every type here.
BLOCK = 32
#: The ggml types a weight can be kept in (the others are dequantized at load).
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1")
#: The file's block types the loader converts to one of those (:meth:`QuantizedWeight.from_file`).
CONVERTED_TYPES = ("Q4_K", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K")
# Where a block's parts lie in the file: (scale, minimum or None, first quant byte).
_LAYOUT = {"Q8_0": (0, None, 2), "Q4_0": (0, None, 2), "Q4_1": (0, 2, 4)}


@dataclass(frozen=True)
class BlockArrays:
    """A quantized ``[out, in]`` weight's three arrays, in the row-major layout of the module's
    docstring unless a subclass says otherwise (``interleaved_weight`` does): the parts every
    layout shares."""

    ggml_type: str
    quants: np.ndarray
    scales: np.ndarray
    minima: np.ndarray
    #: The file's type where the loader converted the tensor (:meth:`QuantizedWeight.from_file`), else "".
    converted_from: str = ""

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


@dataclass(frozen=True)
class QuantizedWeight(BlockArrays):
    """One ``[out, in]`` weight in the repacked block layout (the module's docstring)."""

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

    @classmethod
    def from_file(cls, raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, int]) -> QuantizedWeight:
        """A GGUF matrix of any block type in one the kernels read: Q8_0, Q4_0 and Q4_1 as they are
        (:meth:`from_blocks`); Q4_K as Q4_1 (:meth:`from_q4_k`: its sub-blocks are Q4_1's blocks,
        their scales rounded to fp16); Q5_0 as Q8_0 exactly (its ``(q - 16) * d`` fits an int8 with
        the same scale); every other block type (Q5_1, Q6_K, Q2_K, Q3_K, Q5_K) dequantized and
        quantized again to Q8_0 (:meth:`quantize_q8_0`). Q8_0 holds 8.5 bits a weight: more than
        those files' 5.5-6.6, what an integer dot of one kind for all of them costs."""
        if ggml_type.name in QUANTIZED_TYPES:
            return cls.from_blocks(raw, ggml_type, shape)
        if ggml_type.name == "Q4_K":
            return cls.from_q4_k(raw, shape)
        if ggml_type.name not in CONVERTED_TYPES:
            raise ValueError(f"{ggml_type.name} is not a block type the kernels read or convert")
        values = dequantize(raw, ggml_type, shape)
        if ggml_type.name == "Q5_0":  # (q - 16) * d: a Q8_0 block with the same scale, exactly
            out, inner = shape
            halves = np.asarray(raw, np.uint8).reshape(out, inner // BLOCK, ggml_type.block_bytes)[:, :, 0:2]
            scales = np.ascontiguousarray(halves).view("<u2").reshape(out, inner // BLOCK)
            d = scales.view(np.float16).astype(np.float32)
            with np.errstate(divide="ignore", invalid="ignore"):
                quants = np.rint(values.reshape(out, inner // BLOCK, BLOCK) / d[:, :, None])
            quants = np.where(d[:, :, None] != 0, quants, 0).astype(np.int8).reshape(out, inner)
            return cls("Q8_0", quants, scales, np.zeros((out, 0), np.uint16), "Q5_0")
        return cls.quantize_q8_0(values, converted_from=ggml_type.name)

    @classmethod
    def from_q4_k(cls, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
        """A Q4_K tensor as Q4_1. A Q4_K super-block holds eight sub-blocks of 32 nibbles, each
        ``nibble * (d * sc) - dmin * m`` (6-bit ``sc`` and ``m``): a Q4_1 block with scale ``d * sc``
        and minimum ``-dmin * m``, which Q4_1 stores as halves (rounded once, to 11 bits; the
        nibbles are the file's). The nibbles move from Q4_K's order (a 32-byte chunk's low nibbles
        are one sub-block, its high nibbles the next) to Q4_1's (byte j: elements j and j + 16)."""
        out, inner = shape
        if inner % 256:
            raise ValueError(f"a Q4_K row of {inner} elements is not whole super-blocks of 256")
        blocks = np.asarray(raw, np.uint8).reshape(out, inner // 256, 144)
        d = blocks[:, :, 0:2].copy().view("<f2").astype(np.float32)  # [out, supers, 1]
        dmin = blocks[:, :, 2:4].copy().view("<f2").astype(np.float32)
        packed = blocks[:, :, 4:16].astype(np.int32)  # ggml's get_scale_min_k4, all eight sub-blocks
        low_scales = np.concatenate([packed[:, :, 0:4] & 63,
                                     (packed[:, :, 8:12] & 15) | ((packed[:, :, 0:4] >> 6) << 4)], axis=2)
        low_minima = np.concatenate([packed[:, :, 4:8] & 63,
                                     (packed[:, :, 8:12] >> 4) | ((packed[:, :, 4:8] >> 6) << 4)], axis=2)
        scales = (d * low_scales.astype(np.float32)).astype(np.float16)
        minima = (-(dmin * low_minima.astype(np.float32))).astype(np.float16)
        chunks = blocks[:, :, 16:].reshape(out, inner // 256, 4, 32)
        nibbles = np.stack([chunks & 15, chunks >> 4], axis=3).reshape(out, inner // BLOCK, BLOCK)
        quants = (nibbles[:, :, :16] | (nibbles[:, :, 16:] << 4)).reshape(out, inner // 2)
        if not (np.isfinite(scales).all() and np.isfinite(minima).all()):  # beyond a half's range
            values = dequantize(np.asarray(raw, np.uint8).reshape(-1), GGML_TYPE_BY_NAME["Q4_K"], shape)
            return cls.quantize_q8_0(values, converted_from="Q4_K")
        return cls("Q4_1", np.ascontiguousarray(quants, np.uint8), scales.reshape(out, -1).view(np.uint16),
                   minima.reshape(out, -1).view(np.uint16), "Q4_K")

    @classmethod
    def quantize_q8_0(cls, values: np.ndarray, converted_from: str = "") -> QuantizedWeight:
        """float ``[out, in]`` values as Q8_0, as ggml's ``quantize_row_q8_0_ref`` does: per block of 32,
        ``d = max|v| / 127`` stored as a half, each ``round(v / d)`` (halves away from zero)."""
        out, inner = values.shape
        if inner % BLOCK:
            raise ValueError(f"a row of {inner} elements is not whole blocks of {BLOCK}")
        blocks = values.astype(np.float32).reshape(out, inner // BLOCK, BLOCK)
        d = np.abs(blocks).max(axis=2) / np.float32(127.0)
        with np.errstate(divide="ignore"):
            inverse = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
        scaled = blocks * inverse[:, :, None]
        quants = np.clip(np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5)), -127, 127).astype(np.int8)
        return cls("Q8_0", quants.reshape(out, inner), d.astype(np.float16).view(np.uint16),
                   np.zeros((out, 0), np.uint16), converted_from)

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
                               np.ascontiguousarray(self.scales[index]), np.ascontiguousarray(self.minima[index]),
                               self.converted_from)

    @staticmethod
    def concatenate(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights, one after the other (q/k/v, gate/up fused); of several types, as
        Q8_0 (the others quantized again from their values: a Q4_K_M file's Q6_K v with its Q4_K q and k)."""
        if len({p.ggml_type for p in parts}) > 1:
            parts = [p if p.ggml_type == "Q8_0" else QuantizedWeight.quantize_q8_0(p.dequantize(), p.source_type)
                     for p in parts]
        sources = sorted({p.converted_from for p in parts if p.converted_from})
        quants, scales, minima = (np.concatenate([getattr(p, name) for p in parts])
                                  for name in ("quants", "scales", "minima"))
        return QuantizedWeight(parts[0].ggml_type, quants, scales, minima, "+".join(sources))

    @property
    def source_type(self) -> str:
        """The file's type of this weight: ``converted_from``, or the type it is held in."""
        return self.converted_from or self.ggml_type


#: A weight as loaded into host memory: a float array, or a matrix kept quantized.
HostWeight = np.ndarray | QuantizedWeight
