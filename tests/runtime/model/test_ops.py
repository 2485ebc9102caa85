"""The op table (``model/kernels/ops.py``) holds every op to one contract: a CPU twin, CUDA
signatures, a cost beside its kernel, a method of one signature on each backend it names (on the
``Backend`` Protocol when on both), a differential test, and ``in_compiled_step`` as the compiled
CPU step runs it. The differential tests are found by reading the tests, not listed here: a test
that runs the op's CUDA kernel (through a backend's method, or launched itself) and the CPU twin
of the same module, on device arrays."""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from engines.runtime.model.backend import Backend, CpuBackend, CudaBackend
from engines.runtime.model.kernels import ops as ops_module
from engines.runtime.model.kernels.ops import KERNEL_MODULES, OPS, Op, kernel_cost, ops_of

TESTS = Path(__file__).resolve().parents[1]  # tests/runtime
MODEL = Path(ops_module.__file__).resolve().parents[1]  # engines/runtime/model
BACKENDS: dict[str, type] = {"cpu": CpuBackend, "cuda": CudaBackend}


def test_kernel_costs_follow_the_arithmetic() -> None:
    x, w, b, out = np.zeros((3, 8), np.float32), np.zeros((16, 8), np.float16), None, np.zeros((3, 16), np.float32)
    assert kernel_cost("matmul", (x, w, b, out)) == ("matmul 8x16", 16 * 8 * 2 + 3 * 8 * 4 + 3 * 16 * 4,
                                                     2 * 3 * 8 * 16)
    # Attention over a 5-token prefill (positions 0-4) and one decode at position 9: keys and
    # values of 5 + 10 positions read once; 15 + 10 (query, position) pairs.
    qkv, cache, att = np.zeros((6, 16), np.float32), np.zeros((2, 4, 2, 4, 4), np.float16), np.zeros((6, 8), np.float32)
    name, nbytes, flops = kernel_cost("attention", (qkv, None, cache, cache, 0, 2, 1.0, att), 15, 25)
    assert name == "attention" and flops == 4 * 25 * 2 * 4
    assert nbytes == 2 * 15 * 2 * 4 * 2 + qkv.nbytes + att.nbytes


def test_an_op_the_table_lacks_has_no_cost_but_an_error() -> None:
    with pytest.raises(KeyError, match="no op 'rmsnorm' in kernels.ops.OPS"):
        kernel_cost("rmsnorm", ())


def test_the_table_names_each_op_once_and_each_backend_launches_its_ops() -> None:
    assert len({op.name for op in OPS}) == len(OPS)
    for name, backend in BACKENDS.items():
        assert backend.ops == ops_of(name) and backend.ops, name
    assert {name for op in OPS for name in op.backends} == set(BACKENDS)


def protocol_methods() -> set[str]:
    return {name for name, value in vars(Backend).items() if not name.startswith("_") and callable(value)}


def parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_an_op_is_one_method_on_each_backend_it_names_and_on_the_protocol_when_on_all(op: Op) -> None:
    on = [BACKENDS[name] for name in op.backends]
    off = [backend for name, backend in BACKENDS.items() if name not in op.backends]
    signatures = {backend.__name__: parameters(getattr(backend, op.name)) for backend in on}
    if not off:
        signatures["Backend"] = parameters(getattr(Backend, op.name))
    assert len({tuple(s) for s in signatures.values()}) == 1, signatures
    assert all(not hasattr(backend, op.name) for backend in off), f"{op.name}: a method the table does not name"
    assert (op.name in protocol_methods()) == (not off), "the Protocol has exactly the ops of every backend"


def test_every_op_method_of_the_protocol_is_in_the_table() -> None:
    """The Protocol's methods are the table's ops of every backend and the non-op methods
    (allocation, copies, the step); an op added to the backends without a row fails here."""
    not_ops = {"free_memory_bytes", "device_name", "peak_bandwidth", "cuda_profiler", "to_storage", "store_linear",
               "store_layers", "empty", "upload_step", "run_step", "to_host"}
    assert protocol_methods() - not_ops == {op.name for op in OPS if set(op.backends) == set(BACKENDS)}


def cuda_kernels(module: ModuleType) -> list[str]:
    return [getattr(kernel, "py_func", kernel).__name__ for kernel in getattr(module, "CUDA_SIGNATURES", {})]


