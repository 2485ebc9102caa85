"""The terms of each kernel module's napkin math (its ``launch_cost``, llm.c's way: the bytes and
flops beside the kernel): what a launch costs, and an operand's bytes.

A launch's cost is the minimum its arithmetic needs: each operand read once, each result written
once. The profiler divides it by the launch's time (achieved GB/s and GFLOP/s).
"""
from typing import Any, Callable

import numpy as np

__all__ = ["Cost", "LaunchCost", "nbytes"]

#: ``(table name, bytes moved, flops done)`` of one launch; the name is the op's, or a finer one
#: (``"matmul 2048x8192"``: each shape a row of the profile's table).
LaunchCost = tuple[str, int, int]
#: An op's ``launch_cost(args, kv_positions, attended)``: ``args`` as the backend's method takes
#: them; attention's cost depends on the step too: ``kv_positions`` cached positions read (all
#: sequences), ``attended`` (query, position) pairs.
Cost = Callable[[tuple[Any, ...], int, int], LaunchCost]


def nbytes(array: Any) -> int:
    """The bytes of ``array``: a host or device array, or a quantized weight (its own ``nbytes``)."""
    if not hasattr(array, "dtype"):  # a quantized weight (model.quant.quantized_weight): its own bytes
        return int(array.nbytes)
    return int(np.prod(array.shape)) * np.dtype(array.dtype).itemsize
