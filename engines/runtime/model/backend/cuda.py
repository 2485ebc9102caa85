"""numba.cuda kernels on the GPU, or on the simulator for tests (:class:`CudaBackend`), launched in
the :class:`LaunchShapes` of each kernel family."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numba
import numpy as np
from numba import cuda

from engines.runtime.model.backend.contract import Array, StepInputs, check_dtype
from engines.runtime.model.quant.dequantize import half_table
from engines.runtime.model.host_memory import available_bytes
from engines.runtime.model.quant.quantized_weight import BlockArrays, HostWeight, QuantizedWeight
from engines.runtime.model.kernels import (add_rmsnorm, argmax, attention, embedding, matmul, quantized_matmul,
                                           rope_kv, silu_mul, wide_load)
from engines.runtime.model.kernels.ops import ops_of

__all__ = ["GPU_LAUNCH_SHAPES", "SIMULATOR_LAUNCH_SHAPES", "CudaBackend", "DeviceQuantizedWeight", "LaunchShapes",
           "cuda_usable"]


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
    ops = ops_of("cuda")
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
        self.dtype = check_dtype(dtype, self.dtypes, self.name).name
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
        return cuda.to_device(np.ascontiguousarray(array, dtype=check_dtype(dtype, self.dtypes, self.name)))

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

