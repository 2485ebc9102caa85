"""Where the kernels run: :class:`CpuBackend` (numba ``@njit`` + NumPy BLAS on the host,
``backend/cpu.py``) and :class:`CudaBackend` (numba.cuda kernels, weights and KV cache resident on
the GPU, ``backend/cuda.py``), each a :class:`Backend` (``backend/contract.py``: the methods the
model calls, and nothing else), and :func:`select_backend`, which picks one.

Activation buffers live in a :class:`Workspace` (``backend/workspace.py``) that grows to the largest
step seen and is reused after that, so a steady decode loop allocates nothing, on either backend.
"""
from __future__ import annotations

import numba
# (Named apart: importing the submodule ``backend.cuda`` binds ``cuda`` in this package.)
from numba import cuda as numba_cuda

from engines.runtime.model.backend.contract import Array, Backend, StepInputs, check_dtype
from engines.runtime.model.backend.cpu import CpuBackend, CpuWeight
from engines.runtime.model.backend.cuda import (GPU_LAUNCH_SHAPES, SIMULATOR_LAUNCH_SHAPES, CudaBackend,
                                                DeviceQuantizedWeight, LaunchShapes, cuda_usable)
from engines.runtime.model.backend.workspace import Activations, Workspace

__all__ = [
    "GPU_LAUNCH_SHAPES",
    "SIMULATOR_LAUNCH_SHAPES",
    "Activations",
    "Array",
    "Backend",
    "CpuBackend",
    "CpuWeight",
    "CudaBackend",
    "DeviceQuantizedWeight",
    "LaunchShapes",
    "StepInputs",
    "Workspace",
    "cuda_usable",
    "select_backend",
]


def select_backend(name: str = "auto", dtype: str = "float32") -> Backend:
    """The backend called ``name``: ``"cuda"``, ``"cpu"``, or ``"auto"`` (cuda when a real
    GPU is usable, else cpu). ``"cuda"`` under the simulator is allowed: that is how tests
    run the CUDA path on tiny shapes."""
    if name == "auto":
        name = "cuda" if cuda_usable() else "cpu"
    if name == "cpu":
        check_dtype(dtype, CpuBackend.dtypes, "cpu")
        return CpuBackend()
    if name == "cuda":
        if not numba.config.ENABLE_CUDASIM and not numba_cuda.is_available():  # type: ignore[attr-defined]
            raise ValueError("backend 'cuda' requested but numba.cuda finds no usable GPU: use backend='cpu' or 'auto'")
        return CudaBackend(dtype)
    raise ValueError(f"unknown backend {name!r}: use 'auto', 'cuda' or 'cpu'")
