"""``exp_f32``: a float32 ``exp`` that LLVM can vectorise, for the CPU kernels' hot loops.

numba compiles ``math.exp`` to a call of the C library's ``expf`` (no vector library: the
llvmlite wheels are built without SVML), so a loop calling it runs one element at a time.
This one is arithmetic only (Cephes' ``expf``: ``x = n ln 2 + r``, a degree-7 polynomial for
``e**r`` and ``2**n`` built in the exponent bits), so a loop of it becomes SIMD code (5x faster than
``expf`` here): ``silu_mul`` uses it, and both CPU attentions' softmaxes through
:func:`softmax_numerators`.

Within 1 ulp of the exact result (``math.exp``: 0.5) over float32's range; ``-inf`` and anything whose result would be
subnormal (below about ``-87.3``) give ``0.0``, past ``88.72`` ``inf``, NaN stays NaN. Its plain
reference is the exact exp: ``tests/runtime/model/test_fast_exp.py`` diffs the two.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import float32, int32, njit, types
from numba.extending import intrinsic

__all__ = ["exp_f32", "softmax_numerators", "softmax_numerators_and_max"]

_LOG2E = float32(1.44269504088896341)
_LN2_HI = float32(0.693359375)      # ln 2 split so that n * _LN2_HI is exact
_LN2_LO = float32(-2.12194440e-4)
_MAX_X = float32(88.7228391)        # exp(x) overflows float32 beyond
_MIN_X = float32(-87.3365448)       # exp(x) is subnormal below: flushed to zero
_INF = float32(np.inf)


@intrinsic
def _float32_from_bits(typingctx, bits):  # type: ignore[no-untyped-def]
    """The float32 whose IEEE bits are the low 32 bits of the integer ``bits`` (a truncation and
    a bitcast: free in a vector loop)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@njit(inline="always", cache=True)
def exp_f32(x: float) -> float:
    """``e**x`` in float32, branch-free so that loops of it vectorise (see the module docstring)."""
    x = float32(x)
    clamped = min(max(x, _MIN_X), _MAX_X)
    v = clamped * _LOG2E + float32(0.5)
    truncated = float32(int32(v))
    n = truncated - float32(v < truncated)  # floor(v): n is x / ln 2 rounded, |r| <= ln 2 / 2
    r = clamped - n * _LN2_HI - n * _LN2_LO
    p = float32(1.9875691500e-4)
    p = p * r + float32(1.3981999507e-3)
    p = p * r + float32(8.3334519073e-3)
    p = p * r + float32(4.1665795894e-2)
    p = p * r + float32(1.6666665459e-1)
    p = p * r + float32(5.0000001201e-1)
    # 2**n as two factors: n reaches 128 near the top of the range, one past float32's exponents.
    half = int32(n) >> 1
    rest = int32(n) - half
    y = (p * r * r + r + float32(1.0)) * _float32_from_bits((half + 127) << 23) * _float32_from_bits((rest + 127) << 23)
    y = float32(0.0) if x < _MIN_X else y
    y = _INF if x > _MAX_X else y
    return x if x != x else y  # NaN in, NaN out


@njit(inline="always", cache=True, error_model="numpy")
def softmax_numerators(row: np.ndarray, count: int, lanes: np.ndarray) -> float:
    """``row[:count]`` becomes ``exp(row - max(row[:count]))`` in place; returns their sum (the
    softmax's denominator). ``lanes`` is 16 floats of the caller's scratch: the max is taken in
    16 lanes because LLVM vectorises a max reduction only when told there is no NaN, and a NaN
    score must stay NaN; lane-wise maxima are plain element-wise work. Inlined, so the loops
    take the caller's fastmath flags (reassociation vectorises the sum)."""
    return softmax_numerators_and_max(row, count, lanes)[1]


@njit(inline="always", cache=True, error_model="numpy")
def softmax_numerators_and_max(row: np.ndarray, count: int, lanes: np.ndarray) -> tuple[float, float]:
    """:func:`softmax_numerators`, returning ``(max, sum)``: the max too, for a caller that
    merges the softmaxes of several slices of one row."""
    lanes[:] = row[0]
    whole = count - count % 16
    for j in range(0, whole, 16):
        for lane in range(16):
            lanes[lane] = max(lanes[lane], row[j + lane])
    top = row[0]
    for lane in range(16):
        top = max(top, lanes[lane])
    for j in range(whole, count):
        top = max(top, row[j])
    total = float32(0.0)
    for j in range(count):
        e = exp_f32(row[j] - top)
        row[j] = e
        total += e
    return top, total
