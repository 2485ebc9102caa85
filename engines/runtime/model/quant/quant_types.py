"""ggml's tensor types: their ids, block sizes, and which of them this engine can dequantize.

Every ggml type stores a row as whole blocks of ``block_elements`` values in ``block_bytes``
bytes (a plain float type is a "block" of one). The ids and sizes are ggml's (``ggml.h``,
``ggml-common.h``); the types this engine reads are :data:`.dequantize.DEQUANTIZABLE`.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GGMLType", "GGML_TYPES", "GGML_TYPE_BY_NAME"]


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type."""

    id: int
    name: str
    block_elements: int
    block_bytes: int


_ALL = (
    GGMLType(0, "F32", 1, 4), GGMLType(1, "F16", 1, 2), GGMLType(2, "Q4_0", 32, 18), GGMLType(3, "Q4_1", 32, 20),
    GGMLType(6, "Q5_0", 32, 22), GGMLType(7, "Q5_1", 32, 24), GGMLType(8, "Q8_0", 32, 34),
    GGMLType(9, "Q8_1", 32, 36), GGMLType(10, "Q2_K", 256, 84), GGMLType(11, "Q3_K", 256, 110),
    GGMLType(12, "Q4_K", 256, 144), GGMLType(13, "Q5_K", 256, 176), GGMLType(14, "Q6_K", 256, 210),
    GGMLType(15, "Q8_K", 256, 292), GGMLType(16, "IQ2_XXS", 256, 66), GGMLType(17, "IQ2_XS", 256, 74),
    GGMLType(18, "IQ3_XXS", 256, 98), GGMLType(19, "IQ1_S", 256, 50), GGMLType(20, "IQ4_NL", 32, 18),
    GGMLType(21, "IQ3_S", 256, 110), GGMLType(22, "IQ2_S", 256, 82), GGMLType(23, "IQ4_XS", 256, 136),
    GGMLType(24, "I8", 1, 1), GGMLType(25, "I16", 1, 2), GGMLType(26, "I32", 1, 4), GGMLType(27, "I64", 1, 8),
    GGMLType(28, "F64", 1, 8), GGMLType(29, "IQ1_M", 256, 56), GGMLType(30, "BF16", 1, 2),
    GGMLType(34, "TQ1_0", 256, 54), GGMLType(35, "TQ2_0", 256, 66), GGMLType(39, "MXFP4", 32, 17),
)

#: Every type ggml defines (that a file may name), by id.
GGML_TYPES: dict[int, GGMLType] = {t.id: t for t in _ALL}
GGML_TYPE_BY_NAME: dict[str, GGMLType] = {t.name: t for t in _ALL}

