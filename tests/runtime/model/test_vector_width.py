"""``prefer_wide_vectors``: the LLVM attribute reaches the function it is called in, a ``prange``
body included, 512-bit registers follow where the CPU has them, results are the plain code's, and
the batched decode's matmul, the prefill softmax and ``silu_mul`` carry it."""
from __future__ import annotations

import numpy as np
from numba import float32, njit, prange

from engines.runtime.model.kernels import matmul, run_attention, silu_mul
from engines.runtime.model.kernels.vector_width import WIDE_VECTORS_ATTRIBUTE, has_512_bit_vectors, prefer_wide_vectors

_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def _row_dots(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    for n in range(w.shape[0]):
        s = float32(0.0)
        for k in range(x.shape[0]):
            s += x[k] * w[n, k]
        out[n] = s


def _row_dots_wide(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    prefer_wide_vectors()
    _row_dots_inline(x, w, out)


_row_dots_inline = njit(inline="always", fastmath=_FASTMATH)(_row_dots)
plain = njit(cache=False, fastmath=_FASTMATH)(_row_dots)
wide = njit(cache=False, fastmath=_FASTMATH)(_row_dots_wide)


@njit(cache=False, parallel=True, fastmath=_FASTMATH)
def wide_parallel(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    for n in prange(w.shape[0]):
        prefer_wide_vectors()
        s = float32(0.0)
        for k in range(x.shape[0]):
            s += x[k] * w[n, k]
        out[n] = s


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal(515).astype(np.float32), rng.standard_normal((37, 515)).astype(np.float32)


def _run(fn, x: np.ndarray, w: np.ndarray) -> np.ndarray:  # noqa: ANN001
    out = np.empty(w.shape[0], np.float32)
    fn(x, w, out)
    return out


def test_the_marked_function_carries_the_attribute_and_the_plain_one_does_not() -> None:
    x, w = _inputs()
    expected = w.astype(np.float64) @ x.astype(np.float64)
    for fn in (plain, wide, wide_parallel):
        np.testing.assert_allclose(_run(fn, x, w), expected, rtol=1e-4, atol=1e-4)
    assert WIDE_VECTORS_ATTRIBUTE in wide.inspect_llvm(wide.signatures[0])
    assert WIDE_VECTORS_ATTRIBUTE not in plain.inspect_llvm(plain.signatures[0])
    # numba outlines a prange body into a function of its own: the attribute is on it.
    assert WIDE_VECTORS_ATTRIBUTE in wide_parallel.inspect_llvm(wide_parallel.signatures[0])


def test_512_bit_registers_where_the_cpu_has_them() -> None:
    x, w = _inputs()
    _run(wide, x, w)
    uses_zmm = "zmm" in wide.inspect_asm(wide.signatures[0])
    assert uses_zmm == has_512_bit_vectors()


def test_the_batched_decode_matmul_is_marked() -> None:
    """``matmul_rows_cpu`` (cached, so compiled afresh here from its source) marks its loop body,
    and computes ``x @ w.T`` at the row counts of its blocks and tails."""
    fresh = njit(cache=False, parallel=True, fastmath=_FASTMATH)(matmul.matmul_rows_cpu.py_func)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((70, 96)).astype(np.float32)
    for rows in (1, 3, 4, 9, 32):
        x = rng.standard_normal((rows, 96)).astype(np.float32)
        out = np.empty((rows, 70), np.float32)
        fresh(x, w, np.zeros(0, np.float32), out)
        np.testing.assert_allclose(out, x @ w.T, rtol=1e-4, atol=1e-4)
    assert WIDE_VECTORS_ATTRIBUTE in fresh.inspect_llvm(fresh.signatures[0])


def test_the_prefill_softmax_and_silu_mul_are_marked() -> None:
    """The two kernels bound by the exp's arithmetic carry the mark (compiled afresh from their
    sources, as above), and still compute their plain results."""
    softmax = njit(cache=False, fastmath=_FASTMATH, error_model="numpy")(run_attention.causal_softmax_rows.py_func)
    scores = np.random.default_rng(2).standard_normal((5, 70)).astype(np.float32)
    want = np.exp(scores.astype(np.float64) - scores.max(axis=1, keepdims=True))
    softmax(scores, 70)
    np.testing.assert_allclose(scores, want / want.sum(axis=1, keepdims=True), rtol=1e-5)
    assert WIDE_VECTORS_ATTRIBUTE in softmax.inspect_llvm(softmax.signatures[0])
    gate_up = np.random.default_rng(3).standard_normal((3, 2 * 37)).astype(np.float32)
    g, u = gate_up[:, :37].astype(np.float64), gate_up[:, 37:]
    for twin, parallel in ((silu_mul.silu_mul_cpu, True), (silu_mul.silu_mul_serial_cpu, False)):
        fresh = njit(cache=False, parallel=parallel, error_model="numpy")(twin.py_func)
        out = np.empty((3, 37), np.float32)
        fresh(gate_up, out)
        np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
        assert WIDE_VECTORS_ATTRIBUTE in fresh.inspect_llvm(fresh.signatures[0])
