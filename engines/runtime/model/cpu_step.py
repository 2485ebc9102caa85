"""A CPU decode step as one compiled function: what the CUDA graph is to the GPU backend.

The per-kernel path (``LlamaModel._launch``) calls nine kernels a layer from Python, each through
numba's dispatcher, which unboxes and type-checks every array argument: 0.7 us a call with warm
caches, about 9 us once the step's weights have streamed through them, ~75 calls a step, plus
the backend's Python around each. :func:`decode_step_cpu` makes the same calls from compiled
code, where a call is a native call, and Python pays one dispatch a step. On this 2-core machine
that is a few per cent of a 4-5 ms step (bench/cpu_anchors.py --per-kernel: 1.05x at batch 1 on
one thread, 0.98-1.04 elsewhere, within the noise); it pays most where steps are shortest.

The step takes the batch as the caller made it (:class:`~engines.runtime.model.llama.ForwardBatch`'s
int32 arrays) and checks and derives its metadata itself (``step_inputs.derive_int32``), so that
Python pays one call a step: apart, the checks, the metadata's dataclass and attention's split
each cost another call into cold caches (a batch-1 generation's Python outside the compiled call
60-86 -> 40-59 us a step, alternated processes; BENCHMARKS.md, issue 15). A batch it finds invalid runs nothing and goes to the
per-kernel path, which raises the reference's ``ValueError``.

It runs the backend's own kernels, in the same order, on the same buffers, with the same
attention split, but for one fusion: in a step of one token the MLP's gate/up projection and its
SwiGLU are one kernel (``matmul.matmul_swiglu_cpu``), whose ``[gate | up]`` product is never
stored (a batch-1 step ~2% faster). LLVM optimises the kernels again inside the step and may sum a
reassociated reduction in another order, so results match the per-kernel path's to float32
rounding, not bit for bit (tests/runtime/model/test_cpu_step.py diffs the two). It covers the
steps whose every op is one of those numba kernels: at most ``matmul.CPU_ROWS_KERNEL_MAX_ROWS``
new tokens (so no BLAS matmul and no BLAS attention run). The profiler's timed backend replaces the model's own, and the
model then launches kernel by kernel, as the CUDA backend launches without its graph while
profiling.

numba's on-disk cache keys a compiled function by its own bytecode, not by its callees': a
kernel edited since the step was cached would still run in its old form. The step is therefore
made by a closure over a digest of the kernel modules' sources, whose contents numba's key
includes: an edit to any of them compiles the step anew.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
from numba import njit

from engines.runtime.model import step_inputs
from engines.runtime.model.backend import Activations, CpuBackend
from engines.runtime.model.kernels import add_rmsnorm, argmax, attention, embedding, fast_exp, matmul, rope_kv, silu_mul
from engines.runtime.model.kv_storage import PagedKVCache

if TYPE_CHECKING:
    from engines.runtime.model.llama import ForwardBatch, LlamaModel

__all__ = ["CpuDecodeStep", "decode_step_cpu", "kernel_sources_digest"]

#: The modules whose compiled code :func:`decode_step_cpu` holds (callees and theirs).
STEP_KERNEL_MODULES = (step_inputs, embedding, add_rmsnorm, matmul, rope_kv, attention, fast_exp, silu_mul, argmax)


def kernel_sources_digest(modules: tuple = STEP_KERNEL_MODULES) -> str:
    """A SHA-256 of the source files of ``modules``: part of :func:`decode_step_cpu`'s cache key."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


