"""The int8-activation kernel of quantized weights (``kernels.quantized_dot``): the activations'
quantization against its numpy twin, every row-dot implementation this CPU runs (AVX-512 VNNI,
AVX2, the plain loops) against the plain one, and the decode kernel against the plain path (the
activations quantized and dequantized again, the weight dequantized by the loader, a float64
product), at the shapes SmolLM2's decode reads."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from llvmlite import binding
from numba import njit

from engines.runtime.model.quant.dequantize import half_table
from engines.runtime.model.kernels import matmul, quantized_dot
from engines.runtime.model.quant.quantized_weight import BLOCK, QUANTIZED_TYPES, QuantizedWeight
from tests.runtime.model.test_quantized_matmul import weight


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def quantized(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows, inner = x.shape
    xq = np.empty((rows, inner), np.int8)
    xd, xs = (np.empty((rows, inner // BLOCK), np.float32) for _ in range(2))
    quantized_dot.quantize_activations_cpu(x, xq, xd, xs)
    return xq, xd, xs


def test_activations_quantize_as_the_numpy_twin_does(rng: np.random.Generator) -> None:
    """Blocks of every scale, a block of zeros, exact halves (rounded away from zero), and each
    block's largest magnitude at +-127."""
    x = (rng.standard_normal((5, 8 * BLOCK)) * 10.0 ** rng.integers(-6, 4, (5, 8 * BLOCK))).astype(np.float32)
    x[1, :BLOCK] = 0.0
    x[2, BLOCK:2 * BLOCK] = np.arange(BLOCK, dtype=np.float32) - 15.5  # amax 15.5: x/d = k * 127/15.5
    x[3, 2 * BLOCK:3 * BLOCK] = np.float32(127.0)
    x[3, 2 * BLOCK + 1] = np.float32(-0.5)  # exactly half a step: -1, away from zero
    got, want = quantized(x), quantized_dot.quantize_activations_reference(x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    xq, xd, xs = got
    assert xq[3, 2 * BLOCK + 1] == -1 and (xq[1, :BLOCK] == 0).all() and xd[1, 0] == 0.0
    blocks = np.abs(xq.astype(np.int32)).reshape(5, 8, BLOCK)
    assert (blocks.max(axis=2)[xd > 0] == 127).all()
    np.testing.assert_allclose(xs, xd * xq.reshape(5, 8, BLOCK).astype(np.float32).sum(axis=2), rtol=1e-6)
    # What the rounding costs: at most half a step a value.
    back = xq.reshape(5, 8, BLOCK) * xd[:, :, None]
    assert (np.abs(back - x.reshape(5, 8, BLOCK)) <= 0.5001 * xd[:, :, None]).all()


def extreme_weight(rng: np.random.Generator, ggml_type: str, out: int, inner: int) -> QuantizedWeight:
    """Random blocks with the extremes set: Q8_0's -128 and 127 (|-128| wraps to 128 as a byte),
    nibbles 0 and 15."""
    w = weight(rng, ggml_type, out, inner)
    if ggml_type == "Q8_0":
        w.quants[0, :BLOCK] = -128
        w.quants[1, :BLOCK] = 127
    else:
        w.quants[0, :BLOCK // 2] = 0xFF
        w.quants[1, :BLOCK // 2] = 0x00
    return w


@pytest.mark.parametrize("isa", quantized_dot.available_isas())
@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_every_row_dot_against_the_plain_one(rng: np.random.Generator, isa: str, ggml_type: str) -> None:
    """SmolLM2's two row lengths (576, 1536), activations at the extremes (-127 against Q8_0's -128),
    both the four-row and the one-row dots; outputs poisoned with NaN."""
    for inner in (576, 1536):
        w = extreme_weight(rng, ggml_type, 11, inner)
        x = rng.standard_normal((6, inner)).astype(np.float32)  # four rows at a time, then one
        x[0, :BLOCK] = x[5, :BLOCK] = -1.0  # every xq -127
        xq, xd, xs = quantized(x)
        got, want = (np.full((6, 11), np.nan, np.float32) for _ in range(2))
        quantized_dot.row_dots(isa, ggml_type)(w.quants, w.scales, w.minima, half_table(), xq, xd, xs, got)
        quantized_dot.row_dots("plain", ggml_type)(w.quants, w.scales, w.minima, half_table(), xq, xd, xs, want)
        bound = 2e-6 * (np.abs(xq * np.repeat(xd, BLOCK, axis=1)) @ np.abs(w.dequantize()).T) + 1e-7
        assert (np.abs(got - want) <= bound).all(), (isa, inner, np.abs(got - want).max())


@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_the_decode_kernel_against_the_plain_path(rng: np.random.Generator, ggml_type: str) -> None:
    """Every row count a decode step has, in more parts than weight rows and in one, with and
    without a bias, outputs poisoned with NaN; and against float32 activations, the error the
    activations' rounding costs (under 2% of the products' magnitudes)."""
    w = extreme_weight(rng, ggml_type, 37, 576)
    bias = rng.standard_normal(w.shape[0]).astype(np.float32)
    for rows, chunks in ((1, 1), (2, 5), (4, 100), (8, 3), (matmul.CPU_ROWS_KERNEL_MAX_ROWS, 8)):
        x = rng.standard_normal((rows, 576)).astype(np.float32)
        for b in (bias, np.zeros(0, np.float32)):
            out = np.full((rows, w.shape[0]), np.nan, np.float32)
            quantized_dot.quantized_dot_rows_cpu(x, w.quants, w.scales, w.minima, half_table(), b, out, chunks)
            magnitude = np.abs(x) @ np.abs(w.dequantize()).T
            assert (np.abs(out - quantized_dot.quantized_dot_reference(x, w, b)) <= 2e-6 * magnitude + 1e-6).all()
            exact = x.astype(np.float64) @ w.dequantize().astype(np.float64).T + (b if b.shape[0] else 0.0)
            assert (np.abs(out - exact) <= 0.02 * magnitude).all()


def test_the_kernel_runs_the_cpus_integer_dot_instructions() -> None:
    """On a CPU with AVX-512 VNNI the compiled kernel holds ``vpdpbusd``; with AVX2 alone,
    ``vpmaddubsw``: the IR row dots are what runs, not the plain loops."""
    features = binding.get_host_cpu_features()
    assert quantized_dot.ISA == quantized_dot.available_isas()[0]
    if features.get("avx512vnni") and features.get("avx512vl"):
        assert quantized_dot.ISA == "vnni"
    elif features.get("avx2"):
        assert quantized_dot.ISA == "avx2"
    # A copy compiled here: numba's cache keeps no assembly to inspect.
    kernel = njit(parallel=True, error_model="numpy")(quantized_dot.quantized_dot_rows_cpu.py_func)
    w = weight(np.random.default_rng(0), "Q4_1", 4, 64)
    kernel(np.ones((5, 64), np.float32), w.quants, w.scales, w.minima, half_table(), np.zeros(0, np.float32),
           np.empty((5, 4), np.float32), 1)
    assembly = "".join(kernel.inspect_asm().values())
    instruction = {"vnni": "vpdpbusd", "avx2": "vpmaddubsw", "plain": None}[quantized_dot.ISA]
    if instruction is not None:
        assert instruction in assembly
