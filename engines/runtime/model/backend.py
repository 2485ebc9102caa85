"""Where the kernels run: :class:`CpuBackend` (numba ``@njit`` + NumPy BLAS on the host) and
:class:`CudaBackend` (numba.cuda kernels, weights and KV cache resident on the GPU).

Both have the same methods, and the model calls nothing else: array allocation
(``to_storage``, ``store_linear``, ``store_layers``, ``empty``), the per-step upload of the batch metadata
(``upload_step``), the ops (``embedding``, ``add_rmsnorm``, ``matmul``, ``rope_kv_append``,
``attention``, ``silu_mul``, ``argmax``), running a step's ops (``run_step``: replayed from
a CUDA graph on a GPU) and the copy of results back to the host (``to_host``). One more on the
CPU: ``gather_rows``, for the last layer of a step whose other rows return no logits
(``compacts_last_layer``).
Activation buffers live in a :class:`Workspace` that grows to the largest step seen and is
reused after that, so a steady decode loop allocates nothing, on either backend.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

import numba
import numpy as np
from numba import cuda

from engines.runtime.model.cpu_pool import CpuPool
from engines.runtime.model.quant.dequantize import half_table
from engines.runtime.model.host_memory import aligned_copy, aligned_empty, available_bytes
from engines.runtime.model.quant.interleaved_weight import InterleavedWeight, interleavable
from engines.runtime.model.quant.quantized_weight import BlockArrays, HostWeight, QuantizedWeight
from engines.runtime.model.kernels import (add_rmsnorm, argmax, attention, embedding, interleaved_dot, matmul,
                                           quantized_matmul, rope_kv, run_attention, silu_mul, wide_load)

if TYPE_CHECKING:
    from engines.runtime.telemetry.profiler import ProfiledBackend

Array = Any  # numpy.ndarray on the CPU backend, a numba DeviceNDArray on the CUDA backend
#: A weight as the CPU backend keeps it: float, or quantized (interleaved where its rows allow).
CpuWeight = Union[np.ndarray, QuantizedWeight, InterleavedWeight]
# What a model launches through: a backend, or the profiler's timed wrapper of one.
Backend = Union["CpuBackend", "CudaBackend", "ProfiledBackend"]

__all__ = [
    "Activations",
    "Backend",
    "CpuBackend",
    "CudaBackend",
    "LaunchShapes",
    "StepInputs",
    "Workspace",
    "select_backend",
]


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
    attention_split: "run_attention.AttentionSplit | None" = None


@dataclass
class Activations:
    """Views of the :class:`Workspace` sized for one step (``T`` tokens, ``R`` logit rows)."""

    hidden: Array    # [T, hidden] the residual stream
    delta: Array     # [T, hidden] the last sublayer's output, not yet added to ``hidden``
    normed: Array    # [T, hidden] RMSNorm output, the next matmul's input
    qkv: Array       # [T, (q_heads + 2 * kv_heads) * head_dim]
    attn: Array      # [T, q_heads * head_dim]
    gate_up: Array   # [T, 2 * intermediate]
    act: Array       # [T, intermediate]
    final: Array     # [R, hidden] final-normed rows that feed the LM head
    logits: Array    # [R, vocab]
    next_ids: Array  # [R] int32 greedy tokens
    no_residual: Array  # [0, hidden]: "nothing to add" for the first layer's norm


class Workspace:
    """Activation buffers reused across steps: one flat buffer per activation, grown (never
    shrunk) to the largest step seen; a step takes contiguous views of their fronts."""

    _TOKEN_WIDTHS = ("hidden", "delta", "normed", "qkv", "attn", "gate_up", "act")
    _ROW_WIDTHS = ("final", "logits")

    def __init__(self, backend: Backend, widths: dict[str, int]) -> None:
        self.backend = backend
        self.widths = widths
        self._flat: dict[str, Array] = {}
        self._capacity = (0, 0)
        self._views: dict[tuple[int, int], Activations] = {}
        self._no_residual = backend.empty((0, widths["hidden"]), np.float32)

    def activations(self, num_tokens: int, num_rows: int) -> Activations:
        """Buffers for a step of ``num_tokens`` new tokens and ``num_rows`` logit rows."""
        views = self._views.get((num_tokens, num_rows))
        if views is not None:
            return views
        tokens_cap, rows_cap = self._capacity
        if num_tokens > tokens_cap or num_rows > rows_cap:
            # Grow by doubling so that a slowly growing prefill does not reallocate each step.
            tokens_cap = max(num_tokens, 2 * tokens_cap)
            rows_cap = max(num_rows, 2 * rows_cap)
            for name in self._TOKEN_WIDTHS:
                self._flat[name] = self.backend.empty((tokens_cap * self.widths[name],), np.float32)
            for name in self._ROW_WIDTHS:
                self._flat[name] = self.backend.empty((rows_cap * self.widths[name],), np.float32)
            self._flat["next_ids"] = self.backend.empty((rows_cap,), np.int32)
            self._capacity = (tokens_cap, rows_cap)
            self._views.clear()

        def view(name: str, rows: int) -> Array:
            width = self.widths[name]
            return self._flat[name][: rows * width].reshape(rows, width)

        views = Activations(
            **{name: view(name, num_tokens) for name in self._TOKEN_WIDTHS},
            **{name: view(name, num_rows) for name in self._ROW_WIDTHS},
            next_ids=self._flat["next_ids"][:num_rows],
            no_residual=self._no_residual,
        )
        # Decode steps repeat the same few shapes: keep their views (cheap on the host, but
        # a DeviceNDArray view costs tens of microseconds to build).
        if len(self._views) >= 64:
            self._views.clear()
        self._views[(num_tokens, num_rows)] = views
        return views


def _check_dtype(dtype: str, allowed: tuple[str, ...], backend: str) -> np.dtype:
    if dtype not in allowed:
        raise ValueError(f"dtype {dtype!r} is not supported on the {backend} backend: use one of {', '.join(allowed)}")
    return np.dtype(dtype)


class CpuBackend:
    """The host backend: numba ``@njit(nogil=True)`` kernels and NumPy BLAS matmuls.

    Every op releases the GIL, so an engine thread computing a step does not stall the
    asyncio thread serving requests.
    """

    name = "cpu"
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
        return aligned_copy(array, _check_dtype(dtype, self.dtypes, self.name))

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


@dataclass(frozen=True)
class LaunchShapes:
    """Threads per block for each kernel family. All thread counts are powers of two."""

    row_threads: int              # add_rmsnorm, argmax, embedding, silu_mul
    attention_threads: int        # keys scored per chunk
    gemv_block: tuple[int, int]   # (lanes a warp: 32 on a GPU, warps = output columns)
    tile_block: tuple[int, int]   # tiled matmul; the block tile is 4x this
    gemv_max_rows: int            # matmuls with at most this many rows use the GEMV kernel
    attention_min_blocks: int     # attention splits a group's q heads across blocks below this many


# Real GPUs: enough threads in flight to hide memory latency (a GEMV warp keeps two 16-byte
# loads a lane in flight; four warps a block, so a 2048-column layer is 512 blocks).
GPU_LAUNCH_SHAPES = LaunchShapes(row_threads=128, attention_threads=64, gemv_block=(32, 4),
                                 tile_block=(16, 16), gemv_max_rows=32, attention_min_blocks=264)
# The simulator runs one Python thread per CUDA thread: the smallest blocks that still
# exercise every code path (several threads per reduction, several slices, partial tiles).
SIMULATOR_LAUNCH_SHAPES = LaunchShapes(row_threads=8, attention_threads=8, gemv_block=(8, 2),
                                       tile_block=(2, 2), gemv_max_rows=4, attention_min_blocks=8)


class _LaunchableKernel:
    """A kernel bound to the one signature this backend launches it with.

    On a GPU it is compiled up front and launched directly, which skips numba's per-call
    argument typing. The simulator has no compiled form; there the dispatcher is called as
    usual.
    """

    def __init__(self, dispatcher: Any, signature: str, simulated: bool) -> None:
        self._dispatcher = dispatcher
        self._compiled = None if simulated else dispatcher.compile(signature)

    def __call__(self, stream: Any, grid: tuple[int, ...], block: tuple[int, ...], *args: Any) -> None:
        if self._compiled is None:
            self._dispatcher[grid, block](*args)
        else:
            self._compiled.launch(args, _dim3(grid), _dim3(block), stream, 0)


def _dim3(dims: tuple[int, ...]) -> tuple[int, int, int]:
    x, y, z = (*dims, 1, 1, 1)[:3]
    return x, y, z


def _blocks(n: int, per_block: int) -> int:
    return max(1, -(-n // per_block))


@dataclass(frozen=True)
class DeviceQuantizedWeight(BlockArrays):
    """A :class:`QuantizedWeight`'s arrays copied to the GPU as they are (the same row-major
    layout): what the CUDA backend's quantized kernels read."""


