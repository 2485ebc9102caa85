"""The host backend: numba ``@njit`` kernels and NumPy BLAS matmuls (:class:`CpuBackend`), with one
method the CUDA backend has not: ``gather_rows``, for the last layer of a step whose other rows return
no logits (``compacts_last_layer``)."""
from __future__ import annotations

import os
from typing import Any, Callable, Union

import numba
import numpy as np

from engines.runtime.model.backend.contract import StepInputs, check_dtype
from engines.runtime.model.cpu_pool import CpuPool
from engines.runtime.model.quant.dequantize import half_table
from engines.runtime.model.host_memory import aligned_copy, aligned_empty, available_bytes
from engines.runtime.model.quant.interleaved_weight import InterleavedWeight, interleavable
from engines.runtime.model.quant.quantized_weight import HostWeight, QuantizedWeight
from engines.runtime.model.kernels import (add_rmsnorm, argmax, attention, embedding, interleaved_dot, matmul,
                                           quantized_matmul, rope_kv, run_attention, silu_mul)
from engines.runtime.model.kernels.ops import ops_of

#: A weight as the CPU backend keeps it: float, or quantized (interleaved where its rows allow).
CpuWeight = Union[np.ndarray, QuantizedWeight, InterleavedWeight]

__all__ = ["CpuBackend", "CpuWeight"]


