"""A cold start's compilation: every unit on worker processes into an empty numba cache, after
which an engine's whole warm-up compiles nothing (one keeping a GGUF's weights quantized too, when
asked); the stamp makes the next start skip it all. The cold start itself is scripts/test.sh's,
made before the workers start (tests/cold_start.py), or the test's own when pytest runs alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.runtime import numba_cache
from engines.runtime.core.warm_up import PARTS
from engines.runtime.frontend.precompile import QUANTIZED_UNITS, UNITS, precompile_stamp
from tests.cold_start import RECORD, cold_start, cold_start_env

REPO = Path(__file__).resolve().parents[3]

# In a fresh interpreter with the empty cache: count what a served engine's warm-up compiles.
COUNT_COMPILES = """
import json, sys
from numba.core import event
compiled = []
class Count(event.Listener):
    def on_start(self, ev): pass
    def on_end(self, ev):
        f = getattr(ev.data.get("dispatcher"), "py_func", None)
        compiled.append(f"{f.__module__}.{f.__qualname__}" if f else "?")
event.register("numba:compile", Count())
from engines.runtime import Engine, EngineConfig, LlamaModel, builtin_model_path, load_checkpoint
from engines.runtime.core.warm_up import warm_up
for name, quantized in json.loads(sys.argv[1]):
    checkpoint = load_checkpoint(builtin_model_path(name), keep_quantized=quantized)
    warm_up(Engine(LlamaModel.from_checkpoint(checkpoint, backend="cpu"), checkpoint, EngineConfig()))
print(json.dumps(compiled))
"""


def test_every_cpu_warm_up_part_is_in_a_unit() -> None:
    """The units are the warm-up's CPU parts, split along the compiled step's call tree."""
    covered = {"the batched step", "the one-token step", "the trace exporter", "steps kernel by kernel",
               "profiling", "K/V windows", "structured output"}
    assert {part.name for part in PARTS if "cpu" in part.backends} == covered
    names = [unit.name for unit in UNITS]
    assert len(names) == len(set(names)) and all(d in names for unit in UNITS for d in unit.after)


@pytest.mark.slow
def test_a_cold_cache_is_filled_on_every_core_and_then_nothing_compiles(tmp_path: Path) -> None:
    made = os.environ.get("COLD_START_CACHE")  # scripts/test.sh's cold start, before the workers
    cache = Path(made) if made else tmp_path / "numba"
    record = json.loads((cache / RECORD).read_text()) if made else cold_start(cache)
    units = len(UNITS) + len(QUANTIZED_UNITS)
    did, lines = record["compiled"], record["progress"]
    assert did and lines[0].startswith(f"compiling the engine's kernels for this machine, once ({units} parts")
    assert [line.split(":")[0] for line in lines[1:-1]] == [f"compiling kernels {i}/{units}"
                                                           for i in range(1, units + 1)]
    assert lines[-1].startswith("compiled in ")
    # Nothing compiled formats a slice assignment's shape error, whose string functions cost a
    # process seconds to compile: compiled code copies in loops (engines/runtime/model/kernels).
    assert [p.name for p in cache.rglob("*.nbc") if b"cannot assign slice" in p.read_bytes()] == []
    env = cold_start_env(cache)

    def compiled_by_warm_ups(engines: list[tuple[str, bool]]) -> list[str]:
        warm = subprocess.run([sys.executable, "-c", COUNT_COMPILES, json.dumps(engines)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert warm.returncode == 0, warm.stderr
        return json.loads(warm.stdout.strip().splitlines()[-1])

    def precompile_again(quantized: bool) -> tuple[bool, list[str]]:
        code = ("import json; from engines.runtime import precompile; lines = []; "
                f"did = precompile(progress=lines.append, quantized={quantized}); print(json.dumps([did, lines]))")
        again = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=300)
        assert again.returncode == 0, again.stderr
        did, lines = json.loads(again.stdout.strip().splitlines()[-1])
        return did, lines

    # The default pair's own warm-ups (the built-in GGUF kept quantized, the demo in float32) now
    # load everything: not one function compiles. (The quantized model's layers are a typed list
    # too: made in compiled code, whose cache entry holds the list's methods: step_weights._typed_list.)
    assert compiled_by_warm_ups([("smollm2", True), ("demo", False)]) == []
    assert precompile_again(True) == (False, [])  # the stamp: the next start does nothing at all
    # Engines that dequantize a GGUF (--weights-dtype float32) add the dequantizers, and only them.
    did, lines = precompile_again(False)
    assert did and [line.split(": ", 1)[1].split(" (")[0] for line in lines[1:-1]].count("GGUF dequantization") == 1
    assert compiled_by_warm_ups([("smollm2", False)]) == []
    assert precompile_again(False) == (False, [])


def test_the_stamp_lives_in_the_cache_and_names_the_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numba_cache.config, "CACHE_DIR", str(tmp_path / "numba"))  # NUMBA_CACHE_DIR
    stamp = precompile_stamp()
    assert stamp.parent == tmp_path / "numba" and stamp.name.startswith("precompiled-")
    monkeypatch.setattr(numba_cache.config, "CACHE_DIR", "")
    monkeypatch.setenv("ENGINES_CACHE_DIR", str(tmp_path / "home"))
    shared = precompile_stamp().parent  # the user's folder of these sources, beside their kernels
    assert shared.parent == tmp_path / "home" / "kernels" and shared == numba_cache.kernel_cache_dir()
    assert precompile_stamp(quantized=True) != precompile_stamp()
