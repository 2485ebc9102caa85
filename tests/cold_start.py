"""The suite's cold start: the engine's kernels compiled on every core into an empty numba cache
(``frontend.precompile`` with the kept-quantized units too), as a fresh machine's first start does.

``scripts/test.sh`` runs it once, before pytest's workers start (``python -m tests.cold_start
DIR``), exports ``COLD_START_CACHE=DIR``, and runs the suite on a copy of that cache; the cold-start
test (tests/runtime/frontend/test_precompile.py) then checks DIR as the cold start left it: every
unit reported in order, and nothing left for an engine's warm-up to compile. The same compile in
the test itself, beside the workers that needed it first, cost the suite a second cold compile
(184 CPU-seconds of 1,264 on the AMX Xeon: docs/perf-log/ci-time.md). Run without
``COLD_START_CACHE`` (pytest on its own), the test makes a cold start of its own with this module.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["RECORD", "cold_start", "cold_start_env"]

REPO = Path(__file__).resolve().parents[1]
# What the cold start reported, in the cache folder (numba leaves other files there alone).
RECORD = "cold-start.json"

# In a fresh interpreter (numba reads NUMBA_CACHE_DIR at import): precompile, each progress line
# printed as it comes, then whether it compiled.
_PRECOMPILE = """
import json
from engines.runtime import precompile
did = precompile(progress=lambda line: print("@" + line, flush=True), quantized=True)
print(json.dumps(did))
"""


def cold_start_env(cache: Path) -> dict[str, str]:
    """This process's environment with numba's cache in ``cache`` (never the CUDA simulator's:
    the CPU engine's kernels are what a start compiles)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def cold_start(cache: Path, echo: bool = False) -> dict:
    """Precompile into ``cache``, which must be missing or empty, and record in it (:data:`RECORD`)
    whether it compiled and the progress lines it printed; the record. ``echo`` prints the lines
    as they come. Raises ``RuntimeError`` with the output if precompile fails."""
    cache.mkdir(parents=True, exist_ok=True)
    if any(cache.iterdir()):
        raise RuntimeError(f"{cache} is not empty: a cold start needs an empty cache")
    process = subprocess.Popen([sys.executable, "-c", _PRECOMPILE], cwd=REPO, env=cold_start_env(cache),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    lines, output = [], []
    for line in process.stdout:
        output.append(line)
        if line.startswith("@"):
            lines.append(line[1:].rstrip("\n"))
            if echo:
                print(lines[-1], flush=True)
    if process.wait() != 0:
        raise RuntimeError("the cold start failed:\n" + "".join(output[-60:]))
    record = {"compiled": json.loads(output[-1]), "progress": lines}
    (cache / RECORD).write_text(json.dumps(record))
    return record


if __name__ == "__main__":
    cold_start(Path(sys.argv[1]).resolve(), echo=True)
