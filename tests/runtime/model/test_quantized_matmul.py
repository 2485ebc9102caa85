"""Weights kept quantized (Q8_0, Q4_0, Q4_1): the repacked layout against the file's blocks, and
every kernel that reads it against the plain path, the weight dequantized by the loader then a
float32 product (``quantized_matmul_reference``); the CUDA twin against the CPU kernel (tiny shapes
under the simulator, real ones with ``ENGINES_TEST_GPU=1``)."""
from __future__ import annotations

import os
import zlib
from typing import Callable

import gguf
import numpy as np
import pytest
from numba import cuda

from engines.runtime.model.quant.dequantize import dequantize, half_table
from engines.runtime.model.quant.quant_types import GGML_TYPE_BY_NAME
from engines.runtime.model.kernels import matmul, quantized_dot, quantized_matmul
from engines.runtime.model.quant.quantized_weight import BLOCK, QUANTIZED_TYPES, QuantizedWeight

REAL_GPU = os.environ.get("ENGINES_TEST_GPU") == "1"


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def file_blocks(rng: np.random.Generator, ggml_type: str, out: int, inner: int) -> np.ndarray:
    """A tensor's bytes as a GGUF file holds them: random quants, random (finite) fp16 scales and minima."""
    kind = GGML_TYPE_BY_NAME[ggml_type]
    blocks = rng.integers(0, 256, size=(out, inner // BLOCK, kind.block_bytes), dtype=np.uint8)
    halves = 2 if ggml_type == "Q4_1" else 1
    values = rng.uniform(-0.05, 0.05, size=(out, inner // BLOCK, halves)).astype("<f2")
    blocks[:, :, :2 * halves] = values.view(np.uint8).reshape(out, inner // BLOCK, 2 * halves)
    return blocks.reshape(-1)


def weight(rng: np.random.Generator, ggml_type: str, out: int, inner: int) -> QuantizedWeight:
    return QuantizedWeight.from_blocks(file_blocks(rng, ggml_type, out, inner), GGML_TYPE_BY_NAME[ggml_type],
                                       (out, inner))


def close_to_reference(got: np.ndarray, x: np.ndarray, w: QuantizedWeight, bias: np.ndarray,
                       reference: Callable = quantized_matmul.quantized_matmul_reference) -> None:
    """``got`` within float32 rounding of the plain path, element by element (the bound scales with
    the sum of the products' magnitudes, which is what reassociated float32 sums may lose)."""
    want = reference(x, w, bias)
    bound = 2e-6 * (np.abs(x) @ np.abs(w.dequantize()).T) + 1e-6
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()


@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_repacked_weight_holds_the_files_bytes_and_values(rng: np.random.Generator, ggml_type: str) -> None:
    raw = file_blocks(rng, ggml_type, 6, 96)
    w = QuantizedWeight.from_blocks(raw, GGML_TYPE_BY_NAME[ggml_type], (6, 96))
    assert w.shape == (6, 96) and w.nbytes == raw.nbytes
    assert np.array_equal(w.to_blocks(), raw)
    # The gguf package (ggml's reference in numpy) reads the file's bytes to the same values.
    expected = gguf.quants.dequantize(raw.reshape(6, -1), gguf.GGMLQuantizationType[ggml_type])
    assert np.array_equal(w.dequantize(), expected)


@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_the_layout_is_the_one_documented(rng: np.random.Generator, ggml_type: str) -> None:
    """Element k of row n from the repacked arrays by the module's formulas, in numpy."""
    w = weight(rng, ggml_type, 3, 64)
    scale = np.repeat(w.scales.view("<f2").astype(np.float32), BLOCK, axis=1)
    if ggml_type == "Q8_0":
        values = w.quants.astype(np.float32) * scale
    else:
        nibbles = w.quants.reshape(3, -1, 16)
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=2).reshape(3, 64).astype(np.float32)
        if ggml_type == "Q4_0":
            values = (q - 8) * scale
        else:
            values = q * scale + np.repeat(w.minima.view("<f2").astype(np.float32), BLOCK, axis=1)
    assert np.array_equal(values, w.dequantize())


def test_rows_and_fusion_move_whole_rows(rng: np.random.Generator) -> None:
    a, b = weight(rng, "Q4_1", 5, 64), weight(rng, "Q4_1", 3, 64)
    order = np.array([4, 0, 2, 1, 3])
    assert np.array_equal(a.rows(order).dequantize(), a.dequantize()[order])
    fused = QuantizedWeight.concatenate([a, b])
    assert np.array_equal(fused.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    assert QuantizedWeight.concatenate([a, weight(rng, "Q8_0", 2, 64)]).ggml_type == "Q8_0"  # several types
    with pytest.raises(ValueError, match="not kept quantized"):
        QuantizedWeight.from_blocks(np.zeros(64, np.uint8), GGML_TYPE_BY_NAME["Q6_K"], (1, 256))


@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_dequantized_rows_are_the_loaders_values_exactly(rng: np.random.Generator, ggml_type: str) -> None:
    w = weight(rng, ggml_type, 9, 128)
    out = np.empty((4, 128), np.float32)
    quantized_matmul.dequantize_rows_cpu(w.quants, w.scales, w.minima, half_table(), 3, out)
    assert np.array_equal(out, w.dequantize()[3:7])


@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
@pytest.mark.parametrize("four_row_blocks", [True, False])
def test_rows_kernel_against_the_reference(rng: np.random.Generator, ggml_type: str, four_row_blocks: bool) -> None:
    """Every row count a decode step has, columns not a multiple of four (the last columns' loop),
    with and without a bias."""
    w = weight(rng, ggml_type, 4 * 9 + 3, 160)
    bias = rng.standard_normal(w.shape[0]).astype(np.float32)
    for rows, chunks in zip((1, 2, 3, 4, 5, 7, 8, 9, 16, 31, matmul.CPU_ROWS_KERNEL_MAX_ROWS),
                            (1, 2, 3, 9, 100, 1, 4, 5, 6, 7, 8), strict=True):  # one part to more than blocks
        x = rng.standard_normal((rows, 160)).astype(np.float32)
        for b in (bias, np.zeros(0, np.float32)):
            out = np.full((rows, w.shape[0]), np.nan, np.float32)
            quantized_matmul.quantized_matmul_rows_cpu(x, w.quants, w.scales, w.minima, half_table(), b, out,
                                                       chunks, four_row_blocks)
            close_to_reference(out, x, w, b)


@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
@pytest.mark.parametrize("rows", [1, matmul.CPU_ROWS_KERNEL_MAX_ROWS, matmul.CPU_ROWS_KERNEL_MAX_ROWS + 13])
def test_cpu_paths_against_the_reference(rng: np.random.Generator, ggml_type: str, rows: int) -> None:
    """``quantized_matmul_cpu``: a decode step's rows through the int8-activation kernel
    (``quantized_dot``), more rows through sgemm on dequantized panels (more columns than one
    panel, the last one partial), each against its plain path."""
    w = weight(rng, ggml_type, quantized_matmul.panel_rows(96) + 37, 96)
    bias = rng.standard_normal(w.shape[0]).astype(np.float32)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    out = np.full((rows, w.shape[0]), np.nan, np.float32)
    quantized_matmul.quantized_matmul_cpu(x, w, bias, out)
    decode = rows <= matmul.CPU_ROWS_KERNEL_MAX_ROWS
    close_to_reference(out, x, w, bias, quantized_dot.quantized_dot_reference if decode else
                       quantized_matmul.quantized_matmul_reference)


@pytest.mark.usefixtures("quick_simulator_barriers")
@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_cuda_gemv_against_its_cpu_twin(rng: np.random.Generator, ggml_type: str) -> None:
    """Rows past one block's ``GEMV_ROWS`` (a second row of blocks, partly filled), columns past
    the last warp, a bias; outputs poisoned with NaN so that an element never written fails."""
    out_features, inner, rows = (4096, 4096, 11) if REAL_GPU else (7, 64, 11)
    w = weight(rng, ggml_type, out_features, inner)
    bias = rng.standard_normal(out_features).astype(np.float32)
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    warps = 4 if REAL_GPU else 2
    got = cuda.to_device(np.full((rows, out_features), np.nan, np.float32))
    grid = (-(-out_features // warps), -(-rows // quantized_matmul.GEMV_ROWS))
    quantized_matmul.quantized_gemv_cuda[grid, (quantized_matmul.WARP, warps)](
        cuda.to_device(x), cuda.to_device(w.quants), cuda.to_device(w.scales), cuda.to_device(w.minima),
        cuda.to_device(half_table()), cuda.to_device(bias), got)
    twin = np.empty((rows, out_features), np.float32)
    quantized_matmul.quantized_matmul_rows_cpu(x, w.quants, w.scales, w.minima, half_table(), bias, twin,
                                               quantized_matmul.rows_kernel_chunks())
    np.testing.assert_allclose(got.copy_to_host(), twin, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("quick_simulator_barriers")
@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_cuda_embedding_against_its_cpu_twin(rng: np.random.Generator, ggml_type: str) -> None:
    """Rows gathered twice and out of order, a row past the last block of threads; the loader's
    values (the CPU twin's are exact; a GPU may fuse Q4_1's product and sum)."""
    vocab, inner = (4096, 4096) if REAL_GPU else (9, 64)
    w = weight(rng, ggml_type, vocab, inner)
    ids = np.array([vocab - 1, 0, 3, 3], np.int32)
    threads = 128 if REAL_GPU else 8
    got = cuda.to_device(np.full((ids.size, inner), np.nan, np.float32))
    quantized_matmul.quantized_embedding_cuda[(ids.size, -(-inner // threads)), (threads,)](
        cuda.to_device(ids), cuda.to_device(w.quants), cuda.to_device(w.scales), cuda.to_device(w.minima),
        cuda.to_device(half_table()), got)
    twin = np.empty((ids.size, inner), np.float32)
    quantized_matmul.quantized_embedding_cpu(ids, w.quants, w.scales, w.minima, half_table(), twin)
    np.testing.assert_array_equal(twin, w.dequantize()[ids])
    np.testing.assert_allclose(got.copy_to_host(), twin, rtol=1e-6, atol=1e-7)


def k_quant_blocks(rng: np.random.Generator, ggml_type: str, out: int, inner: int) -> np.ndarray:
    """A K-quant tensor's bytes: random quants and scale bytes, finite small fp16 super-block scales
    (Q4_K: d and dmin first; Q6_K: d last)."""
    kind = GGML_TYPE_BY_NAME[ggml_type]
    blocks = rng.integers(0, 256, size=(out, inner // 256, kind.block_bytes), dtype=np.uint8)
    if ggml_type == "Q4_K":
        blocks[:, :, 0:4] = rng.uniform(0.0, 0.002, size=(out, inner // 256, 2)).astype("<f2").view(np.uint8)
    else:
        blocks[:, :, -2:] = rng.uniform(0.0, 0.002, size=(out, inner // 256, 1)).astype("<f2").view(np.uint8)
    return blocks.reshape(-1)


def test_q4_k_becomes_q4_1_with_only_its_scales_rounded(rng: np.random.Generator) -> None:
    """Each Q4_K sub-block is a Q4_1 block: the nibbles are the file's, the scale ``d * sc`` and
    minimum ``-dmin * m`` rounded to halves (11 bits): every value within that rounding of the
    loader's dequantization of the file."""
    raw = k_quant_blocks(rng, "Q4_K", 6, 512)
    converted = QuantizedWeight.from_file(raw, GGML_TYPE_BY_NAME["Q4_K"], (6, 512))
    assert converted.ggml_type == "Q4_1" and converted.converted_from == "Q4_K" and converted.source_type == "Q4_K"
    assert converted.nbytes == 6 * 512 // 32 * 20  # 5 bits a weight (the file: 4.5)
    want = dequantize(raw, GGML_TYPE_BY_NAME["Q4_K"], (6, 512))
    got = converted.dequantize()
    scale_bound = np.repeat(np.abs(got.reshape(6, 16, 32)).max(axis=2), 32, axis=1) * 2.0 ** -10
    assert (np.abs(got - want) <= scale_bound + 1e-9).all()
    # (A nibble out of place would be off by a multiple of a whole scale.)


def test_q5_0_becomes_q8_0_exactly(rng: np.random.Generator) -> None:
    """``(q - 16) * d``: an int8 with Q5_0's own scale (llama.cpp's fallback for rows of 576, not
    whole super-blocks, in a Q4_K_M file)."""
    values = rng.standard_normal((5, 512)).astype(np.float32)
    values[0, :32] = 0.0  # a zero scale
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q5_0).reshape(-1)
    converted = QuantizedWeight.from_file(raw, GGML_TYPE_BY_NAME["Q5_0"], (5, 512))
    assert converted.ggml_type == "Q8_0" and converted.converted_from == "Q5_0"
    assert np.array_equal(converted.dequantize(), dequantize(raw, GGML_TYPE_BY_NAME["Q5_0"], (5, 512)))


@pytest.mark.parametrize("ggml_type", ["Q6_K", "Q5_1"])
def test_other_block_types_become_q8_0(rng: np.random.Generator, ggml_type: str) -> None:
    """Quantized again from their values, as ggml quantizes Q8_0: within half a Q8_0 step of the
    file's values, and what the half's rounding of the step costs at up to 127 steps; the same bytes
    ggml's quantizer writes."""
    kind = GGML_TYPE_BY_NAME[ggml_type]
    if ggml_type == "Q6_K":
        raw = k_quant_blocks(rng, ggml_type, 5, 512)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((5, 512)).astype(np.float32),
                                   gguf.GGMLQuantizationType[ggml_type]).reshape(-1)  # Q5_1: with a minimum
    converted = QuantizedWeight.from_file(raw, kind, (5, 512))
    assert converted.ggml_type == "Q8_0" and converted.converted_from == ggml_type
    values = dequantize(raw, kind, (5, 512))
    step = np.repeat(np.abs(values.reshape(5, 16, 32)).max(axis=2) / 127, 32, axis=1)
    assert (np.abs(converted.dequantize() - values) <= (0.5 + 127 * 2.0 ** -11) * step).all()
    ggml = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0).reshape(-1)
    assert np.array_equal(converted.to_blocks(), ggml)


def test_weights_of_several_types_fuse_as_q8_0(rng: np.random.Generator) -> None:
    """A Q4_K_M file's q/k (Q4_K, held as Q4_1) with its v (Q6_K, held as Q8_0): one Q8_0 matrix."""
    q = QuantizedWeight.from_file(k_quant_blocks(rng, "Q4_K", 4, 256), GGML_TYPE_BY_NAME["Q4_K"], (4, 256))
    v = QuantizedWeight.from_file(k_quant_blocks(rng, "Q6_K", 2, 256), GGML_TYPE_BY_NAME["Q6_K"], (2, 256))
    fused = QuantizedWeight.concatenate([q, v])
    assert fused.ggml_type == "Q8_0" and fused.shape == (6, 256) and fused.converted_from == "Q4_K+Q6_K"
    want = np.concatenate([q.dequantize(), v.dequantize()])
    step = np.repeat(np.abs(want.reshape(6, 8, 32)).max(axis=2) / 127, 32, axis=1)
    assert (np.abs(fused.dequantize() - want) <= (0.5 + 127 * 2.0 ** -11) * step + 1e-9).all()
