"""SwiGLU activation: ``out = silu(gate) * up`` over the fused gate/up projection.

``gate_up[t]`` is ``[gate (intermediate) | up (intermediate)]``: the two projections are
one matmul (weights concatenated at load time), and this kernel halves the width.
"""
import math
from typing import Any

import numpy as np
from numba import cuda, float32, njit, prange

from engines.runtime.model.kernels.fast_exp import exp_f32
from engines.runtime.model.kernels.launch_cost import LaunchCost, nbytes
from engines.runtime.model.kernels.variants import renamed
from engines.runtime.model.kernels.vector_width import prefer_wide_vectors


@cuda.jit(cache=True)
def silu_mul_cuda(gate_up, out):
    """Grid ``(num_tokens, ceil(intermediate / blockDim.x))``, one thread per output element."""
    t = cuda.blockIdx.x
    i = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    width = out.shape[1]
    if i < width:
        g = gate_up[t, i]
        out[t, i] = g / (float32(1.0) + math.exp(-g)) * gate_up[t, width + i]


def _silu_mul(gate_up, out):
    width = out.shape[1]
    for t in prange(out.shape[0]):
        prefer_wide_vectors()  # bound by exp's arithmetic and the division: 512-bit vectors where the CPU has them
        for i in range(width):
            g = gate_up[t, i]
            out[t, i] = g / (float32(1.0) + exp_f32(-g)) * gate_up[t, width + i]


_JIT: dict[str, Any] = dict(nogil=True, cache=True, error_model="numpy", fastmath=False)
silu_mul_cpu = njit(parallel=True, **_JIT)(renamed(_silu_mul, "silu_mul_cpu"))
silu_mul_cpu.__doc__ = """CPU twin of :func:`silu_mul_cuda`, rows over numba's threads (decode steps), ``exp`` from
``fast_exp`` so that each row is a vector loop."""
silu_mul_serial_cpu = njit(**_JIT)(renamed(_silu_mul, "silu_mul_serial_cpu"))
silu_mul_serial_cpu.__doc__ = """Single-threaded :func:`silu_mul_cpu`, for steps whose matmuls go to BLAS (prefill): a
numba thread pool spinning after its loop would take the cores BLAS's threads need next."""


CUDA_SIGNATURES = {
    silu_mul_cuda: "void(float32[:, ::1], float32[:, ::1])",
}


def launch_cost(args: tuple[Any, ...], kv_positions: int, attended: int) -> LaunchCost:
    """The backend's ``silu_mul(gate_up, out)``."""
    gate_up, out = args
    return "silu_mul", nbytes(gate_up) + nbytes(out), 5 * int(np.prod(out.shape))
