"""SwiGLU activation: ``out = silu(gate) * up`` over the fused gate/up projection.

``gate_up[t]`` is ``[gate (intermediate) | up (intermediate)]``: the two projections are
one matmul (weights concatenated at load time), and this kernel halves the width.
"""
import math

from numba import cuda, float32, njit


@cuda.jit(cache=True)
def silu_mul_cuda(gate_up, out):
    """Grid ``(num_tokens, ceil(intermediate / blockDim.x))``, one thread per output element."""
    t = cuda.blockIdx.x
    i = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    width = out.shape[1]
    if i < width:
        g = gate_up[t, i]
        out[t, i] = g / (float32(1.0) + math.exp(-g)) * gate_up[t, width + i]


@njit(nogil=True, cache=True)
def silu_mul_cpu(gate_up, out):
    """CPU twin of :func:`silu_mul_cuda`."""
    width = out.shape[1]
    for t in range(out.shape[0]):
        for i in range(width):
            g = gate_up[t, i]
            out[t, i] = g / (float32(1.0) + math.exp(-g)) * gate_up[t, width + i]


CUDA_SIGNATURES = {
    silu_mul_cuda: "void(float32[:, ::1], float32[:, ::1])",
}