class CpuBackend:
    """The host backend: numba ``@njit(nogil=True)`` kernels and NumPy BLAS matmuls.

    Every op releases the GIL, so an engine thread computing a step does not stall the
    asyncio thread serving requests.
    """

    name = "cpu"
    ops = ops_of("cpu")
    dtypes = ("float32",)

    # Multiply-adds below which attention runs single-threaded: for the smallest decode steps
    # waking numba's thread pool costs as much as the work (batch 1, 80 keys: even).
    parallel_attention_min_work = 1 << 16
    #: The model may run its last layer past the K/V for the logit rows alone (``gather_rows``).
    compacts_last_layer = True

    def __init__(self) -> None:
        # A prefill step's attention heads and element-wise kernels run side by side on as many
        # threads as BLAS has (decode steps use numba's threads: see _numba_threads_step).
        self.cpu_pool = CpuPool()
        # numba's threads, which attention's split is made for (read once: right after a step has
        # flushed the caches even this call is slow, docs/perf-log/cpu-anchors.md#2026-11-25-python-around-a-step).
        # Reading it starts numba's thread pool, which registers
        # the symbol its parallel kernels call to launch: a kernel loaded from the cache before
        # any parallel one ran from Python would call an unresolved address (a segfault, seen).
        self.numba_threads = numba.get_num_threads()

    def free_memory_bytes(self) -> int | None:
        """Host memory free now (weights, KV cache and activations live there), or None if unknown."""
        return available_bytes()

    def device_name(self) -> str:
        """What computes, as a profile names it."""
        return f"cpu ({os.cpu_count()} cores)"

    def peak_bandwidth(self) -> tuple[float | None, str]:
        """The memory bandwidth kernels are compared with, in GB/s, and where it came from: this
        host's read rate, measured (a fraction of a second)."""
        from engines.runtime.telemetry.profiler import measure_host_bandwidth

        return measure_host_bandwidth(), "measured"

    def cuda_profiler(self, start: bool) -> None:
        """``cudaProfilerStart``/``Stop``: a GPU's alone."""
        raise ValueError("the CUDA profiler needs the cuda backend")

    def to_storage(self, array: HostWeight, dtype: str) -> CpuWeight:
        """A C-contiguous copy of ``array`` in storage dtype ``dtype``, aligned by ``host_memory``
        (a quantized weight whatever ``dtype``, its rows interleaved where they come in whole groups:
        what the integer dots read, ``kernels.interleaved_dot``)."""
        if isinstance(array, QuantizedWeight):
            return InterleavedWeight.from_quantized(array) if interleavable(array) else array
        return aligned_copy(array, check_dtype(dtype, self.dtypes, self.name))

    def store_linear(self, weight: HostWeight, dtype: str) -> CpuWeight:
        """A linear layer's ``[out, in]`` weight, kept in that layout (what ``matmul`` reads)."""
        return self.to_storage(weight, dtype)

    def store_layers(self, make: Callable[[int], HostWeight], count: int, dtype: str, linear: bool) -> Any:
        """One weight of every layer (``make(i)`` for layer ``i``) in a single ``[count, ...]``
        array, whose ``[i]`` is layer ``i``'s (a C-contiguous view): what a whole compiled step
        (``cpu_step``) indexes by layer. Filled layer by layer, so loading never holds the
        weight twice. ``linear`` weights keep their ``[out, in]`` layout, as in :meth:`store_linear`;
        quantized ones stay a list, one a layer (as :meth:`to_storage` keeps them)."""
        first = self.to_storage(make(0), dtype)
        if isinstance(first, (QuantizedWeight, InterleavedWeight)):
            return [first, *(self.to_storage(make(i), dtype) for i in range(1, count))]
        stacked = aligned_empty((count, *first.shape), first.dtype)
        stacked[0] = first
        for i in range(1, count):
            stacked[i] = make(i)
        return stacked

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array, aligned by ``host_memory``."""
        return aligned_empty(shape, dtype)

    def upload_step(self, host: StepInputs) -> StepInputs:
        """The step metadata, ready for the kernels (host arrays are used as they are), with
        attention's split into prefill runs and other rows worked out once for every layer."""
        host.attention_split = run_attention.split_step(host.positions, host.token_seq)
        return host

    def run_step(self, buffers: tuple[Any, ...], num_tokens: int, launches: Callable[[], None]) -> None:
        """Run a step's kernels (``launches()``); the other arguments matter to CUDA only."""
        launches()

    def to_host(self, array: np.ndarray) -> np.ndarray:
        """A copy the caller owns (workspace buffers are overwritten by the next step)."""
        return array.copy()

    def embedding(self, token_ids: np.ndarray, table: CpuWeight, out: np.ndarray) -> None:
        """``out[t] = table[token_ids[t]]`` (a quantized table's rows dequantized)."""
        if isinstance(table, InterleavedWeight):
            interleaved_dot.interleaved_embedding_cpu(token_ids, table.quants, table.scales, table.minima,
                                                      half_table(), out)
            return
        if isinstance(table, QuantizedWeight):
            quantized_matmul.quantized_embedding_cpu(token_ids, table.quants, table.scales, table.minima,
                                                     half_table(), out)
            return
        embedding.embedding_gather_cpu(token_ids, table, out)

    def gather_rows(self, source: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = source[rows[i]]`` (float32 activations)."""
        np.take(source, rows, axis=0, out=out)

    def add_rmsnorm(self, x: np.ndarray, residual: np.ndarray, rows: np.ndarray, weight: np.ndarray,
                eps: np.float32, out: np.ndarray) -> None:
        """``x[r] += residual[r]`` (unless ``residual`` has no rows), ``out[i] = rmsnorm(x[r])``.
        On this thread alone at every size: in slices on the pool's threads a long prefill's norms
        ran slower, since the rows the last matmul's threads wrote move cores
        (docs/perf-log/cpu-anchors.md#2026-11-25-long-weight-streams)."""
        add_rmsnorm.add_rmsnorm_cpu(x, residual, rows, weight, eps, out)

    def matmul(self, x: np.ndarray, weight: CpuWeight, bias: np.ndarray, out: np.ndarray) -> None:
        """``out = x @ W.T + bias`` for ``weight`` from :meth:`store_linear` (``bias`` may be empty),
        read quantized where it is (interleaved: the integer dots at every row count, a prefill's too:
        2-3x BLAS sgemm's speed on the same matrix, docs/perf-log/quantized-weights.md)."""
        if isinstance(weight, InterleavedWeight):
            interleaved_dot.interleaved_dot_rows_cpu(x, weight.quants, weight.scales, weight.minima, half_table(),
                                                     bias, out, interleaved_dot.chunks())
            return
        if isinstance(weight, QuantizedWeight):
            quantized_matmul.quantized_matmul_cpu(x, weight, bias, out)
            return
        matmul.matmul_cpu(x, weight, bias, out)

    def rope_kv_append(self, qkv: np.ndarray, step: StepInputs, cos: np.ndarray, sin: np.ndarray,
                       k_cache: np.ndarray, v_cache: np.ndarray, layer: int, num_q_heads: int) -> None:
        """Rotate q in place and write rotated k and v into each token's page slot (a large step's
        rows in slices on the pool's threads)."""
        if _numba_threads_step(qkv.shape[0]):
            rope_kv.rope_kv_append_cpu(qkv, step.positions, step.token_seq, step.page_table, cos, sin,
                                       k_cache, v_cache, layer, num_q_heads)
            return
        self.cpu_pool.run_slices(
            lambda a, b: rope_kv.rope_kv_append_cpu(qkv[a:b], step.positions[a:b], step.token_seq[a:b],
                                                    step.page_table, cos, sin, k_cache, v_cache, layer, num_q_heads),
            qkv.shape[0])

    def attention(self, qkv: np.ndarray, step: StepInputs, k_cache: np.ndarray, v_cache: np.ndarray,
                  layer: int, num_q_heads: int, scale: np.float32, out: np.ndarray) -> None:
        """Causal paged attention of every new token over its sequence's cached keys: prefill runs
        of ``run_attention.MIN_RUN`` tokens or more with BLAS, the other rows (decodes, short
        chunks) with the scalar kernel."""
        split = step.attention_split
        assert split is not None, "upload_step sets the split of every CPU step"
        for start, end in split.runs:
            run_attention.run_attention(qkv, start, end, int(step.positions[start]), int(step.token_seq[start]),
                                        step.page_table, k_cache, v_cache, layer, num_q_heads, scale, out,
                                        self.cpu_pool)
        rest = split.other_rows
        threaded = _numba_threads_step(qkv.shape[0])
        if rest is None:
            self._scalar_attention(qkv, step.positions, step.token_seq, step.page_table, k_cache, v_cache, layer,
                                   num_q_heads, scale, out, threaded)
        elif len(rest):
            rest_out = np.empty((len(rest), out.shape[1]), dtype=out.dtype)
            self._scalar_attention(qkv[rest], step.positions[rest], step.token_seq[rest], step.page_table, k_cache,
                                   v_cache, layer, num_q_heads, scale, rest_out, threaded)
            out[rest] = rest_out

    def attention_splits(self, positions: np.ndarray, num_q_heads: int, k_cache: np.ndarray,
                         threaded: bool) -> tuple[int, int]:
        """Into how many slices of its heads and of its keys the scalar attention kernel cuts
        each token for numba's threads (``attention.cpu_attention_splits``), or ``(0, 0)``: run
        it single-threaded (a step too small to wake the threads for, or one whose matmuls are
        BLAS's)."""
        if not threaded:
            return 0, 0
        return attention.cpu_attention_splits(positions, num_q_heads, k_cache.shape[2], k_cache.shape[3],
                                              k_cache.shape[4], self.parallel_attention_min_work, self.numba_threads)

    def _scalar_attention(self, qkv: np.ndarray, positions: np.ndarray, token_seq: np.ndarray,
                          page_table: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layer: int,
                          num_q_heads: int, scale: np.float32, out: np.ndarray, threaded: bool) -> None:
        head_splits, key_splits = self.attention_splits(positions, num_q_heads, k_cache, threaded)
        if head_splits:
            attention.paged_attention_cpu(qkv, positions, token_seq, page_table, k_cache, v_cache, layer,
                                          num_q_heads, scale, out, head_splits, key_splits)
        else:
            attention.paged_attention_serial_cpu(qkv, positions, token_seq, page_table, k_cache, v_cache, layer,
                                                 num_q_heads, scale, out, 1, 1)

    def silu_mul(self, gate_up: np.ndarray, out: np.ndarray) -> None:
        """``out = silu(gate) * up`` over ``gate_up = [gate | up]``: on numba's threads when the
        step's matmuls do too (few rows), else in row slices on the pool's threads (numba's,
        spinning after the loop, would slow BLAS's next call)."""
        if _numba_threads_step(gate_up.shape[0]):
            silu_mul.silu_mul_cpu(gate_up, out)
            return
        self.cpu_pool.run_slices(lambda a, b: silu_mul.silu_mul_serial_cpu(gate_up[a:b], out[a:b]), gate_up.shape[0])

    def argmax(self, logits: np.ndarray, out: np.ndarray) -> None:
        """``out[r] = argmax(logits[r])``."""
        argmax.argmax_cpu(logits, out)


def _numba_threads_step(rows: int) -> bool:
    """Whether a step of ``rows`` tokens may run numba's threaded kernels: only when its matmuls
    are numba's too. Beside BLAS's own threads, numba's pool spinning after its loop leaves three
    threads to two cores, and a BLAS call whose thread loses its core waits a scheduler slice
    (a threaded ``silu_mul`` slowed a whole prefill: docs/perf-log/cpu-anchors.md#2026-11-25-threading-fixes)."""
    return rows <= matmul.CPU_ROWS_KERNEL_MAX_ROWS
