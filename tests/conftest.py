"""Test-wide setup.

The CUDA simulator must be switched on before numba is first imported, so it
happens here, at the top of the first module pytest loads. On a machine with a
real GPU set ``ENGINES_TEST_GPU=1`` to run the CUDA kernels for real instead.
"""
import os

if os.environ.get("ENGINES_TEST_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
