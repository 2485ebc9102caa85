"""One shared array per block and call site in numba-cuda's CUDA simulator, however its threads
interleave.

The simulator (numba-cuda 0.30.4, ``simulator.kernelapi.FakeCUDAShared.array``) gives a block's
threads their shared array by looking its call site up in a dict and storing a new array there
if there is none. Two threads that both look before either stores get two arrays, and what one
writes there the others never read: ``quantized_gemv_cuda``'s partial sums went missing so, in
column 0 of its first row of blocks, once in a full suite (docs/perf-log/ci-time.md). Here the
look-up and the store are one step (``dict.setdefault``, atomic under the GIL).
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np


def make_shared_arrays_once() -> None:
    """Replace the simulator's ``FakeCUDAShared.array`` with one whose look-up and store are one."""
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    simulators = kernelapi.FakeCUDAShared.array

    def array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> np.ndarray:  # noqa: ANN401 - numba's
        if shape == 0 or alignment is not None:  # dynamic shared memory (one buffer), or the simulator's error
            return simulators(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)  # the kernel's line, as the simulator keys it
        return self._allocations.setdefault((caller.f_code.co_filename, caller.f_lineno), np.empty(shape, dtype))

    kernelapi.FakeCUDAShared.array = array
