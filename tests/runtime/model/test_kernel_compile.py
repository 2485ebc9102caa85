"""Every CUDA kernel compiles for a real GPU (sm_90), for every signature the backend launches.

The simulator executes kernels as Python and never type-checks them as the CUDA compiler
does, so this runs ``engines.runtime.model.kernels.compile_check`` in a subprocess with the
simulator off (it must be off before numba is imported, and this process has it on).
NVVM comes with ``numba-cuda[cu13]``: no GPU is needed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run(
        [sys.executable, "-m", "engines.runtime.model.kernels.compile_check", "--cc", "9.0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    compiled = {line.split()[1] for line in lines}
    # Every kernel, in both storage dtypes where it has a {dt} slot (the quantized one in both
    # quants dtypes): 19 signatures today.
    assert compiled == {
        "embedding.embedding_gather_cuda", "add_rmsnorm.add_rmsnorm_cuda", "matmul.matmul_tiled_cuda",
        "matmul.gemv_cuda", "quantized_matmul.quantized_gemv_cuda", "quantized_matmul.quantized_embedding_cuda",
        "rope_kv.rope_kv_append_cuda", "attention.paged_attention_cuda",
        "silu_mul.silu_mul_cuda", "argmax.argmax_cuda", "kv_window.kv_window_gather_cuda",
        "kv_window.kv_window_scatter_cuda",
    }, report
    assert sum("float16" in line for line in lines) == 7, report
    assert sum("quantized_gemv_cuda" in line for line in lines) == 2, report  # int8 (Q8_0), uint8 (nibbles)
    assert sum("quantized_embedding_cuda" in line for line in lines) == 2, report
    assert all(line.startswith("ok") for line in lines), report
