"""Thread counts for a CPU bench: set before numpy or numba is first imported, or ignored."""
from __future__ import annotations

import os
import sys
from pathlib import Path

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def use_threads(count: int, engines_from: str | None = None) -> None:
    """Give BLAS, OpenMP and numba ``count`` threads, and put the repository (or ``engines_from``,
    a folder holding another tree's ``engines`` package) first on the import path."""
    if "numpy" in sys.modules or "numba" in sys.modules:
        raise RuntimeError("set the thread counts before numpy or numba is imported")
    for name in THREAD_VARIABLES:
        os.environ[name] = str(count)
    sys.path.insert(0, str(Path(engines_from or Path(__file__).parents[1]).resolve()))
    import engines  # noqa: F401 - its BLAS thread setting, before numpy loads
