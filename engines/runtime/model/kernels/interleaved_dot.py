"""``out = x @ W.T + bias``, ``W`` quantized and interleaved (``interleaved_weight``), ``x``
quantized to int8 blocks as in :mod:`.quantized_dot`: the CPU's integer dots with a lane an output.

Each step of the kernel takes one part of a block of one group (16 weight rows, four bytes each:
one 64-byte load) and four bytes of an activation row broadcast to every lane, and adds their
products into 16 int32 lanes, one a weight row: a ``vpdpbusd`` (VNNI) or ``vpmaddubsw`` +
``vpmaddwd`` on each 32-byte half (AVX2). After a block's parts (8 for Q8_0, 4 for the nibbles,
each twice: low and high nibbles), its 16 sums become floats and meet the scales in two vector
operations: ``acc += float(dot) * x_d * w_d`` (and for Q4 ``+ w_m * x_s``, with ``w_m = -8 w_d`` for
Q4_0), 16 outputs at a time. So no lane holds a partial sum that must be added across lanes, and
no scale is spread: per block and activation row, a part's dot and three vector operations, where
the row-major kernels (:mod:`.quantized_dot`) pay a conversion, a product and one or two FMAs for
every two blocks of every single output, and a reduction a row.

One activation row alone (a batch-1 decode step) is bound by memory, not arithmetic: on an Intel
Xeon core the hardware prefetcher alone kept it at half a plain read's rate of the same bytes from
memory, so there it asks for each weight line ``PREFETCH_BYTES`` ahead of its load
(``llvm.prefetch``): 1.4x from memory, 1.15x a SmolLM2 step (docs/perf-log/quantized-weights.md).

Up to four activation rows share each load of weights (``ROWS``); a prefill goes through the same
kernel in tiles of ``ROW_TILE`` rows, each group's weights (9-24 KB for SmolLM2) read from L1 for
the whole tile. Q8_0's signed quants meet the activations as in :mod:`.quantized_dot`: offset
activations with VNNI (each block's sums start from ``-128 sum(q)``, made once for all rows), the
sign trick on AVX2 (``|q|`` and ``x`` with ``q``'s signs, ``vpsignb``).

The plain twin (``_plain_group``) is the CPU's path without AVX2 and the reference the tests diff
the IR against; both against ``quantized_dot.quantized_dot_reference`` (dequantize-then-float64).
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np
from llvmlite import binding, ir
from numba import float32, get_num_threads, int32, njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from engines.runtime.model.quant.interleaved_weight import GROUP, PART_BYTES
from engines.runtime.model.kernels.matmul import add_bias
from engines.runtime.model.kernels.llvm_ir import F32, I8, I16, I32, constant, declare, load_vector, row_pointer, vector
from engines.runtime.model.kernels.quantized_dot import (KINDS, available_isas, offset_activations_cpu,
                                                         quantize_activations_cpu, quantized_activations,
                                                         takes_offset_activations)
from engines.runtime.model.quant.quantized_weight import BLOCK

__all__ = ["GROUP_DOTS", "ISA", "ROWS", "ROW_TILE", "chunks", "group_dots", "group_rows", "interleaved_dot_rows_cpu",
           "interleaved_embedding_cpu", "interleaved_kind", "quantize_input"]

#: How far ahead of its loads a one-row group dot asks for its weights' lines (0: it does not). On
#: the Intel Xeon measured, any of 512 to 4096 bytes ran alike; AMD's cores (numba's CPU names
#: ``znver*``) are left to their own prefetchers: unmeasured with it there.
PREFETCH_BYTES = 0 if (config.CPU_NAME or binding.get_host_cpu_name()).startswith("znver") else 1024  # type: ignore[attr-defined]
#: Activation rows one call of a group dot takes (each load of weights serves them all).
ROWS = 4
#: Activation rows a prefill takes through every group of a thread's share before the next rows.
ROW_TILE = 32
#: Groups a thread's share is cut into, a few a thread (so that the last to finish waits little).
CHUNKS_PER_THREAD = 4


# ---------------------------------------------------------------------- the plain group dot


@njit(inline="always")
def interleaved_kind(quants, scales, minima):
    """0 for Q8_0 (512 bytes a block of a group), 1 for Q4_0, 2 for Q4_1 (minima)."""
    if quants.shape[1] == (scales.shape[1] // GROUP) * GROUP * BLOCK:
        return 0
    return 1 if minima.shape[1] == 0 else 2


@njit(nogil=True, error_model="numpy", fastmath=False)
def _plain_group(wq, ws, wm, table, xq, xd, xs, g, m, rows, out):
    """``out[m .. m + rows - 1, 16g .. 16g + 15]``, the plain loops (``xq`` not offset)."""
    kind = interleaved_kind(wq, ws, wm)
    blocks = ws.shape[1] // GROUP
    per_block = wq.shape[1] // blocks
    for r in range(m, m + rows):
        for lane in range(GROUP):
            total = float32(0.0)
            for b in range(blocks):
                dot = int32(0)
                for p in range(per_block // (GROUP * PART_BYTES)):
                    at = b * per_block + p * GROUP * PART_BYTES + lane * PART_BYTES
                    for t in range(PART_BYTES):
                        if kind == 0:
                            # (int8 whatever the array's dtype: the compiled step passes uint8 views)
                            dot += int32(np.int8(wq[g, at + t])) * int32(xq[r, BLOCK * b + PART_BYTES * p + t])
                        else:
                            u = int32(np.uint8(wq[g, at + t]))
                            dot += ((u & 15) * int32(xq[r, BLOCK * b + PART_BYTES * p + t])
                                    + (u >> 4) * int32(xq[r, BLOCK * b + 16 + PART_BYTES * p + t]))
                d = table[ws[g, GROUP * b + lane]]
                total += float32(dot) * xd[r, b] * d
                if kind == 1:
                    total += float32(-8.0) * d * xs[r, b]
                elif kind == 2:
                    total += table[wm[g, GROUP * b + lane]] * xs[r, b]
            out[r, GROUP * g + lane] = total


# ----------------------------------------------------------------------- the IR group dots


def _broadcast4(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value) -> ir.Value:
    """The four bytes at ``base + offset`` in every int32 lane of 64 bytes (``vpbroadcastd``)."""
    word = builder.load(builder.bitcast(builder.gep(base, [offset]), I32.as_pointer()), align=1)
    lanes = vector(I32, GROUP)
    one = builder.insert_element(ir.Constant(lanes, None), word, ir.Constant(I32, 0))
    spread = builder.shuffle_vector(one, one, ir.Constant(lanes, [0] * GROUP))
    return builder.bitcast(spread, vector(I8, GROUP * PART_BYTES))


def _splat(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """A float in every lane of ``<16 x float>``."""
    floats = vector(F32, GROUP)
    one = builder.insert_element(ir.Constant(floats, None), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(vector(I32, GROUP), [0] * GROUP))


def _add_products(builder: ir.IRBuilder, isa: str, total: ir.Value, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
    """``total`` (16 int32) plus the sums of each lane's four unsigned-by-signed byte products."""
    lanes = vector(I32, GROUP)
    if isa == "vnni":
        dpbusd = declare(builder, "llvm.x86.avx512.vpdpbusd.512", lanes, [lanes] * 3)
        return builder.call(dpbusd, [total, builder.bitcast(unsigned, lanes), builder.bitcast(signed, lanes)])
    half = vector(I8, 32)
    pairs = vector(I16, 16)
    maddubs = declare(builder, "llvm.x86.avx2.pmadd.ub.sw", pairs, [half, half])
    maddwd = declare(builder, "llvm.x86.avx2.pmadd.wd", vector(I32, 8), [pairs, pairs])
    sums = []
    for part in range(2):
        pick = ir.Constant(vector(I32, 32), list(range(32 * part, 32 * part + 32)))
        u = builder.shuffle_vector(unsigned, unsigned, pick)
        s = builder.shuffle_vector(signed, signed, pick)
        sums.append(builder.call(maddwd, [builder.call(maddubs, [u, s]), ir.Constant(pairs, [1] * 16)]))
    return builder.add(total, builder.shuffle_vector(sums[0], sums[1], ir.Constant(lanes, list(range(GROUP)))))


