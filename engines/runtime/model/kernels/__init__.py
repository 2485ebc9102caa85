"""numba.cuda kernels of the Llama forward pass, each next to its numba CPU twin.

One module per op. A module holds the ``*_cuda`` kernel(s), the ``*_cpu`` twin computing
the same thing on the host, and ``CUDA_SIGNATURES``: the signatures the CUDA backend
launches each kernel with, where ``{dt}`` stands for the weight/KV storage dtype
(``float32`` or ``float16``), or for what the module's own ``SIGNATURE_DTYPES`` lists (the
quantized kernels: their quants' dtype). ``compile_check`` compiles every one of them for a real GPU.
``ops`` is the table of the backend's ops: each op's module, its cost and where it runs.

Conventions shared by all kernels: activations are float32 and C-contiguous; weights and
KV pages are in the storage dtype and are widened to float32 before any arithmetic, so
accumulation is always float32; scalar arguments are int64 or float32.
The CPU twins compile with ``error_model="numpy"``: under numba's default (Python's) error
model a float division checks its divisor for zero and may raise, and that branch keeps LLVM
from vectorising the loop (docs/perf-log/cpu-anchors.md#2026-11-25-vectorised-exp); their ``exp`` is
``fast_exp.exp_f32``, which vectorises where ``math.exp`` (a libm call) does not.
Compiled code copies arrays in loops, never by slice assignment (``a[i:j] = b``): numba
compiles that with a shape check whose error message is formatted in compiled code, which
drags in numba's string functions, 5-7 s of a cold start's compile per process that meets one
(docs/perf-log/serving-and-tools.md#first-start-compile-time); LLVM turns the loops into memcpy.
"""
STORAGE_DTYPES = ("float32", "float16")

__all__ = ["STORAGE_DTYPES"]
