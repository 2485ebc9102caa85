"""What a backend is: the methods the model calls, and nothing else (:class:`Backend`), and the
step metadata it hands them (:class:`StepInputs`).

Array allocation (``to_storage``, ``store_linear``, ``store_layers``, ``empty``), the per-step upload
of the batch metadata (``upload_step``), the ops (``embedding``, ``add_rmsnorm``, ``matmul``,
``rope_kv_append``, ``attention``, ``silu_mul``, ``argmax``), running a step's ops (``run_step``:
replayed from a CUDA graph on a GPU) and the copy of results back to the host (``to_host``).
The ops are the table's (``kernels/ops.py``), each a method of the same signature on every backend.
:class:`~engines.runtime.model.backend.cpu.CpuBackend` and
:class:`~engines.runtime.model.backend.cuda.CudaBackend` are the two; the profiler's timed wrapper
of either (``telemetry.profiler.ProfiledBackend``) is a third.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from engines.runtime.model.quant.quantized_weight import HostWeight

if TYPE_CHECKING:
    from engines.runtime.model.kernels import run_attention
    from engines.runtime.model.kernels.ops import Op

Array = Any  # numpy.ndarray on the CPU backend, a numba DeviceNDArray on the CUDA backend

__all__ = ["Array", "Backend", "StepInputs", "check_dtype"]


@dataclass
class StepInputs:
    """The batch metadata of one forward step, as backend arrays (int32).

    ``token_seq[t]`` is the sequence of new token ``t`` and ``positions[t]`` its absolute
    position; ``rows`` is ``0 .. num_tokens-1`` (the row list of the per-layer norms) and
    ``logit_rows`` the tokens whose logits are returned.
    """

    token_ids: Array
    positions: Array
    token_seq: Array
    page_table: Array  # [num_seqs, max_pages]
    rows: Array
    logit_rows: Array
    #: CPU backend only, set once a step by ``upload_step`` (attention reads it in every layer):
    #: the prefill runs attention computes with BLAS, and the other rows (None: every row).
    attention_split: run_attention.AttentionSplit | None = None


def check_dtype(dtype: str, allowed: tuple[str, ...], backend: str) -> np.dtype:
    if dtype not in allowed:
        raise ValueError(f"dtype {dtype!r} is not supported on the {backend} backend: use one of {', '.join(allowed)}")
    return np.dtype(dtype)


class Backend(Protocol):
    """Where the kernels run, as the model sees it: what both backends (and the profiler's timed
    wrapper of one) have. A method one backend alone has (the CPU's ``gather_rows``) is not here:
    a caller asks that backend's flag for it (``compacts_last_layer``)."""

    @property
    def name(self) -> str:
        """``"cpu"`` or ``"cuda"``."""
    @property
    def dtypes(self) -> tuple[str, ...]:
        """The storage dtypes its weights and KV cache may take."""
    @property
    def ops(self) -> tuple[Op, ...]:
        """The ops it launches, each a method of its own (``kernels.ops``: the table's rows for it)."""
    @property
    def compacts_last_layer(self) -> bool:
        """Whether the model may run its last layer past the K/V for the logit rows alone."""

    def free_memory_bytes(self) -> int | None: ...
    def device_name(self) -> str: ...
    def peak_bandwidth(self) -> tuple[float | None, str]: ...
    def cuda_profiler(self, start: bool) -> None: ...

    def to_storage(self, array: HostWeight, dtype: str) -> Any: ...
    def store_linear(self, weight: HostWeight, dtype: str) -> Any: ...
    def store_layers(self, make: Callable[[int], HostWeight], count: int, dtype: str, linear: bool) -> Any: ...
    def empty(self, shape: tuple[int, ...], dtype: Any) -> Array: ...
    def upload_step(self, host: StepInputs) -> StepInputs: ...
    def run_step(self, buffers: tuple[Any, ...], num_tokens: int, launches: Callable[[], None]) -> None: ...
    def to_host(self, array: Array) -> np.ndarray: ...

    def embedding(self, token_ids: Array, table: Any, out: Array) -> None: ...
    def add_rmsnorm(self, x: Array, residual: Array, rows: Array, weight: Array, eps: np.float32,
                    out: Array) -> None: ...
    def matmul(self, x: Array, weight: Any, bias: Array, out: Array) -> None: ...
    def rope_kv_append(self, qkv: Array, step: StepInputs, cos: Array, sin: Array,
                       k_cache: Array, v_cache: Array, layer: int, num_q_heads: int) -> None: ...
    def attention(self, qkv: Array, step: StepInputs, k_cache: Array, v_cache: Array,
                  layer: int, num_q_heads: int, scale: np.float32, out: Array) -> None: ...
    def silu_mul(self, gate_up: Array, out: Array) -> None: ...
    def argmax(self, logits: Array, out: Array) -> None: ...