def _halves(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value) -> ir.Value:
    """16 halves (uint16 bits) at ``base + offset`` as ``<16 x float>`` (``vcvtph2ps``)."""
    bits = load_vector(builder, base, offset, vector(I16, GROUP))
    return builder.fpext(builder.bitcast(bits, vector(ir.HalfType(), GROUP)), vector(F32, GROUP))


def _prefetch(builder: ir.IRBuilder, address: ir.Value) -> None:
    """Ask for the line at ``address`` (an ``i8*``) into every cache level (``prefetcht0``: a read;
    an address past the array's end does not fault)."""
    prefetch = declare(builder, "llvm.prefetch.p0i8", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    builder.call(prefetch, [address, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _make_group_dot(kind: str, isa: str, rows: int) -> Callable:
    """``dot(wq, ws, wm, table, xq, xd, xs, g, m, out)``: ``out[m .. m + rows - 1, 16g .. 16g + 15]``
    for ``kind`` weights in LLVM IR for ``isa`` (the module's docstring; ``table`` unused, kept for
    the plain twin's arguments). One row alone keeps two int32 chains a block (even and odd parts),
    so that it does not wait out each ``vpdpbusd``'s latency, and asks for its weights
    ``PREFETCH_BYTES`` ahead."""
    offset_x = takes_offset_activations(isa, kind)
    parts = (BLOCK if kind == "Q8_0" else BLOCK // 2) // PART_BYTES
    per_block = parts * GROUP * PART_BYTES
    chains = 2 if rows == 1 else 1

    @intrinsic
    def group_dot(typingctx, wq, ws, wm, table, xq, xd, xs, g, m, out):  # noqa: ANN001, ANN202
        signature = types.void(wq, ws, wm, table, xq, xd, xs, g, m, out)

        def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
            wq_, ws_, wm_, _, xq_, xd_, xs_ = (context.make_array(t)(context, builder, a)
                                               for t, a in zip(sig.args[:7], args[:7], strict=True))
            out_ = context.make_array(sig.args[9])(context, builder, args[9])
            group = context.cast(builder, args[7], sig.args[7], types.intp)
            first = context.cast(builder, args[8], sig.args[8], types.intp)
            blocks = builder.udiv(builder.extract_value(ws_.shape, 1), constant(GROUP, group))
            weights = row_pointer(builder, wq_, group, I8)
            scales = row_pointer(builder, ws_, group, I16)
            minima = row_pointer(builder, wm_, group, I16)
            at = [builder.add(first, constant(r, first)) for r in range(rows)]
            x_rows = [row_pointer(builder, xq_, m_, I8) for m_ in at]
            xd_rows = [row_pointer(builder, xd_, m_, F32) for m_ in at]
            xs_rows = [row_pointer(builder, xs_, m_, F32) for m_ in at]
            floats, lanes = vector(F32, GROUP), vector(I32, GROUP)
            fma = declare(builder, "llvm.fma.v16f32", floats, [floats] * 3)
            zero_f, zero_i = ir.Constant(floats, [0.0] * GROUP), ir.Constant(lanes, [0] * GROUP)
            accumulators = [cgutils.alloca_once_value(builder, zero_f) for _ in range(rows)]
            with cgutils.for_range(builder, blocks) as loop:
                b = loop.index
                d = _halves(builder, scales, builder.mul(b, constant(GROUP, b)))
                correction = None
                if kind == "Q4_1":
                    correction = _halves(builder, minima, builder.mul(b, constant(GROUP, b)))
                elif kind == "Q4_0":
                    correction = builder.fmul(d, ir.Constant(floats, [-8.0] * GROUP))
                sums = [[zero_i] * chains for _ in range(rows)]
                bias = zero_i  # offset activations: 128 sum(q), subtracted from each row's sums
                x_at = builder.mul(b, constant(BLOCK, b))
                for p in range(parts):
                    at_part = builder.add(builder.mul(b, constant(per_block, b)), constant(p * GROUP * PART_BYTES, b))
                    if rows == 1 and PREFETCH_BYTES:
                        _prefetch(builder, builder.gep(weights, [builder.add(at_part, constant(PREFETCH_BYTES, b))]))
                    w = load_vector(builder, weights, at_part, vector(I8, GROUP * PART_BYTES))
                    chain = p % chains
                    x_low = builder.add(x_at, constant(PART_BYTES * p, b))
                    if kind == "Q8_0":
                        if offset_x:
                            bias = _add_products(builder, isa, bias, ir.Constant(w.type, [-128] * (GROUP * 4)), w)
                            unsigned = None
                        else:
                            absolute = declare(builder, "llvm.abs.v64i8", w.type, [w.type, ir.IntType(1)])
                            unsigned = builder.call(absolute, [w, ir.Constant(ir.IntType(1), 0)])
                        for r in range(rows):
                            x = _broadcast4(builder, x_rows[r], x_low)
                            if offset_x:
                                sums[r][chain] = _add_products(builder, isa, sums[r][chain], x, w)
                            else:
                                zeros = ir.Constant(w.type, [0] * (GROUP * 4))
                                signed = builder.select(builder.icmp_signed("<", w, zeros), builder.neg(x), x)
                                sums[r][chain] = _add_products(builder, isa, sums[r][chain], unsigned, signed)
                    else:
                        low = builder.and_(w, ir.Constant(w.type, [15] * (GROUP * 4)))
                        high = builder.lshr(w, ir.Constant(w.type, [4] * (GROUP * 4)))
                        x_high = builder.add(x_low, constant(BLOCK // 2, b))
                        for r in range(rows):
                            total = _add_products(builder, isa, sums[r][chain], low,
                                                  _broadcast4(builder, x_rows[r], x_low))
                            sums[r][chain] = _add_products(builder, isa, total, high,
                                                           _broadcast4(builder, x_rows[r], x_high))
                for r in range(rows):
                    dot = sums[r][0]
                    for other in sums[r][1:]:
                        dot = builder.add(dot, other)
                    if offset_x:
                        dot = builder.sub(dot, bias)
                    x_d = _splat(builder, builder.load(builder.gep(xd_rows[r], [b])))
                    total = builder.call(fma, [builder.fmul(builder.sitofp(dot, floats), x_d), d,
                                               builder.load(accumulators[r])])
                    if correction is not None:
                        x_s = _splat(builder, builder.load(builder.gep(xs_rows[r], [b])))
                        total = builder.call(fma, [correction, x_s, total])
                    builder.store(total, accumulators[r])
            column = builder.mul(group, constant(GROUP, group))
            for r in range(rows):
                target = builder.gep(row_pointer(builder, out_, at[r], F32), [column])
                builder.store(builder.load(accumulators[r]), builder.bitcast(target, floats.as_pointer()), align=4)
            return context.get_dummy_value()

        return signature, codegen

    return group_dot


def _plain_rows(rows: int) -> Callable:
    @njit(nogil=True, error_model="numpy", fastmath=False)
    def dot(wq, ws, wm, table, xq, xd, xs, g, m, out):  # noqa: ANN001, ANN202
        _plain_group(wq, ws, wm, table, xq, xd, xs, g, m, rows, out)
    return dot


#: ``isa -> kind -> (one row, ROWS rows)``: the group dots of each implementation.
GROUP_DOTS: dict[str, dict[str, tuple[Callable, Callable]]] = {
    "plain": dict.fromkeys(KINDS, (_plain_rows(1), _plain_rows(ROWS))),
    **{isa: {kind: (_make_group_dot(kind, isa, 1), _make_group_dot(kind, isa, ROWS)) for kind in KINDS}
       for isa in ("vnni", "avx2")},
}
#: The implementation this CPU runs (the first of ``quantized_dot.available_isas``).
ISA = available_isas()[0]
#: Whether this CPU's Q8_0 group dots read offset activations.
Q8_0_OFFSET = takes_offset_activations(ISA, "Q8_0")
def _rows_loop(one: Callable, many: Callable) -> Callable:
    """``loop(wq, ws, wm, table, xq, xd, xs, out, first, end, m0, m1)``: groups ``first .. end - 1``
    with activation rows ``m0 .. m1 - 1``, ``ROWS`` at a time through ``many``, the rest through ``one``."""
    @njit(inline="always")
    def loop(wq, ws, wm, table, xq, xd, xs, out, first, end, m0, m1):  # noqa: ANN001, ANN202
        for g in range(first, end):
            m = m0
            while m + ROWS <= m1:
                many(wq, ws, wm, table, xq, xd, xs, g, m, out)
                m += ROWS
            while m < m1:
                one(wq, ws, wm, table, xq, xd, xs, g, m, out)
                m += 1
    return loop


_q8_0_loop, _q4_0_loop, _q4_1_loop = (_rows_loop(*GROUP_DOTS[ISA][kind]) for kind in KINDS)


@njit(inline="always")
def group_rows(quants, scales, minima, table, xq, xd, xs, out, first, end, m0, m1):
    """``out[m0 .. m1 - 1, 16 first .. 16 end - 1]`` (no bias): groups ``first .. end - 1`` against
    activation rows ``m0 .. m1 - 1`` (quantized by :func:`quantize_input`), this CPU's group dots
    for the weight's kind. Its quants may be int8 or a uint8 view of them."""
    kind = interleaved_kind(quants, scales, minima)
    if kind == 0:
        _q8_0_loop(quants, scales, minima, table, xq, xd, xs, out, first, end, m0, m1)
    elif kind == 1:
        _q4_0_loop(quants, scales, minima, table, xq, xd, xs, out, first, end, m0, m1)
    else:
        _q4_1_loop(quants, scales, minima, table, xq, xd, xs, out, first, end, m0, m1)


@njit(inline="always")
def quantize_input(x, quants, scales, minima, xq, xd, xs):
    """``x`` quantized into ``xq, xd, xs`` (shaped for it) as :func:`group_rows` reads it against
    this weight (offset for this CPU's Q8_0 dots where they take it so)."""
    quantize_activations_cpu(x, xq, xd, xs)
    if interleaved_kind(quants, scales, minima) == 0 and Q8_0_OFFSET:
        offset_activations_cpu(xq)


@njit(nogil=True, cache=True, parallel=True, error_model="numpy", fastmath=False)
def interleaved_dot_rows_cpu(x, quants, scales, minima, table, bias, out, chunks):
    """``out = x @ W.T + bias`` for float32 ``x`` of any number of rows, ``W`` interleaved, ``x``
    quantized to int8 blocks first; the groups in ``chunks`` parts over numba's threads, the rows in
    tiles of ``ROW_TILE`` within each part."""
    kind = interleaved_kind(quants, scales, minima)
    xq, xd, xs = quantized_activations(x, kind == 0 and Q8_0_OFFSET)
    rows = x.shape[0]
    groups = quants.shape[0]
    chunks = max(1, min(groups, chunks))
    for chunk in prange(chunks):
        first, end = chunk * groups // chunks, (chunk + 1) * groups // chunks
        for m0 in range(0, rows, ROW_TILE):
            group_rows(quants, scales, minima, table, xq, xd, xs, out, first, end, m0, min(rows, m0 + ROW_TILE))
    add_bias(out, bias, 0, GROUP * groups)


def chunks() -> int:
    """The parts :func:`interleaved_dot_rows_cpu` cuts the groups into (numba's thread count read
    here: read in compiled code, it would keep the kernel out of numba's cache)."""
    return CHUNKS_PER_THREAD * get_num_threads()


@functools.cache  # one compile a process for each pair: a test calls it for each input
def group_dots(isa: str, kind: str) -> Callable:
    """A jitted ``(quants, scales, minima, table, xq, xd, xs, out)`` filling ``out`` with ``isa``'s
    group dots of ``kind`` (``ROWS`` rows at a time, then one; ``xq`` as quantized, offset here
    where ``isa`` needs it): the tests run every implementation this CPU has on one input."""
    loop = _rows_loop(*GROUP_DOTS[isa][kind])
    offset = takes_offset_activations(isa, kind)

    @njit(error_model="numpy", fastmath=False)
    def run(quants, scales, minima, table, xq, xd, xs, out):  # noqa: ANN001, ANN202
        if offset:  # the caller's xq untouched
            xq = xq.copy()
            offset_activations_cpu(xq)
        loop(quants, scales, minima, table, xq, xd, xs, out, 0, quants.shape[0], 0, xq.shape[0])
    return run


@njit(nogil=True, cache=True, fastmath=False)
def interleaved_embedding_cpu(token_ids, quants, scales, minima, table, out):
    """``out[t] = W[token_ids[t]]`` for an interleaved table: the rows dequantized exactly (the
    loader's values: ``q * d``, ``(u - 8) * d``, ``u * d + m``)."""
    kind = interleaved_kind(quants, scales, minima)
    blocks = scales.shape[1] // GROUP
    per_block = quants.shape[1] // blocks
    for t in range(token_ids.shape[0]):
        g, lane = token_ids[t] // GROUP, token_ids[t] % GROUP
        for b in range(blocks):
            d = table[scales[g, GROUP * b + lane]]
            for p in range(per_block // (GROUP * PART_BYTES)):
                at = b * per_block + p * GROUP * PART_BYTES + lane * PART_BYTES
                for i in range(PART_BYTES):
                    k = BLOCK * b + PART_BYTES * p + i
                    if kind == 0:
                        out[t, k] = float32(np.int8(quants[g, at + i])) * d
                        continue
                    u = int32(np.uint8(quants[g, at + i]))
                    if kind == 1:
                        out[t, k] = float32((u & 15) - 8) * d
                        out[t, k + 16] = float32((u >> 4) - 8) * d
                    else:
                        m = table[minima[g, GROUP * b + lane]]
                        out[t, k] = float32(u & 15) * d + m
                        out[t, k + 16] = float32(u >> 4) * d + m
