"""``exp_f32`` (the CPU kernels' vectorisable exp) and ``exp_nonpositive_f32`` (its softmax form)
against their plain reference, the exact exp, and the kernels built on them against NumPy:
``softmax_numerators_and_max``, ``causal_softmax_rows`` (BLAS attention's softmax) and the CPU
``silu_mul`` at widths that run their vector loops."""
from __future__ import annotations

import math

import numpy as np
import pytest
from numba import njit

from engines.runtime.model.kernels import silu_mul
from engines.runtime.model.kernels.fast_exp import exp_f32, exp_nonpositive_f32, softmax_numerators_and_max
from engines.runtime.model.kernels.run_attention import causal_softmax_rows

FLOAT32 = np.finfo(np.float32)


@njit(cache=False)
def exp_loop(x: np.ndarray, out: np.ndarray) -> None:
    """exp_f32 in a loop (what LLVM vectorises)."""
    for i in range(x.shape[0]):
        out[i] = exp_f32(x[i])


@njit(cache=False)
def exp_scalar(x: float) -> float:
    return exp_f32(x)


@njit(cache=False)
def exp_nonpositive_loop(x: np.ndarray, out: np.ndarray) -> None:
    """exp_nonpositive_f32 in a loop (what LLVM vectorises)."""
    for i in range(x.shape[0]):
        out[i] = exp_nonpositive_f32(x[i])


@njit(cache=False, fastmath={"reassoc", "contract", "nsz", "arcp"})
def numerators_and_max(row: np.ndarray, count: int) -> tuple[float, float]:
    """softmax_numerators_and_max with the kernels' fastmath flags (its loops take the caller's)."""
    return softmax_numerators_and_max(row, count)


def ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)


def test_within_one_ulp_of_the_exact_exp_over_the_normal_range() -> None:
    x = np.concatenate([np.linspace(-87.33, 88.72, 1 << 20, dtype=np.float32),
                        np.random.default_rng(0).uniform(-20, 20, 1 << 18).astype(np.float32),
                        np.float32([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 88.7228, -87.3365])])
    got = np.empty_like(x)
    exp_loop(x, got)
    exact = np.exp(x.astype(np.float64))
    normal = exact >= FLOAT32.tiny
    assert ulps(got[normal], exact[normal]).max() <= 1.0
    assert np.isfinite(got).all()
    # the scalar call (no vector loop) agrees with the loop
    for value in x[::4099]:
        assert ulps(np.float32([exp_scalar(value)]), np.exp(np.float64([value])))[0] <= 1.0


@njit(cache=False, fastmath={"reassoc", "contract", "nsz", "arcp"})
def exp_loop_as_in_kernels(x: np.ndarray, out: np.ndarray) -> None:
    """exp_f32 in a loop compiled with the CPU kernels' fastmath flags."""
    for i in range(x.shape[0]):
        out[i] = exp_f32(x[i])


def test_within_a_few_ulp_compiled_as_the_kernels_compile_it() -> None:
    x = np.linspace(-87.33, 88.72, 1 << 20, dtype=np.float32)
    got = np.empty_like(x)
    exp_loop_as_in_kernels(x, got)
    exact = np.exp(x.astype(np.float64))
    finite = (exact >= FLOAT32.tiny) & (x < 88.376)  # above it, 2**n's factors may be multiplied first: inf
    error = ulps(got[finite], exact[finite])
    assert error.max() <= 5.0
    assert error[np.abs(x[finite]) <= 10].max() <= 1.5


def test_edges_zero_infinity_and_nan() -> None:
    x = np.float32([-np.inf, -1000.0, -103.0, -87.34, np.inf, 1000.0, 88.73, np.nan, 0.0])
    got = np.empty_like(x)
    exp_loop(x, got)
    np.testing.assert_array_equal(got[:4], 0.0)       # subnormal results are flushed to zero
    assert np.isposinf(got[4:7]).all()
    assert np.isnan(got[7]) and got[8] == 1.0
    assert math.isnan(exp_scalar(np.float32(np.nan)))