def cpu_twins(module: ModuleType) -> list[str]:
    return [name for name, value in vars(module).items() if name.endswith("_cpu") and callable(value)]


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_an_op_has_a_cpu_twin_cuda_signatures_and_a_cost_beside_its_kernel(op: Op) -> None:
    if op.module is None:  # NumPy's alone: no kernel to twin, so no CUDA backend may launch it
        assert op.backends == ("cpu",) and op.cost.__module__ == ops_module.__name__
        return
    assert cpu_twins(op.module), f"{op.module.__name__} has no *_cpu twin"
    assert op.cost is op.module.launch_cost, "the cost lives beside the kernel: its module's launch_cost"
    if "cuda" in op.backends:
        kernels = cuda_kernels(op.module)
        assert kernels and all(name.endswith("_cuda") for name in kernels), op.module.__name__
        assert op.module in KERNEL_MODULES
    for module in op.quantized:
        assert cpu_twins(module), f"{module.__name__} has no *_cpu twin"
        if cuda_kernels(module):
            assert module in KERNEL_MODULES


@dataclass
class Reads:
    """What one test function reads: methods it calls, ``module.name`` attributes it names."""

    where: str
    methods: set[str] = field(default_factory=set)
    attributes: set[tuple[str, str]] = field(default_factory=set)

    def differs(self, module: str, kernel: str, ops: set[str]) -> bool:
        """Whether this test runs ``module``'s CUDA ``kernel`` (launched itself, or through one of
        ``ops``) on device arrays, and a CPU twin of ``module``."""
        runs = (module, kernel) in self.attributes or bool(self.methods & ops)
        on_device = any(owner == "cuda" for owner, _ in self.attributes)
        twin = any(owner == module and name.endswith("_cpu") for owner, name in self.attributes)
        return runs and on_device and twin


def read_tests(paths: list[Path]) -> list[Reads]:
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                reads = Reads(f"{path.name}::{node.name}")
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
                        reads.methods.add(inner.func.attr)
                    if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name):
                        reads.attributes.add((inner.value.id, inner.attr))
                found.append(reads)
    return found


def short(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def untested_kernels(reads: list[Reads]) -> list[str]:
    """``module.kernel`` for each CUDA kernel of an op no test diffs against its module's CPU twin."""
    missing = []
    for module in {m for op in ops_of("cuda") for m in (op.module, *op.quantized) if m is not None}:
        launched_by = {op.name for op in ops_of("cuda") if module in (op.module, *op.quantized)}
        for kernel in cuda_kernels(module):
            if not any(test.differs(short(module), kernel, launched_by) for test in reads):
                missing.append(f"{short(module)}.{kernel}")
    return sorted(missing)


def test_every_cuda_kernel_of_an_op_has_a_differential_test() -> None:
    reads = read_tests(sorted(TESTS.rglob("test_*.py")))
    assert not untested_kernels(reads), "no test runs these beside their CPU twin:\n" + "\n".join(
        untested_kernels(reads))


def test_the_differential_check_sees_a_test_without_a_twin(tmp_path: Path) -> None:
    lone = tmp_path / "test_lone.py"
    lone.write_text("def test_argmax_alone():\n    backend().argmax(cuda.to_device(logits), out)\n"
                    "def test_silu_mul_on_the_host():\n    backend().silu_mul(x, out)\n"
                    "    silu_mul.silu_mul_cpu(x, y)\n"
                    "def test_embedding():\n    be.embedding(cuda.to_device(ids), t, out)\n"
                    "    embedding.embedding_gather_cpu(ids, t, want)\n")
    missing = untested_kernels(read_tests([lone]))
    assert "argmax.argmax_cuda" in missing and "silu_mul.silu_mul_cuda" in missing
    assert "embedding.embedding_gather_cuda" not in missing


def compiled_step_reads() -> set[tuple[str, str]]:
    """``module.name`` attributes the compiled CPU step names: ``decode_step_cpu`` and the
    per-storage ops it calls (``step_weights``)."""
    cpu_step = ast.parse((MODEL / "cpu_step.py").read_text())
    (step,) = [n for n in ast.walk(cpu_step) if isinstance(n, ast.FunctionDef) and n.name == "decode_step_cpu"]
    trees: list[ast.AST] = [step, ast.parse((MODEL / "kernels" / "step_weights.py").read_text())]
    return {(n.value.id, n.attr) for tree in trees for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}


@pytest.mark.parametrize("op", [op for op in OPS if op.module is not None], ids=lambda op: op.name)
def test_in_compiled_step_says_whether_the_compiled_step_runs_the_op(op: Op) -> None:
    assert op.module is not None
    names = compiled_step_reads()
    runs = any((short(op.module), twin) in names for twin in cpu_twins(op.module))
    assert runs == op.in_compiled_step, f"{op.name}: in_compiled_step={op.in_compiled_step}, the step runs it: {runs}"
