"""Quantized weights interleaved in groups of 16 rows (``interleaved_weight``) and the integer dots
that read them (``kernels.interleaved_dot``): the layout moves the file's bytes and back, every
group-dot implementation this CPU runs (AVX-512 VNNI, AVX2, the plain loops) against the plain one,
the kernel at every row count a step has (decode and prefill tiles) against the plain path
(activations quantized and dequantized again, the weight dequantized by the loader, float64), the
embedding's rows exactly, and the CPU backend keeping and reading a quantized model so."""
from __future__ import annotations

import zlib
from typing import Callable

import numba
import numpy as np
import pytest

from engines.runtime.model.backend import CpuBackend
from engines.runtime.model.quant.dequantize import half_table
from engines.runtime.model.quant.interleaved_weight import GROUP, PART_BYTES, InterleavedWeight, interleavable
from engines.runtime.model.kernels import interleaved_dot, quantized_dot
from engines.runtime.model.quant.quantized_weight import BLOCK, QUANTIZED_TYPES, QuantizedWeight
from tests.runtime.model.test_quantized_dot import extreme_weight, quantized


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_the_layout_moves_the_files_bytes_and_back(rng: np.random.Generator, ggml_type: str) -> None:
    w = extreme_weight(rng, ggml_type, 3 * GROUP, 4 * BLOCK)
    inter = InterleavedWeight.from_quantized(w)
    assert inter.shape == w.shape and inter.nbytes == w.nbytes and inter.ggml_type == ggml_type
    back = inter.to_quantized()
    for a, b in ((w.quants, back.quants), (w.scales, back.scales), (w.minima, back.minima)):
        np.testing.assert_array_equal(a, b)
    # Row 16g + 5's block 2 scale is the group's lane 5 of block 2; its first four bytes are part 0's lane 5.
    assert inter.scales[1, GROUP * 2 + 5] == w.scales[GROUP + 5, 2]
    per_block = inter.quants.shape[1] // 4
    bytes_per_block = BLOCK if ggml_type == "Q8_0" else BLOCK // 2
    np.testing.assert_array_equal(inter.quants[1, 2 * per_block + 4 * 5: 2 * per_block + 4 * 5 + 4],
                                  w.quants[GROUP + 5, 2 * bytes_per_block: 2 * bytes_per_block + 4])
    assert not interleavable(extreme_weight(rng, ggml_type, GROUP + 1, BLOCK))
    with pytest.raises(ValueError, match="whole groups"):
        InterleavedWeight.from_quantized(extreme_weight(rng, ggml_type, GROUP + 1, BLOCK))


@pytest.mark.parametrize("isa", quantized_dot.available_isas())
@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_every_group_dot_against_the_plain_one(rng: np.random.Generator, isa: str, ggml_type: str) -> None:
    """SmolLM2's two row lengths, weights and activations at their extremes (Q8_0's -128 against
    -127), four rows at a time and one; outputs poisoned with NaN."""
    for inner in (576, 1536):
        w = extreme_weight(rng, ggml_type, 2 * GROUP, inner)
        inter = InterleavedWeight.from_quantized(w)
        x = rng.standard_normal((6, inner)).astype(np.float32)
        x[0, :BLOCK] = x[5, :BLOCK] = -1.0  # every xq -127
        xq, xd, xs = quantized(x)
        got, want = (np.full((6, 2 * GROUP), np.nan, np.float32) for _ in range(2))
        interleaved_dot.group_dots(isa, ggml_type)(inter.quants, inter.scales, inter.minima, half_table(), xq, xd,
                                                   xs, got)
        interleaved_dot.group_dots("plain", ggml_type)(inter.quants, inter.scales, inter.minima, half_table(), xq,
                                                       xd, xs, want)
        bound = 2e-6 * (np.abs(xq * np.repeat(xd, BLOCK, axis=1)) @ np.abs(w.dequantize()).T) + 1e-7
        assert (np.abs(got - want) <= bound).all(), (isa, inner, np.abs(got - want).max())


@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_the_kernel_against_the_plain_path(rng: np.random.Generator, ggml_type: str) -> None:
    """Decode's row counts and a prefill's (past a row tile, not a multiple of four), in more parts
    than groups and in one, with and without a bias, outputs poisoned with NaN; and against float32
    activations, what their rounding costs (under 2% of the products' magnitudes)."""
    w = extreme_weight(rng, ggml_type, 3 * GROUP, 576)
    inter = InterleavedWeight.from_quantized(w)
    bias = rng.standard_normal(w.shape[0]).astype(np.float32)
    for rows, chunks in ((1, 1), (2, 5), (4, 100), (8, 3), (interleaved_dot.ROW_TILE + 7, 2), (150, 8)):
        x = rng.standard_normal((rows, 576)).astype(np.float32)
        for b in (bias, np.zeros(0, np.float32)):
            out = np.full((rows, w.shape[0]), np.nan, np.float32)
            interleaved_dot.interleaved_dot_rows_cpu(x, inter.quants, inter.scales, inter.minima, half_table(), b,
                                                     out, chunks)
            magnitude = np.abs(x) @ np.abs(w.dequantize()).T
            assert (np.abs(out - quantized_dot.quantized_dot_reference(x, w, b)) <= 2e-6 * magnitude + 1e-6).all()
            exact = x.astype(np.float64) @ w.dequantize().astype(np.float64).T + (b if b.shape[0] else 0.0)
            assert (np.abs(out - exact) <= 0.02 * magnitude).all()


