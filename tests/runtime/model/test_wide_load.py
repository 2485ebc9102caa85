"""The decode GEMV's 16-byte loads (``kernels/wide_load.py``): what the simulator's stand-in returns,
and, compiled for sm_90 with the simulator off (in a subprocess, as test_kernel_compile does), that
the PTX holds the wide loads and the shuffles it was written for and no local-memory traffic (the
GPU's own timing is the device bench's: docs/perf-log/gpu-decode.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engines.runtime.model.kernels import wide_load

REPO = Path(__file__).resolve().parents[3]

PTX_COUNTS = r"""
import collections, json, re
from numba import cuda
from engines.runtime.model.kernels import matmul
counts = {}
for dt in ("float16", "float32"):
    ptx, _ = cuda.compile_ptx(matmul.gemv_cuda.py_func, matmul.CUDA_SIGNATURES[matmul.gemv_cuda].format(dt=dt),
                              cc=(9, 0))
    counts[dt] = collections.Counter(re.findall(r"\b((?:ld|st)\.[a-z0-9.]+|shfl\.sync\.[a-z0-9.]+)", ptx))
print(json.dumps(counts))
"""


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_load8_reads_eight_values_widened_to_float32(dtype: str) -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 24)).astype(dtype)
    assert wide_load.loadable(a)
    got = wide_load.load8(a, 2, 8)
    assert len(got) == wide_load.CHUNK and all(isinstance(v, np.float32) for v in got)
    np.testing.assert_array_equal(np.array(got), a[2, 8:16].astype(np.float32))


def test_loadable_needs_whole_chunks_of_sixteen_bytes() -> None:
    assert wide_load.loadable(np.zeros((2, 16), np.float16))
    assert not wide_load.loadable(np.zeros((2, 12), np.float32))  # 48-byte rows, but not whole chunks
    assert not wide_load.loadable(np.zeros((2, 20), np.float16))


@pytest.mark.slow
def test_gemv_ptx_has_sixteen_byte_loads_and_shuffles_and_no_local_memory() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", PTX_COUNTS], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    half, single = counts["float16"], counts["float32"]
    # Two weight chunks a lane per iteration, as one 16-byte load each (float16) or two (float32);
    # activations always as ld.global.v4.f32.
    assert half.get("ld.global.nc.v4.u32", 0) == 2, half
    assert not any(k.startswith("ld.global") and "b16" in k for k in half), half  # no narrow weight loads
    assert single.get("ld.global.v4.f32", 0) >= 4 + half.get("ld.global.v4.f32", 0), (single, half)
    for found in (half, single):
        assert found.get("shfl.sync.bfly.b32", 0) >= 5, found
        assert not any(".local" in k for k in found), found
