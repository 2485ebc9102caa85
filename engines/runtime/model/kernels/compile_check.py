"""Compile every CUDA kernel, for every signature the CUDA backend launches, to PTX.

The CUDA simulator runs kernels as Python, so it never type-checks them the way the real
compiler does; this catches what it misses, on a machine without a GPU (NVVM ships with
``numba-cuda[cu13]``). Run it with the simulator off::

    python -m engines.runtime.model.kernels.compile_check [--cc 9.0]

It prints one line per (kernel, signature) and exits non-zero if any failed.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numba.cuda loads only when a check runs
    from numba.cuda.dispatcher import CUDADispatcher


@dataclass
class CompileResult:
    """The outcome of compiling one kernel for one signature."""

    kernel: str
    signature: str
    ok: bool
    seconds: float
    error: str = ""


def kernel_signatures() -> tuple[list[tuple[str, CUDADispatcher, str]], list[str]]:
    """Every ``(qualified name, kernel, signature)`` the backend may launch, and the names of
    kernels defined in a kernel module but missing from its ``CUDA_SIGNATURES``."""
    from numba.cuda.dispatcher import CUDADispatcher

    from engines.runtime.model.kernels import STORAGE_DTYPES
    from engines.runtime.model.kernels.ops import KERNEL_MODULES

    out: list[tuple[str, CUDADispatcher, str]] = []
    unlisted: list[str] = []
    for module in KERNEL_MODULES:
        short = module.__name__.rsplit(".", 1)[-1]
        for kernel, template in module.CUDA_SIGNATURES.items():
            dtypes = getattr(module, "SIGNATURE_DTYPES", STORAGE_DTYPES)
            variants = sorted({template.format(dt=dt) for dt in dtypes})
            out.extend((f"{short}.{kernel.py_func.__name__}", kernel, sig) for sig in variants)
        unlisted.extend(
            f"{short}.{attr}" for attr, value in vars(module).items()
            if isinstance(value, CUDADispatcher) and value not in module.CUDA_SIGNATURES
            and not value.targetoptions.get("device")  # a device function compiles inside its kernels
        )
    return out, unlisted


def compile_all(cc: tuple[int, int]) -> list[CompileResult]:
    """Compile each signature with ``cuda.compile_ptx`` for compute capability ``cc``."""
    from numba import config, cuda

    if config.ENABLE_CUDASIM:  # type: ignore[attr-defined]  # numba sets its settings at import
        raise RuntimeError("compile_check needs the real CUDA target: unset NUMBA_ENABLE_CUDASIM")
    signatures, unlisted = kernel_signatures()
    results = [CompileResult(name, "-", False, 0.0, "kernel missing from its module's CUDA_SIGNATURES")
               for name in unlisted]
    for name, kernel, sig in signatures:
        start = time.perf_counter()
        try:
            cuda.compile_ptx(kernel.py_func, sig, cc=cc)
        except Exception as exc:  # noqa: BLE001 - any compiler failure is a result to report, not a crash
            results.append(CompileResult(name, sig, False, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"))
        else:
            results.append(CompileResult(name, sig, True, time.perf_counter() - start))
    return results


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", default="9.0", help="compute capability to compile for (default 9.0, H100)")
    args = parser.parse_args(argv)
    major, minor = (int(p) for p in args.cc.split("."))
    results = compile_all((major, minor))
    for r in results:
        status = "ok  " if r.ok else "FAIL"
        print(f"{status} {r.kernel:40s} {r.seconds:5.1f}s  {r.signature}")
        if not r.ok:
            print(f"     {r.error}")
    failed = sum(not r.ok for r in results)
    print(f"compiled {len(results) - failed}/{len(results)} kernel signatures for sm_{major}{minor}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
