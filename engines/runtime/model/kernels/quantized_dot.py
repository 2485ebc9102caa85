"""``out = x @ W.T + bias`` for a decode step's few rows, ``W`` quantized (Q8_0, Q4_0, Q4_1), with
``x`` quantized too: to int8 in blocks of 32 (llama.cpp's Q8_0 activations), so that a block's dot
product is 32 byte products summed in one integer instruction, scaled once.

Why: dequantizing a weight to float32 before the FMAs (``quantized_matmul_rows_cpu``) costs more
instructions per element than the float32 kernel's own load-and-FMA, and LLVM turns the 32-element
block loops into scalar conversions: the quantized path ran at 0.6x float32's speed at one row
despite reading a quarter to an eighth of the bytes (docs/perf-log/quantized-weights.md). Integer
dots are how llama.cpp and CTranslate2 (int8) read quantized weights fast.

A block ``b`` of weight row ``n`` and activation row ``m``::

    Q8_0:  sum_j q[j] * d_w * xq[j] * d_x              = d_w d_x dot(q, xq)
    Q4_0:  sum_j (u[j] - 8) * d_w * xq[j] * d_x        = d_w d_x dot(u, xq) - 8 d_w s_x
    Q4_1:  sum_j (u[j] * d_w + m_w) * xq[j] * d_x      = d_w d_x dot(u, xq) + m_w s_x

with ``s_x = d_x * sum(xq)`` computed once per activation block (llama.cpp's Q8_1 ``s``). The
integer ``dot`` is exact (at most 32 * 128 * 127 in magnitude); everything after it is float32.

The dot of one weight row with one (or four) activation rows is written in LLVM IR (numba
``@intrinsic``, built from :mod:`.llvm_ir`), since numba has no vector types: per block, the
weight's 32 values as unsigned bytes (Q4: the 16 bytes' low nibbles, then their high nibbles, as
GGUF lays a block out; Q8_0: ``|q|``, with ``xq``'s signs flipped where ``q < 0``, llama.cpp's trick
for an unsigned-by-signed instruction), their products with ``xq`` summed in eight int32 lanes --
``vpdpbusd`` where the CPU has AVX-512 VNNI (two blocks in one 512-bit instruction), ``vpmaddubsw`` +
``vpmaddwd`` on AVX2 (no saturation: ``u <= 128``, ``|xq| <= 127``) -- converted to float and
accumulated with one FMA by the block's scales; the lanes are added once a row. The activations'
scales are spread over eight lanes a block once a call (``spread_scales_cpu``) so that a pair of
blocks' scales is one load. A CPU without AVX2 runs the plain numba loops (``ROW_DOTS["plain"]``),
which are also the reference the tests diff the IR against.

Accuracy: the activations' rounding is the only difference from dequantize-then-float32; its size
on SmolLM2 is measured in tests/runtime/model/test_quantized_model.py and bench/gguf_vs_llamacpp.py.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np
from llvmlite import binding, ir
from numba import float32, int32, njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from engines.runtime.model.kernels.llvm_ir import F32, I8, I16, I32, constant, declare, load_vector, row_pointer, vector
from engines.runtime.model.kernels.matmul import add_bias
from engines.runtime.model.quant.quantized_weight import BLOCK, QuantizedWeight

__all__ = ["ISA", "Q8_0_OFFSET", "ROW_DOTS", "available_isas", "quantize_activations_cpu",
           "quantize_activations_reference", "quantized_activations", "quantized_dot_reference",
           "quantized_dot_rows_cpu", "row_dots", "spread_scales_cpu", "weight_kind", "DEQUANTIZE_ROWS",
           "dequantize_rows_cpu", "offset_activations_cpu", "takes_offset_activations"]

#: Largest activation magnitude after quantization: [-127, 127], so that ``-xq`` never overflows.
XQ_MAX = 127
#: The three weight layouts, as the row-dot tuples of ``ROW_DOTS`` order them.
KINDS = ("Q8_0", "Q4_0", "Q4_1")

#: int32 lanes of one block's dot (256 bits), and the lanes a block's activation scale is spread over.
LANES = 8
#: Independent accumulators a row dot keeps over all its rows (see ``_make_ir_row_dot``).
ROW_CHAINS = 4
#: Weight rows the kernel takes through a group of four activation rows before the next group.
WEIGHT_TILE = 16


def _cpu_features() -> set[str]:
    """The features numba compiles for (``NUMBA_CPU_FEATURES`` if set, else the host's)."""
    chosen = config.CPU_FEATURES  # type: ignore[attr-defined]
    features = chosen if chosen is not None else binding.get_host_cpu_features().flatten()
    return {f[1:] for f in features.split(",") if f.startswith("+")}


def available_isas() -> list[str]:
    """The row-dot implementations this CPU runs, fastest first (``plain`` always)."""
    features = _cpu_features()
    isas = []
    if {"avx512vnni", "avx512vl"} <= features:
        isas.append("vnni")
    if "avx2" in features:
        isas.append("avx2")
    return [*isas, "plain"]


# ------------------------------------------------------------------------------ activations


@njit(nogil=True, cache=True, error_model="numpy", fastmath=False)
def quantize_activations_cpu(x, xq, xd, xs):
    """Each row of ``x`` (float32 ``[rows, in]``) in blocks of 32 as int8 ``xq`` in [-127, 127] with
    the block's scale ``xd = max|x| / 127`` and ``xs = xd * sum(xq)`` (both float32 ``[rows, in/32]``):
    ``x ~= xq * xd``, rounded to nearest (halves away from zero)."""
    for m in range(x.shape[0]):
        for b in range(xd.shape[1]):
            amax = float32(0.0)
            for j in range(BLOCK * b, BLOCK * b + BLOCK):
                amax = max(amax, abs(x[m, j]))
            d = amax / float32(XQ_MAX)
            inverse = float32(1.0) / d if d > 0 else float32(0.0)
            total = int32(0)
            for j in range(BLOCK * b, BLOCK * b + BLOCK):
                v = x[m, j] * inverse
                q = int32(v + float32(0.5)) if v >= 0 else -int32(float32(0.5) - v)
                q = min(XQ_MAX, max(-XQ_MAX, q))
                xq[m, j] = q
                total += q
            xd[m, b] = d
            xs[m, b] = d * float32(total)


@njit(inline="always")
def quantized_activations(x, offset):
    """``x`` quantized by :func:`quantize_activations_cpu` into new arrays ``(xq, xd, xs)``, ``xq``
    offset (:func:`offset_activations_cpu`) where ``offset``: what a kernel's call starts with."""
    rows, inner = x.shape
    blocks = inner // BLOCK
    xq = np.empty((rows, inner), np.int8)
    xd = np.empty((rows, blocks), np.float32)
    xs = np.empty((rows, blocks), np.float32)
    quantize_activations_cpu(x, xq, xd, xs)
    if offset:
        offset_activations_cpu(xq)
    return xq, xd, xs


def quantize_activations_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plain numpy twin of :func:`quantize_activations_cpu`: ``(xq, xd, xs)``."""
    rows, inner = x.shape
    blocks = x.reshape(rows, inner // BLOCK, BLOCK).astype(np.float32)
    d = (np.abs(blocks).max(axis=2) / np.float32(XQ_MAX)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    v = blocks * inverse[:, :, None]
    q = np.clip(np.sign(v) * np.floor(np.abs(v) + np.float32(0.5)), -XQ_MAX, XQ_MAX).astype(np.int32)
    return (q.reshape(rows, inner).astype(np.int8), d, (d * q.sum(axis=2).astype(np.float32)).astype(np.float32))


def quantized_dot_reference(x: np.ndarray, weight: QuantizedWeight, bias: np.ndarray) -> np.ndarray:
    """The plain path :func:`quantized_dot_rows_cpu` is diffed against: ``x`` quantized by
    :func:`quantize_activations_reference` and dequantized again, the weight dequantized by the
    loader, their product in float64 (rounded once)."""
    xq, xd, _ = quantize_activations_reference(x)
    rows, inner = x.shape
    activations = (xq.reshape(rows, inner // BLOCK, BLOCK).astype(np.float64) * xd[:, :, None]).reshape(rows, inner)
    product = activations @ weight.dequantize().astype(np.float64).T
    if bias.shape[0]:
        product += bias
    return product.astype(np.float32)


@njit(nogil=True, cache=True, error_model="numpy", fastmath=False)
def spread_scales_cpu(xd, xs, xd8, xs8):
    """The activations' block scales as the row dots read them: each block's ``xd`` in eight lanes
    (``xd8[m, 8b:8b + 8]``), and ``xs / 8`` likewise (eight lanes that sum to ``xs``: exact, a
    power of two), so that a vector of blocks' scales is one load."""
    for m in range(xd.shape[0]):
        for b in range(xd.shape[1]):
            for lane in range(LANES):
                xd8[m, LANES * b + lane] = xd[m, b]
                xs8[m, LANES * b + lane] = xs[m, b] * float32(1.0 / LANES)


# ---------------------------------------------------------------------- the plain row dots
#
# Every row dot takes ``(wq, ws, wm, table, xq, xd8, xs8, m)``: weight row ``n``'s quants, scales
# and minima (empty but for Q4_1), the activations' quants and spread scales (spread_scales_cpu)
# whole, and the first activation row. The "one" dots return a float32, the "four" dots the tuple
# for rows ``m .. m + 3``.


@njit(nogil=True, error_model="numpy", fastmath=False)
def _plain_q8_0(wq, ws, wm, table, xq, xd8, xs8, m):
    total = float32(0.0)
    for b in range(ws.shape[0]):
        dot = int32(0)
        for j in range(BLOCK * b, BLOCK * b + BLOCK):
            dot += int32(wq[j]) * int32(xq[m, j])
        total += float32(dot) * (table[ws[b]] * xd8[m, LANES * b])
    return total


@njit(inline="always")
def _nibbles_dot(wq, xq, m, b):
    dot = int32(0)
    for j in range(BLOCK // 2):
        u = int32(np.uint8(wq[16 * b + j]))
        dot += (u & 15) * int32(xq[m, BLOCK * b + j]) + (u >> 4) * int32(xq[m, BLOCK * b + 16 + j])
    return dot


@njit(nogil=True, error_model="numpy", fastmath=False)
def _plain_q4_0(wq, ws, wm, table, xq, xd8, xs8, m):
    total = float32(0.0)
    for b in range(ws.shape[0]):
        d = table[ws[b]]
        xs = xs8[m, LANES * b] * float32(LANES)
        total += float32(_nibbles_dot(wq, xq, m, b)) * (d * xd8[m, LANES * b]) - float32(8.0) * d * xs
    return total


@njit(nogil=True, error_model="numpy", fastmath=False)
def _plain_q4_1(wq, ws, wm, table, xq, xd8, xs8, m):
    total = float32(0.0)
    for b in range(ws.shape[0]):
        xs = xs8[m, LANES * b] * float32(LANES)
        total += float32(_nibbles_dot(wq, xq, m, b)) * (table[ws[b]] * xd8[m, LANES * b]) + table[wm[b]] * xs
    return total


def _plain_four(one: Callable) -> Callable:
    @njit(nogil=True, error_model="numpy", fastmath=False)
    def four(wq, ws, wm, table, xq, xd8, xs8, m):  # noqa: ANN001, ANN202
        return (one(wq, ws, wm, table, xq, xd8, xs8, m), one(wq, ws, wm, table, xq, xd8, xs8, m + 1),
                one(wq, ws, wm, table, xq, xd8, xs8, m + 2), one(wq, ws, wm, table, xq, xd8, xs8, m + 3))
    return four


# ----------------------------------------------------------------------- the IR row dots


def takes_offset_activations(isa: str, kind: str) -> bool:
    """Whether ``isa``'s ``kind`` dots read the activations as ``xq + 128`` (unsigned bytes, the
    int8 bits with the top one flipped: :func:`offset_activations_cpu`) rather than ``xq``: Q8_0
    with VNNI, whose ``vpdpbusd`` then multiplies them by the signed quants as they are, starting
    each block pair's sums from ``-128 sum(q)`` (made once a weight row for all its activation
    rows): three instructions a row fewer than the sign trick (``|q|``, ``x`` negated where
    ``q < 0``), which a many-row product pays for every row (docs/perf-log/quantized-weights.md)."""
    return isa == "vnni" and kind == "Q8_0"


@njit(nogil=True, cache=True, fastmath=False)
def offset_activations_cpu(xq):
    """``xq + 128`` in place, as unsigned bytes in ``xq``'s int8 array (its top bit flipped)."""
    flat = xq.reshape(-1).view(np.uint8)
    for i in range(flat.shape[0]):
        flat[i] ^= np.uint8(128)


def _spread_halves(builder: ir.IRBuilder, base: ir.Value, b: ir.Value, count: int) -> ir.Value:
    """Halves ``base[b .. b + count - 1]`` (uint16 bits) as float32, each in eight lanes
    (``<8 count x float>``; ``vcvtph2ps`` with F16C)."""
    bits = load_vector(builder, builder.bitcast(base, I16.as_pointer()), b, vector(I16, count))
    floats = builder.fpext(builder.bitcast(bits, vector(ir.HalfType(), count)), vector(F32, count))
    return builder.shuffle_vector(floats, floats, ir.Constant(vector(I32, LANES * count),
                                                              [i // LANES for i in range(LANES * count)]))


def _signed_weights(builder: ir.IRBuilder, weights: ir.Value, b: ir.Value, count: int) -> ir.Value:
    """Q8_0 blocks ``b .. b + count - 1``'s quants as ``32 count`` signed bytes."""
    return load_vector(builder, weights, builder.mul(b, constant(BLOCK, b)), vector(I8, BLOCK * count))


def _weights_as_unsigned(builder: ir.IRBuilder, kind: str, weights: ir.Value, b: ir.Value,
                         count: int) -> tuple[ir.Value, ir.Value | None]:
    """Blocks ``b .. b + count - 1``'s weights as ``32 count`` unsigned bytes, and for Q8_0 the
    signed ones, whose signs the activations then take (``|q| * (x sign q) = q x``; llama.cpp's
    trick on AVX2, where ``x + 128`` would overflow ``vpmaddubsw``'s int16 pair sums; with VNNI,
    Q8_0 takes offset activations instead: ``OFFSET_ACTIVATIONS``)."""
    size = BLOCK * count
    if kind == "Q8_0":
        q = _signed_weights(builder, weights, b, count)
        absolute = declare(builder, f"llvm.abs.v{size}i8", vector(I8, size), [vector(I8, size), ir.IntType(1)])
        return builder.call(absolute, [q, ir.Constant(ir.IntType(1), 0)]), q  # |-128| wraps to 128: right unsigned
    half = BLOCK // 2
    packed = load_vector(builder, weights, builder.mul(b, constant(half, b)), vector(I8, half * count))
    low = builder.and_(packed, ir.Constant(vector(I8, half * count), [15] * (half * count)))
    high = builder.lshr(packed, ir.Constant(vector(I8, half * count), [4] * (half * count)))
    # Each block's low nibbles (its elements 0-15), then its high ones (16-31).
    order = [i for block in range(count) for i in (*range(half * block, half * block + half),
                                                    *range(half * (count + block), half * (count + block) + half))]
    return builder.shuffle_vector(low, high, ir.Constant(vector(I32, size), order)), None


def _dot_lanes(builder: ir.IRBuilder, isa: str, unsigned: ir.Value, signed: ir.Value, count: int,
               start: ir.Value | None = None) -> ir.Value:
    """The byte products of ``count`` blocks summed in eight int32 lanes a block (``<8 count x i32>``),
    added to ``start`` (VNNI only; zeros if none)."""
    lanes = vector(I32, LANES * count)
    if isa == "vnni":
        bits = 256 * count
        dpbusd = declare(builder, f"llvm.x86.avx512.vpdpbusd.{bits}", lanes, [lanes] * 3)
        if start is None:
            start = ir.Constant(lanes, [0] * (LANES * count))
        return builder.call(dpbusd, [start, builder.bitcast(unsigned, lanes), builder.bitcast(signed, lanes)])
    assert start is None, "the AVX2 dots start from zero"
    pairs = vector(I16, BLOCK // 2)
    maddubs = declare(builder, "llvm.x86.avx2.pmadd.ub.sw", pairs, [vector(I8, BLOCK)] * 2)
    maddwd = declare(builder, "llvm.x86.avx2.pmadd.wd", vector(I32, LANES), [pairs] * 2)
    parts = []
    for block in range(count):
        select = ir.Constant(vector(I32, BLOCK), list(range(BLOCK * block, BLOCK * block + BLOCK)))
        u = builder.shuffle_vector(unsigned, unsigned, select) if count > 1 else unsigned
        s = builder.shuffle_vector(signed, signed, select) if count > 1 else signed
        parts.append(builder.call(maddwd, [builder.call(maddubs, [u, s]), ir.Constant(pairs, [1] * (BLOCK // 2))]))
    if count == 1:
        return parts[0]
    return builder.shuffle_vector(parts[0], parts[1], ir.Constant(vector(I32, 2 * LANES), list(range(2 * LANES))))


def _make_ir_row_dot(kind: str, isa: str, rows: int) -> Callable:
    """The dot of one ``kind`` weight row with ``rows`` activation rows in LLVM IR for ``isa`` (see
    the module's docstring), two blocks at a time (16 lanes: one 512-bit ``vpdpbusd``), a last odd
    block alone. Each pair's weights are unpacked, and its scales widened, once for all the rows;
    for a row, a pair costs a load of its activations, the integer dot, its conversion to float, a
    load of the spread scales and a multiply, and one or two FMAs (the scaled dot; the minimum's or
    offset's correction, ``xs / 8`` in each of eight lanes times the weight's ``m`` or ``-8 d``).
    Each row's sum is ``ROW_CHAINS // rows`` accumulators over interleaved pairs: one FMA chain
    would make the loop wait out the FMA's latency every pair. Q8_0 with VNNI reads offset
    activations (:func:`takes_offset_activations`). The plain dots' arguments (``table`` unused:
    the CPU converts the scales)."""
    chains = max(1, ROW_CHAINS // rows)
    offset = {"Q4_0": -8.0, "Q4_1": 1.0, "Q8_0": 0.0}[kind]
    offset_x = takes_offset_activations(isa, kind)

    @intrinsic
    def row_dot(typingctx, wq, ws, wm, table, xq, xd8, xs8, m):  # noqa: ANN001, ANN202
        signature = (types.float32 if rows == 1 else types.UniTuple(types.float32, rows))(wq, ws, wm, table, xq, xd8,
                                                                                            xs8, m)

        def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
            wq_, ws_, wm_, _, xq_, xd8_, xs8_ = (context.make_array(t)(context, builder, a)
                                                 for t, a in zip(sig.args[:7], args[:7], strict=True))
            first = context.cast(builder, args[7], sig.args[7], types.intp)
            blocks = builder.extract_value(ws_.shape, 0)
            weights = builder.bitcast(wq_.data, I8.as_pointer())
            at = [builder.add(first, constant(r, first)) for r in range(rows)]
            activations = [row_pointer(builder, xq_, m_, I8) for m_ in at]
            scales_x = [row_pointer(builder, xd8_, m_, F32) for m_ in at]
            sums_x = [row_pointer(builder, xs8_, m_, F32) for m_ in at]
            accumulators = {count: [[cgutils.alloca_once_value(builder, ir.Constant(vector(F32, LANES * count),
                                                                                    [0.0] * (LANES * count)))
                                     for _ in range(chains if count == 2 else 1)] for _ in range(rows)]
                            for count in (1, 2)}

            def blocks_at(b: ir.Value, count: int, chain: int) -> None:
                floats = vector(F32, LANES * count)
                fma = declare(builder, f"llvm.fma.v{LANES * count}f32", floats, [floats] * 3)
                start = None
                if offset_x:  # the rows' dots start from -128 sum(q), a lane's part of it each
                    unsigned, q = _signed_weights(builder, weights, b, count), None
                    bytes128 = ir.Constant(vector(I8, BLOCK * count), [-128] * (BLOCK * count))
                    start = builder.neg(_dot_lanes(builder, isa, bytes128, unsigned, count))
                else:
                    unsigned, q = _weights_as_unsigned(builder, kind, weights, b, count)
                d = _spread_halves(builder, ws_.data, b, count)
                correction = None
                if kind == "Q4_1":
                    correction = _spread_halves(builder, wm_.data, b, count)
                elif offset:
                    correction = builder.fmul(d, ir.Constant(floats, [offset] * (LANES * count)))
                lane = builder.mul(b, constant(LANES, b))
                for r in range(rows):
                    x = load_vector(builder, activations[r], builder.mul(b, constant(BLOCK, b)),
                                     vector(I8, BLOCK * count))
                    if q is not None:  # x sign q (where q is 0, |q| is too: x may stay)
                        zeros = ir.Constant(vector(I8, BLOCK * count), [0] * (BLOCK * count))
                        negative = builder.icmp_signed("<", q, zeros)
                        x = builder.select(negative, builder.neg(x), x)
                    if offset_x:  # (x + 128) q - 128 q
                        dot = builder.sitofp(_dot_lanes(builder, isa, x, unsigned, count, start), floats)
                    else:
                        dot = builder.sitofp(_dot_lanes(builder, isa, unsigned, x, count), floats)
                    scale = builder.fmul(d, load_vector(builder, scales_x[r], lane, floats))
                    acc = accumulators[count][r][chain]
                    total = builder.call(fma, [dot, scale, builder.load(acc)])
                    if correction is not None:
                        total = builder.call(fma, [load_vector(builder, sums_x[r], lane, floats), correction, total])
                    builder.store(total, acc)

            step = 2 * chains  # blocks a round of the main loop
            groups = builder.udiv(blocks, constant(step, blocks))
            with cgutils.for_range(builder, groups) as loop:
                for chain in range(chains):
                    first_block = builder.mul(loop.index, constant(step, blocks))
                    blocks_at(builder.add(first_block, constant(2 * chain, blocks)), 2, chain)
            with cgutils.for_range_slice(builder, builder.mul(groups, constant(step, blocks)), blocks,
                                         constant(1, blocks)) as (b, _):
                blocks_at(b, 1, 0)
            reduce16 = declare(builder, "llvm.vector.reduce.fadd.v16f32", F32, [F32, vector(F32, 2 * LANES)])
            reduce8 = declare(builder, "llvm.vector.reduce.fadd.v8f32", F32, [F32, vector(F32, LANES)])
            totals = []
            for r in range(rows):
                pairs = builder.load(accumulators[2][r][0])
                for other in accumulators[2][r][1:]:
                    pairs = builder.fadd(pairs, builder.load(other))
                zero = ir.Constant(F32, 0.0)
                totals.append(builder.fadd(builder.call(reduce16, [zero, pairs], fastmath=("reassoc",)),
                                           builder.call(reduce8, [zero, builder.load(accumulators[1][r][0])],
                                                        fastmath=("reassoc",))))
            return totals[0] if rows == 1 else context.make_tuple(builder, sig.return_type, totals)

        return signature, codegen

    return row_dot


def _make_ir_dequantize_row(kind: str) -> Callable:
    """Weight row ``(wq, ws, wm)`` of ``kind`` as float32 into ``out`` (1-D), a block a vector: the
    loader's values exactly (its roundings: ``q * d``; ``(u - 8) * d`` as one FMA of ``u``, ``d`` and
    the exact ``-8 d``; ``u * d + m`` as a product, then a sum). The prefill's panels: LLVM leaves the
    plain loop's 32 int-to-float conversions a block scalar (docs/perf-log/quantized-weights.md)."""

    @intrinsic
    def dequantize(typingctx, wq, ws, wm, out):  # noqa: ANN001, ANN202
        signature = types.void(wq, ws, wm, out)

        def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
            wq_, ws_, wm_, out_ = (context.make_array(t)(context, builder, a)
                                   for t, a in zip(sig.args, args, strict=True))
            blocks = builder.extract_value(ws_.shape, 0)
            weights = builder.bitcast(wq_.data, I8.as_pointer())
            floats = vector(F32, BLOCK)
            with cgutils.for_range(builder, blocks) as loop:
                b = loop.index
                d = builder.shuffle_vector(_spread_halves(builder, ws_.data, b, 1),
                                           ir.Constant(vector(F32, LANES), None),
                                           ir.Constant(vector(I32, BLOCK), [0] * BLOCK))
                if kind == "Q8_0":
                    q = load_vector(builder, weights, builder.mul(b, constant(BLOCK, b)), vector(I8, BLOCK))
                    values = builder.fmul(builder.sitofp(q, floats), d)
                else:
                    u = builder.uitofp(_weights_as_unsigned(builder, kind, weights, b, 1)[0], floats)
                    if kind == "Q4_0":
                        fma = declare(builder, "llvm.fma.v32f32", floats, [floats] * 3)
                        values = builder.call(fma, [u, d, builder.fmul(d, ir.Constant(floats, [-8.0] * BLOCK))])
                    else:
                        m = builder.shuffle_vector(_spread_halves(builder, wm_.data, b, 1),
                                                   ir.Constant(vector(F32, LANES), None),
                                                   ir.Constant(vector(I32, BLOCK), [0] * BLOCK))
                        values = builder.fadd(builder.fmul(u, d), m)
                target = builder.gep(builder.bitcast(out_.data, F32.as_pointer()),
                                     [builder.mul(b, constant(BLOCK, b))])
                builder.store(values, builder.bitcast(target, floats.as_pointer()), align=4)
            return context.get_dummy_value()

        return signature, codegen

    return dequantize


#: ``kind -> dequantize(wq_row, ws_row, wm_row, out_row)``: a weight row as float32, in vector IR.
DEQUANTIZE_ROWS: dict[str, Callable] = {kind: _make_ir_dequantize_row(kind) for kind in KINDS}
_dequantize_q8_0, _dequantize_q4_0, _dequantize_q4_1 = (DEQUANTIZE_ROWS[kind] for kind in KINDS)


#: ``isa -> kind -> (one, four)``: the row dots of each implementation (see "the plain row dots").
ROW_DOTS: dict[str, dict[str, tuple[Callable, Callable]]] = {
    "plain": {kind: (one, _plain_four(one)) for kind, one in zip(KINDS, (_plain_q8_0, _plain_q4_0, _plain_q4_1),
                                                                  strict=True)},
    **{isa: {kind: (_make_ir_row_dot(kind, isa, 1), _make_ir_row_dot(kind, isa, 4)) for kind in KINDS}
       for isa in ("vnni", "avx2")},
}
#: The implementation this CPU runs (the first of :func:`available_isas`).
ISA = available_isas()[0]
#: Whether this CPU's Q8_0 dots read offset activations.
Q8_0_OFFSET = takes_offset_activations(ISA, "Q8_0")
(_q8_0_one, _q8_0_four), (_q4_0_one, _q4_0_four), (_q4_1_one, _q4_1_four) = (ROW_DOTS[ISA][kind] for kind in KINDS)


@njit(inline="always")
def weight_kind(quants, scales, minima):
    """0 for Q8_0 (int8 quants a row as long as the row), 1 for Q4_0 (nibbles), 2 for Q4_1 (minima)."""
    if quants.shape[1] == scales.shape[1] * BLOCK:
        return 0
    return 1 if minima.shape[1] == 0 else 2


@njit(inline="always")
def _dots_of_rows(kind, quants, scales, minima, table, xq, xd8, xs8, out, first, end):
    """``out[:, first:end]``: weight rows ``first .. end - 1`` with every activation row, four at a
    time, then one at a time; ``WEIGHT_TILE`` weight rows with one group of four activation rows
    before the next group, so that both stay in L1 (32 rows' activations and spread scales do not)."""
    rows = xq.shape[0]
    for tile in range(first, end, WEIGHT_TILE):
        m = 0
        while m + 4 <= rows:
            for n in range(tile, min(end, tile + WEIGHT_TILE)):
                wq, ws, wm = quants[n], scales[n], minima[n]
                if kind == 0:
                    a, b, c, d = _q8_0_four(wq, ws, wm, table, xq, xd8, xs8, m)
                elif kind == 1:
                    a, b, c, d = _q4_0_four(wq, ws, wm, table, xq, xd8, xs8, m)
                else:
                    a, b, c, d = _q4_1_four(wq, ws, wm, table, xq, xd8, xs8, m)
                out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = a, b, c, d
            m += 4
        while m < rows:
            for n in range(tile, min(end, tile + WEIGHT_TILE)):
                wq, ws, wm = quants[n], scales[n], minima[n]
                if kind == 0:
                    out[m, n] = _q8_0_one(wq, ws, wm, table, xq, xd8, xs8, m)
                elif kind == 1:
                    out[m, n] = _q4_0_one(wq, ws, wm, table, xq, xd8, xs8, m)
                else:
                    out[m, n] = _q4_1_one(wq, ws, wm, table, xq, xd8, xs8, m)
            m += 1


@njit(nogil=True, cache=True, parallel=True, error_model="numpy", fastmath=False)
def quantized_dot_rows_cpu(x, quants, scales, minima, table, bias, out, chunks):
    """``out = x @ W.T + bias`` for few rows of float32 ``x``, ``W`` quantized, ``x`` quantized to
    int8 first (see the module's docstring); the weight rows in ``chunks`` parts over numba's threads,
    each weight row read once for all rows of ``x``, each block unpacked once for four of them."""
    kind = weight_kind(quants, scales, minima)
    xq, xd, xs = quantized_activations(x, kind == 0 and Q8_0_OFFSET)
    rows, blocks = xd.shape
    xd8 = np.empty((rows, LANES * blocks), np.float32)
    xs8 = np.empty((rows, LANES * blocks), np.float32)
    spread_scales_cpu(xd, xs, xd8, xs8)
    cols = scales.shape[0]
    chunks = max(1, min(cols, chunks))
    for chunk in prange(chunks):
        _dots_of_rows(kind, quants, scales, minima, table, xq, xd8, xs8, out, chunk * cols // chunks,
                      (chunk + 1) * cols // chunks)
    add_bias(out, bias, 0, cols)


@njit(nogil=True, cache=True, parallel=True, fastmath=False)
def dequantize_rows_cpu(quants, scales, minima, table, first, out):
    """Rows ``first .. first + len(out) - 1`` of the weight as float32 into ``out`` (a prefill's panel
    for ``quantized_matmul.quantized_matmul_cpu``), a block a vector (``DEQUANTIZE_ROWS``: the
    loader's values exactly; ``table`` unused, kept for the plain twins' arguments). Here, beside the
    IR it calls: numba's cache keys a compiled function by its own file."""
    kind = weight_kind(quants, scales, minima)
    for r in prange(out.shape[0]):
        n = first + r
        if kind == 0:
            _dequantize_q8_0(quants[n], scales[n], minima[n], out[r])
        elif kind == 1:
            _dequantize_q4_0(quants[n], scales[n], minima[n], out[r])
        else:
            _dequantize_q4_1(quants[n], scales[n], minima[n], out[r])


@functools.cache  # one compile a process for each pair: a test calls it for each input
def row_dots(isa: str, kind: str) -> Callable:
    """A jitted ``(quants, scales, minima, table, xq, xd, xs, out)`` that fills ``out[m, n]`` with
    ``isa``'s row dots of ``kind`` for every weight row ``n`` and activation row ``m`` (four rows at
    a time, then one: both dots): the tests run every implementation this CPU has on one input
    through it (a closure: not in numba's disk cache; made once a process)."""
    one, four = ROW_DOTS[isa][kind]
    offset = takes_offset_activations(isa, kind)

    @njit(error_model="numpy", fastmath=False)
    def run(quants, scales, minima, table, xq, xd, xs, out):  # noqa: ANN001, ANN202
        if offset:
            xq = xq.copy()
            offset_activations_cpu(xq)
        xd8 = np.empty((xd.shape[0], LANES * xd.shape[1]), np.float32)
        xs8 = np.empty((xd.shape[0], LANES * xd.shape[1]), np.float32)
        spread_scales_cpu(xd, xs, xd8, xs8)
        for n in range(quants.shape[0]):
            wq, ws, wm = quants[n], scales[n], minima[n]
            m = 0
            while m + 4 <= xq.shape[0]:
                out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = four(wq, ws, wm, table, xq, xd8, xs8, m)
                m += 4
            while m < xq.shape[0]:
                out[m, n] = one(wq, ws, wm, table, xq, xd8, xs8, m)
                m += 1
    return run
