"""Sixteen-byte loads for the CUDA kernels: eight weights (or activations) in one instruction.

A GPU streams memory fastest when each thread of a warp loads 16 contiguous bytes (a warp then
moves 512 bytes an instruction; with 2-byte float16 loads it moves 64, and keeping enough bytes
in flight to cover the memory's latency would need eight times as many loads). numba.cuda has
no vector loads of its own, so :func:`load8` is an ``@intrinsic`` that loads ``<8 x half>`` (one
16-byte load) or ``<8 x float>`` (two), widened to float32, as an 8-tuple: llm.c's ``x128``.

The element ``a[row, col]`` must sit on a 16-byte boundary: ``col`` a multiple of 8 and each row
a multiple of 16 bytes long (device allocations start on 256-byte boundaries). Callers check that
before choosing a kernel that uses it.

Under the CUDA simulator :func:`load8` is plain Python (the simulator runs kernels as Python and
has no intrinsics). On a GPU a float16 chunk comes through inline PTX (``ld.global.nc.v4.u32``),
a float32 one as two ``ld.global.v4.f32``; ``python -m engines.runtime.model.kernels.compile_check``
compiles the real one, tests/runtime/model/test_wide_load.py checks those instructions in the PTX,
and the GPU tests (``ENGINES_TEST_GPU=1``) run it against the CPU twins.
"""
from __future__ import annotations

from typing import Any

import numba
import numpy as np

#: Elements one :func:`load8` reads.
CHUNK = 8
#: Bytes a row must be a multiple of for :func:`load8` (and where its chunks start).
ALIGNMENT = 16

SIMULATED = bool(numba.config.ENABLE_CUDASIM)  # type: ignore[attr-defined]  # numba sets it at import


def loadable(array: Any) -> bool:
    """Whether every row of 2-D ``array`` starts on a 16-byte boundary and holds whole chunks."""
    inner = array.shape[1]
    return inner % CHUNK == 0 and (inner * np.dtype(array.dtype).itemsize) % ALIGNMENT == 0


if SIMULATED:
    def load8(a: Any, row: int, col: int) -> tuple[np.float32, ...]:
        """``a[row, col:col + 8]`` as eight float32 values (the simulator's stand-in)."""
        return tuple(np.float32(v) for v in a[row, col:col + CHUNK])
else:
    from llvmlite import ir
    from numba.cuda import cgutils  # type: ignore[attr-defined]  # numba-cuda's (mypy reads numba's bundled one)
    from numba.cuda.extending import intrinsic
    from numba.core import types

    @intrinsic
    def load8(typingctx: Any, a: Any, row: Any, col: Any) -> Any:
        """``a[row, col:col + 8]`` of a 2-D float16 or float32 array, as eight float32 values,
        read by one vector load (aligned to 16 bytes: see the module's docstring)."""
        if not (isinstance(a, types.Array) and a.ndim == 2 and a.dtype in (types.float16, types.float32)
                and isinstance(row, types.Integer) and isinstance(col, types.Integer)):
            return None
        signature = types.UniTuple(types.float32, CHUNK)(a, row, col)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            array_type, row_type, col_type = sig.args
            array = context.make_array(array_type)(context, builder, value=args[0])
            indices = [context.cast(builder, value, kind, types.intp)
                       for value, kind in ((args[1], row_type), (args[2], col_type))]
            pointer = cgutils.get_item_pointer(context, builder, array_type, array, indices, wraparound=False)
            if array_type.dtype == types.float16:
                # The load is inline PTX: as plain IR, LLVM folded the widening into the load and
                # split it into narrower ones (``ld.global.v4.b16`` and scalar loads in the PTX).
                # ``.nc``: the read-only data path, for weights no kernel writes.
                word = ir.IntType(32)
                load = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([word] * 4), [pointer.type]),
                                    "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
                words = builder.call(load, [pointer])
                packed = ir.Constant(ir.VectorType(word, 4), None)
                for i in range(4):
                    packed = builder.insert_element(packed, builder.extract_value(words, i), ir.Constant(word, i))
                vector = builder.fpext(builder.bitcast(packed, ir.VectorType(ir.HalfType(), CHUNK)),
                                       ir.VectorType(ir.FloatType(), CHUNK))
            else:
                vector = builder.load(builder.bitcast(pointer, ir.VectorType(ir.FloatType(), CHUNK).as_pointer()),
                                      align=ALIGNMENT)
            items = [builder.extract_element(vector, ir.Constant(ir.IntType(32), i)) for i in range(CHUNK)]
            return context.make_tuple(builder, sig.return_type, items)

        return signature, codegen