def test_the_nonpositive_exp_is_exp_f32_where_it_applies() -> None:
    x = np.concatenate([-np.linspace(0, 110, 1 << 20, dtype=np.float32),
                        np.float32([-0.0, -1e-30, -87.3365, -87.34, -103.0, -1000.0, -np.inf, np.nan])])
    got, want = np.empty_like(x), np.empty_like(x)
    exp_nonpositive_loop(x, got)
    exp_loop(x, want)
    np.testing.assert_array_equal(got, want)  # bit for bit, NaN where NaN, flushed zeros alike
    exact = np.exp(x.astype(np.float64))
    normal = exact >= FLOAT32.tiny
    assert ulps(got[normal], exact[normal]).max() <= 1.0


@pytest.mark.parametrize("special, at", [(None, 41), (None, 68), (np.nan, 0), (np.nan, 37), (np.nan, 70), (np.inf, 5),
                                         (-np.inf, 0), (-np.inf, 64)])
def test_softmax_numerators_and_max_against_numpy(special: float | None, at: int) -> None:
    """The max (a maxnum reduction, in vector lanes and a scalar tail: 71 keys) and the sum. A NaN
    anywhere makes its own numerator and the sum NaN (so every probability, once divided by it), as
    an infinite score does; -inf gives 0."""
    row = (np.random.default_rng(at).standard_normal(80) * 9).astype(np.float32)
    row[41 if special is not None else at] = 30.0  # the max: in the vector loop's lanes, or in its tail
    if special is not None:
        row[at] = special
    scores = row.copy()
    top, total = numerators_and_max(scores, 71)
    seen = row[:71].astype(np.float64)
    np.testing.assert_array_equal(scores[71:], row[71:])  # past count: untouched
    if special is not None and not np.isneginf(special):  # NaN or +inf
        assert np.isnan(total) and np.isnan(scores[at])
        return
    assert top == 30.0
    want = np.exp(seen - 30.0)
    np.testing.assert_allclose(scores[:71], want, rtol=1e-5, atol=0)  # (score - max) rounded: ~40 * 2**-24
    np.testing.assert_allclose(total, want.sum(), rtol=1e-5)


def reference_softmax_rows(scores: np.ndarray, first_row_keys: int) -> np.ndarray:
    out = np.zeros_like(scores, dtype=np.float64)
    for i, row in enumerate(scores.astype(np.float64)):
        seen = min(first_row_keys + i, scores.shape[1])
        e = np.exp(row[:seen] - row[:seen].max())
        out[i, :seen] = e / e.sum()
    return out


@pytest.mark.parametrize("keys, first_row_keys", [(45, 30), (200, 1), (37, 100)])
def test_causal_softmax_rows_matches_a_float64_masked_softmax(keys: int, first_row_keys: int) -> None:
    rng = np.random.default_rng(keys)
    scores = (rng.standard_normal((19, keys)) * 6).astype(np.float32)
    scores[3, min(first_row_keys + 3, keys) - 1] = 40.0  # the max in the row's last visible key
    scores[4, 0] = 40.0                                  # and in its first
    want = reference_softmax_rows(scores, first_row_keys)
    causal_softmax_rows(scores, first_row_keys)
    # float32 rounding of (score - max) alone is 40 * 2**-24 relative: a tolerance of 1e-5
    np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-30)
    for i in range(19):  # masked keys are exact zeros, not tiny numbers
        assert not scores[i, min(first_row_keys + i, keys):].any()


def test_causal_softmax_rows_keeps_nan() -> None:
    scores = np.zeros((2, 40), np.float32)
    scores[0, 20] = np.nan
    causal_softmax_rows(scores, 39)
    assert np.isnan(scores[0, :39]).all() and not scores[0, 39:].any()
    np.testing.assert_array_equal(scores[1, :40], np.float32(1 / 40))


def test_cpu_silu_mul_over_vector_widths() -> None:
    rng = np.random.default_rng(3)
    gate_up = (rng.standard_normal((7, 2 * 1411)) * 8).astype(np.float32)
    gate_up[0, :4] = [-100.0, 100.0, 0.0, -90.0]
    g, u = gate_up[:, :1411].astype(np.float64), gate_up[:, 1411:]
    want = g / (1 + np.exp(-g)) * u
    for kernel in (silu_mul.silu_mul_cpu, silu_mul.silu_mul_serial_cpu):
        out = np.empty((7, 1411), np.float32)
        kernel(gate_up, out)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
