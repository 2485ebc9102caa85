"""``exp_f32``: a float32 ``exp`` that LLVM can vectorise, for the CPU kernels' hot loops.

numba compiles ``math.exp`` to a call of the C library's ``expf`` (no vector library: the
llvmlite wheels are built without SVML), so a loop calling it runs one element at a time.
This one is arithmetic only (Cephes' ``expf``: ``x = n ln 2 + r``, a degree-7 polynomial for
``e**r`` and ``2**n`` built in the exponent bits), so a loop of it becomes SIMD code
(docs/perf-log/code-comments.md#exp-f32): ``silu_mul`` uses it, and both CPU attentions' softmaxes through
:func:`softmax_numerators`.

Within 1 ulp of the exact result (``math.exp``: 0.5) over float32's range; ``-inf`` and anything whose result would be
subnormal (below about ``-87.3``) give ``0.0``, past ``88.72`` ``inf``, NaN stays NaN. Inlined into
a kernel compiled with reassociation (the CPU kernels' fastmath flags), LLVM may fold the two parts
of ``ln 2`` into one, and ``2**n``'s two factors too: there it is within 1.1 ulp over ``[-10, 10]``,
4.5 ulp towards the ends of the range, and ``inf`` from ``88.376`` (results above ``2**127.5``)
instead of ``88.72`` (measured), which no softmax or SiLU can tell. Its plain reference is the exact exp:
``tests/runtime/model/test_fast_exp.py`` diffs the two, in both compilations.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import float32, int32, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["exp_f32", "exp_nonpositive_f32", "softmax_numerators", "softmax_numerators_and_max"]

_LOG2E = float32(1.44269504088896341)
_LN2_HI = float32(0.693359375)      # ln 2 split so that n * _LN2_HI is exact
_LN2_LO = float32(-2.12194440e-4)
_MAX_X = float32(88.7228391)        # exp(x) overflows float32 beyond
_MIN_X = float32(-87.3365448)       # exp(x) is subnormal below: flushed to zero
_INF = float32(np.inf)


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the low 32 bits of the integer ``bits`` (a truncation and
    a bitcast: free in a vector loop)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@njit(inline="always", cache=True)
def _exp_parts(clamped):
    """``(m, n)`` with ``e**clamped = m * 2**n``: ``n`` is ``clamped / ln 2`` rounded (a vector
    ``floor``), ``m`` Cephes' degree-7 polynomial in the remainder ``|r| <= ln 2 / 2``."""
    n = np.floor(clamped * _LOG2E + float32(0.5))
    r = clamped - n * _LN2_HI - n * _LN2_LO
    p = float32(1.9875691500e-4)
    p = p * r + float32(1.3981999507e-3)
    p = p * r + float32(8.3334519073e-3)
    p = p * r + float32(4.1665795894e-2)
    p = p * r + float32(1.6666665459e-1)
    p = p * r + float32(5.0000001201e-1)
    return p * r * r + r + float32(1.0), int32(n)


@njit(inline="always", cache=True)
def exp_f32(x):
    """``e**x`` in float32, branch-free so that loops of it vectorise (see the module docstring)."""
    x = float32(x)
    m, n = _exp_parts(min(max(x, _MIN_X), _MAX_X))
    # 2**n as two factors: n reaches 128 near the top of the range, one past float32's exponents.
    half = n >> 1
    rest = n - half
    y = m * _float32_from_bits((half + 127) << 23) * _float32_from_bits((rest + 127) << 23)
    y = float32(0.0) if x < _MIN_X else y
    y = _INF if x > _MAX_X else y
    return x if x != x else y  # NaN in, NaN out


@njit(inline="always", cache=True)
def exp_nonpositive_f32(x):
    """:func:`exp_f32` for ``x <= 0`` (or NaN), as a softmax's ``score - max`` always is: the same
    results with less arithmetic (no overflow to handle, so ``2**n`` is one factor; a softmax
    tile's exp pass is bound by its arithmetic). Wrong for ``x > 0``."""
    x = float32(x)
    m, n = _exp_parts(max(x, _MIN_X))
    y = m * _float32_from_bits((n + 127) << 23)
    y = float32(0.0) if x < _MIN_X else y
    return x if x != x else y  # NaN in, NaN out


@intrinsic
def _maxnum(typingctx, a, b):
    """LLVM's ``maxnum``: the larger of two float32s, the other one where one is NaN. Unlike a
    compare and select, LLVM vectorises a reduction of it without being told there is no NaN."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, signature, args):
        maxnum = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType(), ir.FloatType()]), "llvm.maxnum.f32")
        return builder.call(maxnum, args)

    return types.float32(types.float32, types.float32), codegen


@njit(inline="always", cache=True, error_model="numpy")
def softmax_numerators(row, count):
    """``row[:count]`` becomes ``exp(row - max(row[:count]))`` in place; returns their sum (the
    softmax's denominator). Inlined, so the loops take the caller's fastmath flags (reassociation
    vectorises the sum)."""
    return softmax_numerators_and_max(row, count)[1]


@njit(inline="always", cache=True, error_model="numpy")
def softmax_numerators_and_max(row, count):
    """:func:`softmax_numerators`, returning ``(max, sum)``: the max too, for a caller that
    merges the softmaxes of several slices of one row.

    The max is a ``maxnum`` reduction, which passes over a NaN score: a NaN still makes its own
    numerator, hence the sum and every probability of the row, NaN, as the exact softmax does
    (the lane-wise compare and select this replaces was not vectorised at all:
    docs/perf-log/cpu-anchors.md#2026-11-26-xeon-amx-softmax-max-exp; the same numerators, the sum
    summed in another order)."""
    top = float32(row[0])
    for j in range(count):
        top = _maxnum(top, float32(row[j]))
    total = float32(0.0)
    for j in range(count):
        e = exp_nonpositive_f32(row[j] - top)
        row[j] = e
        total += e
    return top, total