def _make_decode_step(kernels_digest: str) -> Callable[..., bool]:
    """The compiled step, its cache entry keyed by ``kernels_digest`` (see the module's docstring)."""

    @njit(nogil=True, cache=True)
    def decode_step_cpu(token_ids, query_starts, cached_lens, page_table, all_logits,  # the batch
                        vocab_size, max_positions,
                        embed, input_norm, qkv_w, qkv_bias, o_w, post_norm, gate_up_w, down_w,  # weights
                        final_norm, lm_head_w, no_bias, cos, sin, eps, num_q_heads, scale,
                        k_cache, v_cache, parallel_attention_min_work, threads, greedy,  # KV, attention's split
                        hidden, no_residual, normed, qkv, attn, delta, gate_up, act, final, logits, next_ids):
        """``LlamaModel._launch`` for one step of a checked batch (False, and nothing run, for an
        invalid one), kernel for kernel but, for one token, the MLP's gate/up projection and
        SwiGLU as one kernel (``matmul_swiglu_cpu``); attention split over numba's threads as
        ``CpuBackend.attention_splits`` splits it ((0, 0): single-threaded)."""
        kernels_digest  # noqa: B018 - referenced so that it is in the closure, hence in the cache key
        ok, positions, token_seq, page_table, logit_rows = step_inputs.derive_int32(
            token_ids, query_starts, cached_lens, page_table, vocab_size, max_positions, k_cache.shape[3],
            k_cache.shape[1])
        rows = np.arange(token_ids.shape[0], dtype=np.int32)
        if all_logits:
            logit_rows = rows
        # The buffers must be the batch's size (``forward`` sizes them; ``run`` is public): no
        # kernel checks a bound.
        if not ok or hidden.shape[0] != token_ids.shape[0] or logits.shape[0] != logit_rows.shape[0] \
                or next_ids.shape[0] != logit_rows.shape[0]:
            return False
        head_splits, key_splits = attention.cpu_attention_splits(positions, num_q_heads, k_cache.shape[2],
                                                                 k_cache.shape[3], k_cache.shape[4],
                                                                 parallel_attention_min_work, threads)
        # One token, and whole (gate, up) pairs in each block of the fused kernel: see matmul_swiglu_cpu.
        swiglu_fused = token_ids.shape[0] == 1 and gate_up_w.shape[1] % 4 == 0
        embedding.embedding_gather_cpu(token_ids, embed, hidden)
        for layer in range(qkv_w.shape[0]):
            residual = no_residual if layer == 0 else delta
            add_rmsnorm.add_rmsnorm_cpu(hidden, residual, rows, input_norm[layer], eps, normed)
            matmul.matmul_rows_cpu(normed, qkv_w[layer], qkv_bias[layer], qkv)
            rope_kv.rope_kv_append_cpu(qkv, positions, token_seq, page_table, cos, sin, k_cache, v_cache, layer,
                                       num_q_heads)
            if head_splits > 0:
                attention.paged_attention_cpu(qkv, positions, token_seq, page_table, k_cache, v_cache, layer,
                                              num_q_heads, scale, attn, head_splits, key_splits)
            else:
                attention.paged_attention_serial_cpu(qkv, positions, token_seq, page_table, k_cache, v_cache, layer,
                                                     num_q_heads, scale, attn, 1, 1)
            matmul.matmul_rows_cpu(attn, o_w[layer], no_bias, delta)
            add_rmsnorm.add_rmsnorm_cpu(hidden, delta, rows, post_norm[layer], eps, normed)
            if swiglu_fused:
                matmul.matmul_swiglu_cpu(normed, gate_up_w[layer], act)
            else:
                matmul.matmul_rows_cpu(normed, gate_up_w[layer], no_bias, gate_up)
                silu_mul.silu_mul_cpu(gate_up, act)
            matmul.matmul_rows_cpu(act, down_w[layer], no_bias, delta)
        add_rmsnorm.add_rmsnorm_cpu(hidden, delta, logit_rows, final_norm, eps, final)
        matmul.matmul_rows_cpu(final, lm_head_w, no_bias, logits)
        if greedy:
            argmax.argmax_cpu(logits, next_ids)
        return True

    return decode_step_cpu


decode_step_cpu = _make_decode_step(kernel_sources_digest())


class CpuDecodeStep:
    """A model's small steps on the CPU backend as one call of :func:`decode_step_cpu`."""

    def __init__(self, model: "LlamaModel", backend: CpuBackend) -> None:
        self.backend = backend
        self.model = model
        first = model.layers[0].attention
        self.num_q_heads, self.scale = first.num_q_heads, first.scale
        self.cos, self.sin = first.cos, first.sin

    def forward(self, batch: "ForwardBatch", kv: PagedKVCache, greedy: bool) -> Activations | None:
        """Run ``batch`` if it is a step this covers (int32 arrays, at most
        ``matmul.CPU_ROWS_KERNEL_MAX_ROWS`` new tokens: no BLAS matmul, no BLAS attention run) and
        valid; its results are in the activations returned, as the per-kernel path's would be.
        None, and nothing run, otherwise (the per-kernel path then runs it, or raises)."""
        if not step_inputs.int32_batch(batch):
            return None
        num_tokens = batch.token_ids.shape[0]
        num_rows = num_tokens if batch.all_logits else batch.query_starts.shape[0] - 1
        # A valid batch has 1 <= rows <= tokens: checked before its buffers are sized by it.
        if not 0 < num_rows <= num_tokens <= matmul.CPU_ROWS_KERNEL_MAX_ROWS:
            return None
        act = self.model.workspace.activations(num_tokens, num_rows)
        return act if self.run(batch, act, kv, greedy) else None

    def run(self, batch: "ForwardBatch", act: Activations, kv: PagedKVCache, greedy: bool) -> bool:
        """One call of :func:`decode_step_cpu` on buffers sized for ``batch`` (see :meth:`forward`);
        False, and nothing run, for an invalid batch or buffers of another size."""
        m, w, be, c = self.model, self.model.layer_weights, self.backend, self.model.config
        return decode_step_cpu(batch.token_ids, batch.query_starts, batch.cached_lens, batch.page_table,
                               batch.all_logits, c.vocab_size, c.max_position_embeddings,
                               m.embed_tokens, w.input_norm, w.qkv_w, w.qkv_bias, w.o_w, w.post_attention_norm,
                               w.gate_up_w, w.down_w, m.norm, m.lm_head_w, m.no_bias, self.cos, self.sin, m.eps,
                               self.num_q_heads, self.scale, kv.k, kv.v,
                               be.parallel_attention_min_work, be.numba_threads, greedy,
                               act.hidden, act.no_residual, act.normed, act.qkv, act.attn, act.delta, act.gate_up,
                               act.act, act.final, act.logits, act.next_ids)
