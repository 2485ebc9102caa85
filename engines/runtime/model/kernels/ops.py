"""The backend's ops, in one table: for each, the backend method that launches it, its kernel module
(the CUDA kernels beside their CPU twins, ``CUDA_SIGNATURES``, and ``launch_cost``: its bytes and
flops beside the kernel), the modules that compute it on a quantized weight, and whether the
compiled CPU step (``model/cpu_step.py``) runs it.

What reads it: the backends (``Backend.ops``, the ops each launches), the profiler's timed backend
(each op's method timed, its cost from ``launch_cost``), ``compile_check`` (:data:`KERNEL_MODULES`),
and ``tests/runtime/model/test_ops.py``, which holds every op to the contract: a CPU twin, CUDA
signatures, a cost, a method of the same signature on each backend it names, and a differential test.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from engines.runtime.model.kernels import (add_rmsnorm, argmax, attention, embedding, interleaved_dot, kv_window,
                                           matmul, quantized_matmul, rope_kv, silu_mul)
from engines.runtime.model.kernels.launch_cost import Cost, LaunchCost, nbytes

__all__ = ["KERNEL_MODULES", "OPS", "Op", "kernel_cost", "ops_of"]


@dataclass(frozen=True)
class Op:
    """One op of the forward pass, as every backend launches it."""

    name: str                      # the backend's method
    module: ModuleType | None      # its kernel module; None: no kernel of its own (NumPy's)
    cost: Cost                     # the bytes it moves and the flops it does, from the method's arguments
    in_compiled_step: bool         # run by cpu_step.decode_step_cpu too (else by the per-kernel path alone)
    backends: tuple[str, ...] = ("cpu", "cuda")
    #: Its kernels for a quantized weight: the row-major blocks' (CUDA and CPU) and the
    #: interleaved layout's (CPU); the compiled step picks one by the weight (``step_weights``).
    quantized: tuple[ModuleType, ...] = ()


def _gather_rows_cost(args: tuple[Any, ...], kv_positions: int, attended: int) -> LaunchCost:
    """The CPU backend's ``gather_rows(source, rows, out)``: each row read and written once."""
    _source, rows, out = args
    return "gather_rows", 2 * nbytes(out) + nbytes(rows), 0


_QUANTIZED = (quantized_matmul, interleaved_dot)

#: Every op, in the order a layer runs them.
OPS: tuple[Op, ...] = (
    Op("embedding", embedding, embedding.launch_cost, in_compiled_step=True, quantized=_QUANTIZED),
    Op("add_rmsnorm", add_rmsnorm, add_rmsnorm.launch_cost, in_compiled_step=True),
    Op("matmul", matmul, matmul.launch_cost, in_compiled_step=True, quantized=_QUANTIZED),
    Op("rope_kv_append", rope_kv, rope_kv.launch_cost, in_compiled_step=True),
    Op("attention", attention, attention.launch_cost, in_compiled_step=True),
    Op("silu_mul", silu_mul, silu_mul.launch_cost, in_compiled_step=True),
    Op("argmax", argmax, argmax.launch_cost, in_compiled_step=True),
    # The last layer's rows that return logits (``compacts_last_layer``); ``np.take`` does it.
    Op("gather_rows", None, _gather_rows_cost, in_compiled_step=False, backends=("cpu",)),
)
_BY_NAME = {op.name: op for op in OPS}


def ops_of(backend: str) -> tuple[Op, ...]:
    """The ops the backend called ``backend`` (``"cpu"``, ``"cuda"``) launches."""
    return tuple(op for op in OPS if backend in op.backends)


def kernel_cost(name: str, args: tuple[Any, ...], kv_positions: int = 0, attended: int = 0) -> LaunchCost:
    """A launch of op ``name`` with the method's ``args``: its table name, the bytes it moves and the
    flops it does (``launch_cost``; attention's depend on the step: ``kv_positions``, ``attended``).
    A name that is no op's is a ``KeyError``: an op missing from the table would otherwise be
    profiled as moving nothing."""
    op = _BY_NAME.get(name)
    if op is None:
        raise KeyError(f"no op {name!r} in kernels.ops.OPS (the ops: {', '.join(_BY_NAME)}): "
                       "add its row there, with its kernel module's launch_cost")
    return op.cost(args, kv_positions, attended)


def _cuda_modules() -> tuple[ModuleType, ...]:
    found: list[ModuleType] = []
    for op in ops_of("cuda"):
        for module in (op.module, *op.quantized):
            if module is not None and hasattr(module, "CUDA_SIGNATURES") and module not in found:
                found.append(module)
    return tuple(found)


#: Every module whose CUDA kernels the runtime launches (``compile_check`` compiles them all): the
#: ops', and the paged K/V cache's windows (``kv_storage``, no backend op).
KERNEL_MODULES: tuple[ModuleType, ...] = (*_cuda_modules(), kv_window)