@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_the_embedding_gathers_the_loaders_values(rng: np.random.Generator, ggml_type: str) -> None:
    w = extreme_weight(rng, ggml_type, 4 * GROUP, 3 * BLOCK)
    inter = InterleavedWeight.from_quantized(w)
    ids = np.array([0, 1, 17, 63, 17], np.int32)
    out = np.full((ids.size, w.shape[1]), np.nan, np.float32)
    interleaved_dot.interleaved_embedding_cpu(ids, inter.quants, inter.scales, inter.minima, half_table(), out)
    np.testing.assert_array_equal(out, w.dequantize()[ids])


def test_the_cpu_backend_keeps_and_reads_them_interleaved(rng: np.random.Generator) -> None:
    """Whole groups are interleaved, other row counts stay row-major; both read the same."""
    backend = CpuBackend()
    whole, odd = (extreme_weight(rng, "Q4_1", rows, 2 * BLOCK) for rows in (2 * GROUP, GROUP + 3))
    kept_whole, kept_odd = backend.store_linear(whole, "float32"), backend.store_linear(odd, "float32")
    assert isinstance(kept_whole, InterleavedWeight) and isinstance(kept_odd, QuantizedWeight)
    x = rng.standard_normal((3, 2 * BLOCK)).astype(np.float32)
    for stored, original in ((kept_whole, whole), (kept_odd, odd)):
        out = np.empty((3, original.shape[0]), np.float32)
        backend.matmul(x, stored, np.zeros(0, np.float32), out)
        magnitude = np.abs(x) @ np.abs(original.dequantize()).T
        np.testing.assert_array_less(np.abs(out - quantized_dot.quantized_dot_reference(
            x, original, np.zeros(0, np.float32))), 2e-6 * magnitude + 1e-6)
        table = np.empty((2, original.shape[1]), np.float32)
        backend.embedding(np.array([2, 1], np.int32), stored, table)
        np.testing.assert_array_equal(table, original.dequantize()[[2, 1]])


def _calling(dot: Callable) -> Callable:
    """A fresh compiled function calling the group dot ``dot`` on group 0 from row 0."""
    @numba.njit
    def call(wq, ws, wm, table, xq, xd, xs, out):  # noqa: ANN001, ANN202
        dot(wq, ws, wm, table, xq, xd, xs, 0, 0, out)
    return call


@pytest.mark.parametrize("ggml_type", QUANTIZED_TYPES)
def test_a_one_row_dot_asks_for_its_weights_ahead(monkeypatch: pytest.MonkeyPatch, ggml_type: str) -> None:
    """A one-row group dot (batch 1, bound by memory) prefetches each 64-byte part it loads,
    ``PREFETCH_BYTES`` ahead; the four-row one and a CPU where it is 0 do not (counted in the IR of
    fresh compilations: the constant is read when the IR is made)."""
    isa = interleaved_dot.ISA
    if isa == "plain":  # a CPU without AVX2 (not x86, or an old one): its dots are the plain loops,
        # which have no prefetch to count, and LLVM cannot lower the vector dots' intrinsics for it
        pytest.skip("no vector group dots on this CPU")
    parts = (BLOCK if ggml_type == "Q8_0" else BLOCK // 2) // PART_BYTES
    w = extreme_weight(np.random.default_rng(0), ggml_type, GROUP, 2 * BLOCK)
    inter = InterleavedWeight.from_quantized(w)
    xq, xd, xs = quantized(np.ones((1, 2 * BLOCK), np.float32))
    for ahead, rows, calls in ((1024, 1, parts), (1024, interleaved_dot.ROWS, 0), (0, 1, 0)):
        monkeypatch.setattr(interleaved_dot, "PREFETCH_BYTES", ahead)
        call = _calling(interleaved_dot._make_group_dot(ggml_type, isa, rows))
        rows_x = np.repeat(xq, rows, axis=0), np.repeat(xd, rows, axis=0), np.repeat(xs, rows, axis=0)
        call(inter.quants, inter.scales, inter.minima, half_table(), *rows_x, np.zeros((rows, GROUP), np.float32))
        ir = next(iter(call.inspect_llvm().values()))
        assert ir.count("call void @llvm.prefetch") == calls, (ahead, rows)
