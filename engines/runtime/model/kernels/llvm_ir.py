"""The LLVM IR building blocks of the CPU kernels written as numba ``@intrinsic``s (numba has no
vector types): the scalar types, vector types, declarations of LLVM's intrinsics, unaligned vector
loads and row pointers into numba arrays. ``quantized_dot`` (row-major quantized weights) and
``interleaved_dot`` (interleaved ones) both build their dots from these; what each kernel computes
stays in its own module.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

__all__ = ["F32", "I8", "I16", "I32", "constant", "declare", "load_vector", "row_pointer", "vector"]

I8, I16, I32, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def vector(element: ir.Type, count: int) -> ir.VectorType:
    """``<count x element>``."""
    return ir.VectorType(element, count)


def declare(builder: ir.IRBuilder, name: str, returns: ir.Type, arguments: list[ir.Type]) -> ir.Function:
    """The function ``name`` (an LLVM intrinsic: ``llvm.fma.v16f32``) in ``builder``'s module,
    declared there the first time."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(returns, arguments), name)


def load_vector(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value, vector: ir.VectorType) -> ir.Value:
    """``vector`` from ``base + offset`` (elements of ``base``'s type), unaligned."""
    return builder.load(builder.bitcast(builder.gep(base, [offset]), vector.as_pointer()), align=1)


def row_pointer(builder: ir.IRBuilder, array: object, row: ir.Value, element: ir.Type) -> ir.Value:
    """A pointer to row ``row`` of a 2-D numba array (its own strides)."""
    stride = builder.extract_value(array.strides, 0)  # type: ignore[attr-defined]
    start = builder.gep(builder.bitcast(array.data, I8.as_pointer()), [builder.mul(row, stride)])  # type: ignore[attr-defined]
    return builder.bitcast(start, element.as_pointer())


def constant(value: int, like: ir.Value) -> ir.Constant:
    """``value`` as a constant of ``like``'s type (a loop index's, say)."""
    return ir.Constant(like.type, value)
