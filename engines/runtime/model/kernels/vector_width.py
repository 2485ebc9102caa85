"""``prefer_wide_vectors()``: let LLVM vectorise the function being compiled with 512-bit vectors.

LLVM vectorises for Intel's AVX-512 server cores (Skylake-SP to Emerald Rapids) with 256-bit
vectors by default: their tuning prefers them (``prefer-256-bit``), from the days when 512-bit
instructions lowered those cores' clocks. numba compiles for the host CPU and inherits that. In a
loop bound by arithmetic, the few-row matmul of a batched decode step, it leaves half of each FMA
unit idle: on an Emerald Rapids core ``matmul_rows_cpu`` at 8 to 32 rows ran clearly faster with
512-bit vectors, and at 1 to 4 rows, bound by memory, unchanged
(docs/perf-log/cpu-anchors.md#2026-11-26-emerald-rapids, code-comments.md#prefer-wide-vectors).

A call compiles to nothing: it marks the LLVM function it is lowered into with
``"prefer-vector-width"="512"``, which the vectoriser reads per function. Inside a ``prange``
body it marks the body (numba outlines each parallel loop into a function of its own). A CPU
without 512-bit vectors ignores it.

:func:`has_512_bit_vectors` says whether numba compiles for AVX-512, and so for 32 vector registers
rather than AVX2's 16: a register-blocked kernel sizes its blocks by it (``matmul_rows_cpu``).
"""
from __future__ import annotations

from llvmlite import binding
from numba import types
from numba.core import config
from numba.extending import intrinsic

__all__ = ["WIDE_VECTORS_ATTRIBUTE", "has_512_bit_vectors", "prefer_wide_vectors"]

#: The LLVM function attribute :func:`prefer_wide_vectors` sets (as it appears in the IR).
WIDE_VECTORS_ATTRIBUTE = '"prefer-vector-width"="512"'


@intrinsic
def prefer_wide_vectors(typingctx):  # noqa: ANN001, ANN201
    """Mark the function being compiled for 512-bit vectors (see the module's docstring)."""
    sig = types.void()

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        # llvmlite's AttributeSet.add accepts only attributes without a value; a string
        # attribute is written into the IR as it is.
        set.add(builder.function.attributes, WIDE_VECTORS_ATTRIBUTE)
        return context.get_dummy_value()
    return sig, codegen


def has_512_bit_vectors() -> bool:
    """Whether numba compiles for a CPU with AVX-512 (``NUMBA_CPU_FEATURES`` if set, else the host's
    features, as numba's own code generator takes them)."""
    # (numba's config sets its settings at import, past what its types declare.)
    chosen = config.CPU_FEATURES  # type: ignore[attr-defined]
    features = chosen if chosen is not None else binding.get_host_cpu_features().flatten()
    return "+avx512f" in features.split(",")