class CudaBackend:
    """numba.cuda kernels on the GPU (or on the simulator, for tests).

    Weights and the KV cache stay on the device. Per step, the batch metadata goes up in
    one host-to-device copy (:meth:`upload_step`) and only logits or greedy ids come back.
    Storage dtype float16 halves weight and KV bytes; arithmetic stays float32.

    A numba launch costs tens of microseconds of Python, and a decode step of a small model
    is a few microseconds of GPU work per kernel, so :meth:`run_step` records each small
    step's launches once as a CUDA graph and replays it: one launch per step.
    """

    name = "cuda"
    dtypes = ("float32", "float16")
    #: Not yet: the logit rows' own step would need its positions and sequences in the packed
    #: upload (``upload_step``) and a float32 row gather; every row runs every layer here.
    compacts_last_layer = False
    # Steps of at most this many tokens (decode, short chunks) are replayed from graphs;
    # longer prefill chunks vary in size too much to be worth recording.
    graph_max_tokens = 64
    max_graphs = 64

    def __init__(self, dtype: str = "float32", shapes: LaunchShapes | None = None) -> None:
        self.simulated = bool(numba.config.ENABLE_CUDASIM)  # type: ignore[attr-defined]  # set at import
        self.dtype = _check_dtype(dtype, self.dtypes, self.name).name
        self.shapes = shapes or (SIMULATOR_LAUNCH_SHAPES if self.simulated else GPU_LAUNCH_SHAPES)

        def bind(module: Any, kernel: Any) -> _LaunchableKernel:
            return self._bind(module, kernel, self.dtype)

        self._embedding = bind(embedding, embedding.embedding_gather_cuda)
        self._add_rmsnorm = bind(add_rmsnorm, add_rmsnorm.add_rmsnorm_cuda)
        self._gemv = bind(matmul, matmul.gemv_cuda)
        self._tiled = bind(matmul, matmul.matmul_tiled_cuda)
        self._rope_kv = bind(rope_kv, rope_kv.rope_kv_append_cuda)
        self._attention = bind(attention, attention.paged_attention_cuda)
        self._silu_mul = bind(silu_mul, silu_mul.silu_mul_cuda)
        self._argmax = bind(argmax, argmax.argmax_cuda)
        # The quantized weights' kernels, by (kernel, quants dtype), compiled at their first use:
        # most models have none. And every half as float32, the scales' table, on the device.
        self._quantized: dict[tuple[Any, str], _LaunchableKernel] = {}
        self._half_table: Array | None = None
        # The step metadata is packed into one pinned host buffer and copied up at once.
        self._meta_host = cuda.pinned_array(4096, np.int32)
        self._meta_device = cuda.device_array(4096, np.int32)
        self._meta_views: dict[tuple[int, ...], tuple[Array, StepInputs]] = {}
        # Kernels go to the legacy default stream, which orders them after the synchronous
        # metadata copy and before the copy of results; while a graph is being recorded
        # they go to its builder instead. Graph recording needs a stream of its own (the
        # legacy stream cannot be captured). None under the simulator: no graphs there.
        self._graphs: dict[tuple[int, ...], tuple[Any, tuple[Any, ...]]] = {}
        if self.simulated:
            self._default_stream = self._stream = self._record_stream = None
        else:
            from numba.cuda.cudadrv import driver

            # (The ignores: mypy reads the numba.cuda bundled with numba; at run time numba-cuda's
            # package takes its place, and its driver has this helper.)
            self._default_stream = self._stream = driver._to_core_stream(0)  # type: ignore[attr-defined]
            # Keep numba's stream object alive: its finalizer destroys the CUDA stream, and
            # the core wrapper below does not own it (a collected stream made recording fail).
            self._numba_record_stream = cuda.stream()
            self._record_stream = driver._to_core_stream(self._numba_record_stream)  # type: ignore[attr-defined]

    def free_memory_bytes(self) -> int | None:
        """Device memory free now (the simulator's arrays live on the host: host memory there)."""
        if self.simulated:
            return available_bytes()
        free, _total = cuda.current_context().get_memory_info()
        return int(free)

    def device_name(self) -> str:
        """The GPU's name, as a profile names it."""
        try:
            name = cuda.get_current_device().name
        except Exception:  # noqa: BLE001 - the simulator has no device to name
            return "cuda (simulator)"
        return name.decode() if isinstance(name, bytes) else str(name)

    def peak_bandwidth(self) -> tuple[float | None, str]:
        """The memory bandwidth kernels are compared with, in GB/s, from the device's memory clock
        and bus width (double data rate), and where it came from; none on the simulator."""
        try:
            device = cuda.get_current_device()
            clock_khz, bus_bits = device.MEMORY_CLOCK_RATE, device.GLOBAL_MEMORY_BUS_WIDTH
        except Exception:  # noqa: BLE001 - the simulator has no such attributes
            return None, ""
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "device"

    def cuda_profiler(self, start: bool) -> None:
        """``cudaProfilerStart`` (``start``) or ``Stop``; on the engine's thread, where the device's
        primary context is current."""
        (cuda.profile_start if start else cuda.profile_stop)()

    def run_step(self, buffers: tuple[Any, ...], num_tokens: int, launches: Callable[[], None]) -> None:
        """Run a step's kernels: ``launches()`` launches them, reading and writing only
        ``buffers`` (device arrays, or objects holding them) and the model's weights.

        On a GPU, a step of at most ``graph_max_tokens`` tokens is recorded as a CUDA graph
        the first time these ``buffers`` are seen, then replayed; the buffers' contents may
        change between replays, not their addresses or shapes.
        """
        if self._record_stream is None or num_tokens > self.graph_max_tokens:
            launches()
            return
        key = tuple(id(b) for b in buffers)
        # The entry keeps ``buffers`` alive, so their ids cannot be reused while it exists.
        entry = self._graphs.pop(key, None)
        graph = entry[0] if entry is not None else self._record(self._record_stream, launches)
        self._graphs[key] = (graph, buffers)  # most recently used last
        if len(self._graphs) > self.max_graphs:
            del self._graphs[next(iter(self._graphs))]
        graph.launch(self._default_stream)

    def _record(self, stream: Any, launches: Callable[[], None]) -> Any:
        builder = stream.create_graph_builder()
        builder.begin_building()
        self._stream = builder
        try:
            launches()
        finally:
            self._stream = self._default_stream
            builder.end_building()
        return builder.complete()

    def _bind(self, module: Any, kernel: Any, dt: str) -> _LaunchableKernel:
        return _LaunchableKernel(kernel, module.CUDA_SIGNATURES[kernel].format(dt=dt), self.simulated)

    def _quantized_kernel(self, kernel: Any, weight: "DeviceQuantizedWeight") -> _LaunchableKernel:
        key = (kernel, str(weight.quants.dtype))
        if key not in self._quantized:
            self._quantized[key] = self._bind(quantized_matmul, kernel, key[1])
        return self._quantized[key]

    def _scales_table(self) -> Array:
        if self._half_table is None:
            self._half_table = cuda.to_device(half_table())
        return self._half_table

    def to_storage(self, array: HostWeight, dtype: str) -> Array:
        """``array`` in storage dtype ``dtype``, copied to the device (a quantized weight's blocks as
        they are, whatever ``dtype``: :class:`DeviceQuantizedWeight`)."""
        if isinstance(array, QuantizedWeight):
            quants, scales, minima = (cuda.to_device(a) for a in (array.quants, array.scales, array.minima))
            return DeviceQuantizedWeight(array.ggml_type, quants, scales, minima, array.converted_from)
        return cuda.to_device(np.ascontiguousarray(array, dtype=_check_dtype(dtype, self.dtypes, self.name)))

    def store_linear(self, weight: HostWeight, dtype: str) -> Array:
        """A linear layer's ``[out, in]`` weight on the device, as it is (``kernels.matmul``)."""
        return self.to_storage(weight, dtype)

    def store_layers(self, make: Callable[[int], HostWeight], count: int, dtype: str, linear: bool) -> Sequence[Array]:
        """One weight of every layer (``make(i)`` for layer ``i``), a device array each (linear
        ones as by :meth:`store_linear`): graphs replay per-layer launches, and one
        array per layer keeps the host's staging copy to a layer."""
        store = self.store_linear if linear else self.to_storage
        return [store(make(i), dtype) for i in range(count)]

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Array:
        """An uninitialised C-contiguous device array."""
        return cuda.device_array(shape, dtype=dtype)

    def upload_step(self, host: StepInputs) -> StepInputs:
        """Copy the step metadata to the device in one transfer; returns device views.

        Views are cached per layout: building a DeviceNDArray view costs tens of
        microseconds, and a decode loop repeats the same few layouts.
        """
        parts = (host.token_ids, host.positions, host.token_seq, host.rows, host.logit_rows, host.page_table)
        sizes = tuple(p.size for p in parts)
        total = sum(sizes)
        if total > self._meta_host.size:
            capacity = max(total, 2 * self._meta_host.size)
            self._meta_host = cuda.pinned_array(capacity, np.int32)
            self._meta_device = cuda.device_array(capacity, np.int32)
            self._meta_views.clear()
        offset = 0
        for part, size in zip(parts, sizes, strict=True):
            self._meta_host[offset:offset + size] = part.reshape(-1)
            offset += size
        key = sizes + host.page_table.shape
        cached = self._meta_views.get(key)
        if cached is None:
            bounds = np.cumsum((0,) + sizes)
            ids, pos, seq, rows, logit_rows, table = (
                self._meta_device[bounds[i]:bounds[i + 1]] for i in range(len(parts))
            )
            views = StepInputs(token_ids=ids, positions=pos, token_seq=seq, rows=rows, logit_rows=logit_rows,
                               page_table=table.reshape(host.page_table.shape))
            cached = (self._meta_device[:total], views)
            if len(self._meta_views) >= 64:
                self._meta_views.clear()
            self._meta_views[key] = cached
        device_front, views = cached
        device_front.copy_to_device(self._meta_host[:total])
        return views

    def to_host(self, array: Array) -> np.ndarray:
        """Copy a device array back (waits for the step's kernels to finish)."""
        return array.copy_to_host()

    def embedding(self, token_ids: Array, table: Array, out: Array) -> None:
        """``out[t] = table[token_ids[t]]``, widened to float32 (a quantized table's rows dequantized)."""
        threads = self.shapes.row_threads
        if isinstance(table, DeviceQuantizedWeight):
            self._quantized_kernel(quantized_matmul.quantized_embedding_cuda, table)(
                self._stream, (out.shape[0], _blocks(out.shape[1], threads)), (threads,), token_ids, table.quants,
                table.scales, table.minima, self._scales_table(), out)
            return
        self._embedding(self._stream, (out.shape[0], _blocks(out.shape[1], threads)), (threads,), token_ids, table, out)

    def add_rmsnorm(self, x: Array, residual: Array, rows: Array, weight: Array, eps: np.float32, out: Array) -> None:
        """``x[r] += residual[r]`` (unless ``residual`` has no rows), ``out[i] = rmsnorm(x[r])``."""
        self._add_rmsnorm(self._stream, (rows.shape[0],), (self.shapes.row_threads,), x, residual, rows, weight, eps,
                          out)

    def matmul(self, x: Array, weight: Array, bias: Array, out: Array) -> None:
        """``out = x @ W.T + bias`` for ``weight`` from :meth:`store_linear`: GEMV kernel for
        few rows (whose rows load in whole 16-byte chunks), tiled kernel otherwise; a quantized
        weight through its GEMV at every row count (``quantized_matmul.quantized_gemv_cuda``)."""
        rows, cols = x.shape[0], weight.shape[0]
        if isinstance(weight, DeviceQuantizedWeight):
            warps = min(self.shapes.gemv_block[1], quantized_matmul.GEMV_MAX_WARPS)
            self._quantized_kernel(quantized_matmul.quantized_gemv_cuda, weight)(
                self._stream, (_blocks(cols, warps), _blocks(rows, quantized_matmul.GEMV_ROWS)),
                (quantized_matmul.WARP, warps), x, weight.quants, weight.scales, weight.minima, self._scales_table(),
                bias, out)
            return
        if rows <= self.shapes.gemv_max_rows and wide_load.loadable(weight):
            lanes, warps = self.shapes.gemv_block
            self._gemv(self._stream, (_blocks(rows, matmul.GEMV_ROWS), _blocks(cols, warps)), (lanes, warps), x,
                       weight, bias, out)
        else:
            bx, by = self.shapes.tile_block
            self._tiled(self._stream, (_blocks(cols, 4 * bx), _blocks(rows, 4 * by)), (bx, by), x, weight, bias, out)

    def rope_kv_append(self, qkv: Array, step: StepInputs, cos: Array, sin: Array,
                       k_cache: Array, v_cache: Array, layer: int, num_q_heads: int) -> None:
        """Rotate q in place and write rotated k and v into each token's page slot."""
        heads = num_q_heads + k_cache.shape[2]
        self._rope_kv(self._stream, (qkv.shape[0], heads), (k_cache.shape[4] // 2,), qkv, step.positions,
                      step.token_seq, step.page_table, cos, sin, k_cache, v_cache, layer, num_q_heads)

    def attention(self, qkv: Array, step: StepInputs, k_cache: Array, v_cache: Array,
                  layer: int, num_q_heads: int, scale: np.float32, out: Array) -> None:
        """Causal paged attention of every new token over its sequence's cached keys."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[4]
        group = num_q_heads // num_kv_heads
        threads = self.attention_threads(group, head_dim)
        blocks = qkv.shape[0] * num_kv_heads
        # Too few (token, kv head) blocks to fill the GPU (a decode step): the group's q heads
        # go to blocks of their own, as many as it takes (a divisor of the group).
        splits = 1
        while splits < group and blocks * splits < self.shapes.attention_min_blocks:
            splits += 1
            while group % splits:
                splits += 1
        self._attention(self._stream, (qkv.shape[0], num_kv_heads, splits), (threads,), qkv, step.positions,
                        step.token_seq, step.page_table, k_cache, v_cache, layer, num_q_heads, scale, out)

    def attention_threads(self, group: int, head_dim: int) -> int:
        """Threads per attention block: the configured count, or more if the group's
        ``group * head_dim`` accumulators would not fit ``ATTN_MAX_PAIRS`` per thread."""
        needed = -(-group * head_dim // attention.ATTN_MAX_PAIRS)
        threads = max(self.shapes.attention_threads, 1 << max(0, math.ceil(math.log2(needed))))
        if (threads > attention.ATTN_MAX_THREADS or group > attention.ATTN_MAX_GROUP
                or head_dim > attention.ATTN_MAX_HEAD_DIM or head_dim % 4):
            raise ValueError(
                f"attention with {group} q heads per kv head and head_dim {head_dim} is outside the CUDA kernel's "
                f"limits (group <= {attention.ATTN_MAX_GROUP}, head_dim <= {attention.ATTN_MAX_HEAD_DIM} and a "
                "multiple of 4)"
            )
        return threads

    def silu_mul(self, gate_up: Array, out: Array) -> None:
        """``out = silu(gate) * up`` over ``gate_up = [gate | up]``."""
        threads = self.shapes.row_threads
        self._silu_mul(self._stream, (out.shape[0], _blocks(out.shape[1], threads)), (threads,), gate_up, out)

    def argmax(self, logits: Array, out: Array) -> None:
        """``out[r] = argmax(logits[r])`` on the device."""
        self._argmax(self._stream, (logits.shape[0],), (self.shapes.row_threads,), logits, out)


def cuda_usable() -> bool:
    """Whether a real GPU can run the CUDA backend (the simulator does not count)."""
    return not numba.config.ENABLE_CUDASIM and cuda.is_available()  # type: ignore[attr-defined]  # set at import


def select_backend(name: str = "auto", dtype: str = "float32") -> Backend:
    """The backend called ``name``: ``"cuda"``, ``"cpu"``, or ``"auto"`` (cuda when a real
    GPU is usable, else cpu). ``"cuda"`` under the simulator is allowed: that is how tests
    run the CUDA path on tiny shapes."""
    if name == "auto":
        name = "cuda" if cuda_usable() else "cpu"
    if name == "cpu":
        _check_dtype(dtype, CpuBackend.dtypes, "cpu")
        return CpuBackend()
    if name == "cuda":
        if not numba.config.ENABLE_CUDASIM and not cuda.is_available():  # type: ignore[attr-defined]
            raise ValueError("backend 'cuda' requested but numba.cuda finds no usable GPU: use backend='cpu' or 'auto'")
        return CudaBackend(dtype)
    raise ValueError(f"unknown backend {name!r}: use 'auto', 'cuda' or 'cpu'")
