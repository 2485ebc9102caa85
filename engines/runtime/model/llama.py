"""A Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Reads top to bottom like the architecture: an embedding, ``num_hidden_layers`` decoder
layers (RMSNorm -> grouped-query attention with RoPE -> residual, RMSNorm -> SwiGLU MLP ->
residual), a final RMSNorm and the LM head. Every op is a call on the backend
(``engines.runtime.model.backend``), which runs the numba kernels on the CPU or the GPU.

A forward step takes a ragged batch (:class:`ForwardBatch`): for each sequence its new
tokens (a prefill chunk or one decode token), how many of its tokens the cache already
holds, and its page table. The step appends the new tokens' K/V into their page slots and
attends over each sequence's whole history; the pages themselves belong to the caller
(the engine's ``KVCachePool``).

Residual stream bookkeeping: a sublayer writes its output to ``act.delta`` and the next
RMSNorm adds it into ``act.hidden`` (the fused add), so the stream is read and written
once per sublayer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import numpy as np

from engines.runtime.model.backend import (Activations, Array, Backend, CpuBackend, CudaBackend, StepInputs, Workspace,
                                           select_backend)
from engines.runtime.model.cpu_step import CpuDecodeStep
from engines.runtime.model.config import ModelConfig
from engines.runtime.model.forward_batch import ForwardBatch
from engines.runtime.model.quant.quantized_weight import HostWeight
from engines.runtime.model.kv_storage import PagedKVCache
from engines.runtime.model.step_inputs import IdentityRows, step_inputs
from engines.runtime.model.weight_placement import check_weights, place_weights

if TYPE_CHECKING:
    from engines.runtime.model.checkpoint import Checkpoint

__all__ = ["LlamaModel", "PagedKVCache"]


class Attention:
    """Grouped-query self-attention of one layer: fused q/k/v projection (+ bias for Qwen2),
    RoPE + KV append (:meth:`project`), paged attention and the output projection (:meth:`attend`),
    the two apart so that the last layer may attend from fewer rows than it projects."""

    def __init__(self, backend: Backend, config: ModelConfig, layer: int, qkv_w: Array, qkv_bias: Array,
                 o_w: Array, no_bias: Array, rope: tuple[Array, Array]) -> None:
        self.backend = backend
        self.layer = layer
        self.num_q_heads = config.num_attention_heads
        self.scale = np.float32(config.head_dim ** -0.5)
        self.qkv_w, self.qkv_bias, self.o_w, self.no_bias = qkv_w, qkv_bias, o_w, no_bias
        self.cos, self.sin = rope

    def project(self, x: Array, act: Activations, step: StepInputs, kv: PagedKVCache) -> None:
        """q, k and v of every row into ``act.qkv`` (q rotated in place), k and v into the cache."""
        be = self.backend
        be.matmul(x, self.qkv_w, self.qkv_bias, act.qkv)
        be.rope_kv_append(act.qkv, step, self.cos, self.sin, kv.k, kv.v, self.layer, self.num_q_heads)

    def attend(self, act: Activations, step: StepInputs, kv: PagedKVCache) -> None:
        """Attention of the rows of ``act.qkv`` (projected) and the output projection into ``act.delta``."""
        be = self.backend
        be.attention(act.qkv, step, kv.k, kv.v, self.layer, self.num_q_heads, self.scale, act.attn)
        be.matmul(act.attn, self.o_w, self.no_bias, act.delta)


class MLP:
    """SwiGLU feed-forward: fused gate/up projection, ``silu(gate) * up``, down projection."""

    def __init__(self, backend: Backend, gate_up_w: Array, down_w: Array, no_bias: Array) -> None:
        self.backend = backend
        self.gate_up_w, self.down_w, self.no_bias = gate_up_w, down_w, no_bias

    def __call__(self, x: Array, act: Activations) -> None:
        """Transform the normed input ``x``; the result lands in ``act.delta``."""
        be = self.backend
        be.matmul(x, self.gate_up_w, self.no_bias, act.gate_up)
        be.silu_mul(act.gate_up, act.act)
        be.matmul(act.act, self.down_w, self.no_bias, act.delta)


@dataclass(frozen=True)
class LogitRows:
    """A step's logit rows as a step of their own (rows ``0 .. R-1``, their positions and
    sequences, the same page table) and its activations: what the last layer computes for them."""

    step: StepInputs
    act: Activations


class DecoderLayer:
    """Pre-norm transformer block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, backend: Backend, eps: np.float32, input_norm: Array, attention: Attention,
                 post_attention_norm: Array, mlp: MLP) -> None:
        self.backend = backend
        self.eps = eps
        self.input_norm, self.attention = input_norm, attention
        self.post_attention_norm, self.mlp = post_attention_norm, mlp

    def __call__(self, act: Activations, residual: Array, step: StepInputs, kv: PagedKVCache,
                 logit_rows: LogitRows | None = None) -> None:
        """``residual`` is the previous layer's MLP output, still to be added to the stream
        (``act.no_residual`` for the first layer).

        With ``logit_rows`` (the last layer of a step whose other rows feed nothing but the KV
        cache): every row's keys and values, then the rest for those rows alone, gathered into
        ``logit_rows.act``, where the result lands."""
        be = self.backend
        be.add_rmsnorm(act.hidden, residual, step.rows, self.input_norm, self.eps, act.normed)
        self.attention.project(act.normed, act, step, kv)
        if logit_rows is not None:  # only from a backend that compacts_last_layer: the CPU's, which gathers rows
            be.gather_rows(act.qkv, step.logit_rows, logit_rows.act.qkv)  # type: ignore[attr-defined]
            be.gather_rows(act.hidden, step.logit_rows, logit_rows.act.hidden)  # type: ignore[attr-defined]
            act, step = logit_rows.act, logit_rows.step
        self.attention.attend(act, step, kv)
        be.add_rmsnorm(act.hidden, act.delta, step.rows, self.post_attention_norm, self.eps, act.normed)
        self.mlp(act.normed, act)


class LlamaModel:
    """A Llama-family causal LM whose weights live on ``backend`` in storage ``dtype``."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, HostWeight],
                 backend: str = "auto", dtype: str = "float32") -> None:
        """Check ``weights`` (HF tensor names) against ``config`` and move them to the backend.

        Raises :class:`CheckpointError` naming the first missing or misshapen tensor, and
        ``ValueError`` for a backend/dtype that cannot run.
        """
        check_weights(config, weights)
        self.config = config
        self.backend: Backend = select_backend(backend, dtype)
        self.backend_name = self.backend.name
        self.dtype = dtype
        #: K and V bytes one token takes in every layer of the KV cache.
        self.kv_bytes_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                                   * np.dtype(dtype).itemsize)
        if isinstance(self.backend, CudaBackend):
            # Fail at load, not at the first step, if the attention kernel cannot fit this shape.
            self.backend.attention_threads(config.num_attention_heads // config.num_key_value_heads, config.head_dim)
        be, c = self.backend, config
        placed = place_weights(be, c, weights, dtype)
        #: The weights' storage ("Q4_1 x210, Q8_0 x1", or ``dtype``) and their bytes
        #: (``weight_placement.PlacedWeights``).
        self.weights_format, self.weight_bytes = placed.weights_format, placed.weight_bytes
        self.eps, self.no_bias = np.float32(c.rms_norm_eps), placed.no_bias
        self.layer_weights = w = placed.layers
        self.embed_tokens = placed.embed_tokens
        self.layers: list[DecoderLayer] = [
            DecoderLayer(be, self.eps, w.input_norm[i],
                         Attention(be, c, i, qkv_w=w.qkv_w[i], qkv_bias=w.qkv_bias[i], o_w=w.o_w[i],
                                   no_bias=self.no_bias, rope=placed.rope),
                         w.post_attention_norm[i],
                         MLP(be, gate_up_w=w.gate_up_w[i], down_w=w.down_w[i], no_bias=self.no_bias))
            for i in range(c.num_hidden_layers)]
        self.norm = placed.norm
        self.lm_head_w = placed.lm_head
        q_dim = c.num_attention_heads * c.head_dim
        widths = {
            "hidden": c.hidden_size, "delta": c.hidden_size, "normed": c.hidden_size,
            "qkv": q_dim + 2 * c.num_key_value_heads * c.head_dim, "attn": q_dim,
            "gate_up": 2 * c.intermediate_size, "act": c.intermediate_size,
            "final": c.hidden_size, "logits": c.vocab_size,
        }
        self.workspace = Workspace(be, widths)
        self.logit_rows_workspace = Workspace(be, widths)  # the last layer's logit rows (``_logit_rows``)
        self._identity_rows = IdentityRows()
        # Small steps on the CPU run as one compiled function (the model's own backend only: a
        # profiler's timed one launches kernel by kernel), for float weights and interleaved quantized
        # ones (a matrix whose rows make no whole groups stays row-major: kernel by kernel then).
        self.cpu_step = CpuDecodeStep(self, be) if isinstance(be, CpuBackend) and CpuDecodeStep.takes(self) else None
        # Distinct objects that tell a greedy step's graph from a logits step's.
        self._greedy_marker, self._logits_marker = object(), object()

    def use_backend(self, backend: Backend) -> None:
        """Launch through ``backend`` from now on (the profiler's timed wrapper of this model's own
        backend, or the plain one again): the model and each of its layers hold it."""
        self.backend = backend
        for layer in self.layers:
            layer.backend = layer.attention.backend = layer.mlp.backend = backend

    @classmethod
    def from_checkpoint(cls, ckpt: "Checkpoint", backend: str = "auto", dtype: str = "float32") -> "LlamaModel":
        """Build from a loaded :class:`~engines.runtime.model.checkpoint.Checkpoint`."""
        return cls(ckpt.config, ckpt.weights, backend=backend, dtype=dtype)

    def new_kv_cache(self, num_pages: int, page_size: int = 16) -> PagedKVCache:
        """K/V storage for ``num_pages`` pages of ``page_size`` tokens, every layer, on this backend."""
        return PagedKVCache.allocate(self.backend, self.config, num_pages, page_size, self.dtype)

    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> np.ndarray:
        """Run one step; float32 host logits ``[num_seqs, vocab]`` (each sequence's last new
        token), or ``[num_tokens, vocab]`` with ``batch.all_logits``, or with ``batch.seq_all_logits``
        a row for every new token of the sequences it flags and for the last of the others."""
        act = self._run(batch, kv, greedy=False)
        return self.backend.to_host(act.logits)

    def forward_greedy(self, batch: ForwardBatch, kv: PagedKVCache) -> np.ndarray:
        """Run one step and take the argmax on the device: int32 ``[num_seqs]`` (or
        ``[num_tokens]`` with ``batch.all_logits``)."""
        act = self._run(batch, kv, greedy=True)
        return self.backend.to_host(act.next_ids)

    def _run(self, batch: ForwardBatch, kv: PagedKVCache, greedy: bool) -> Activations:
        be = self.backend
        self._check_kv(kv)
        if self.cpu_step is not None and be is self.cpu_step.backend:
            act = self.cpu_step.forward(batch, kv, greedy)  # checks and runs a small step in one call
            if act is not None:
                return act
        step = be.upload_step(step_inputs(batch, kv, self.config, self._identity_rows))
        act = self.workspace.activations(step.token_ids.shape[0], step.logit_rows.shape[0])
        # The same buffers (hence the same CUDA graph) serve every step of the same shape.
        buffers = (step, act, kv, self._greedy_marker if greedy else self._logits_marker)
        be.run_step(buffers, step.token_ids.shape[0], lambda: self._launch(step, act, kv, greedy))
        return act

    def _launch(self, step: StepInputs, act: Activations, kv: PagedKVCache, greedy: bool) -> None:
        """The forward pass proper: embedding, decoder layers, final norm, LM head.

        Where the backend allows it (``compacts_last_layer``) and some rows return no logits (a
        prefill chunk's but its last), the last layer runs past its keys and values for the logit
        rows alone, as llama.cpp does: its output projection, MLP and attention for the other rows
        feed nothing. Of a 512-token prefill of issue 15's 8-layer checkpoint that is 9% of the
        matmul flops (a 32-layer model's: 2.4%)."""
        be = self.backend
        be.embedding(step.token_ids, self.embed_tokens, act.hidden)
        residual = act.no_residual
        for layer in self.layers[:-1]:
            layer(act, residual, step, kv)
            residual = act.delta
        logit_rows = None
        if be.compacts_last_layer and step.logit_rows.shape[0] < step.token_ids.shape[0]:
            # Made (and uploaded) just before its use: the profiler counts attention's work by
            # the step uploaded last.
            logit_rows = self._logit_rows(step)
        self.layers[-1](act, residual, step, kv, logit_rows)
        if logit_rows is None:
            be.add_rmsnorm(act.hidden, act.delta, step.logit_rows, self.norm, self.eps, act.final)
        else:
            compact = logit_rows.act
            be.add_rmsnorm(compact.hidden, compact.delta, logit_rows.step.rows, self.norm, self.eps, act.final)
        be.matmul(act.final, self.lm_head_w, self.no_bias, act.logits)
        if greedy:
            be.argmax(act.logits, act.next_ids)

    def _logit_rows(self, step: StepInputs) -> LogitRows:
        """``step``'s logit rows as a step of their own, with activations of their own (a second
        workspace: gathered rows must not overwrite the rows they are gathered from). Its final
        norm and LM head write the step's own buffers, so it holds none of those (0 rows)."""
        r = step.logit_rows
        rows = self._identity_rows(r.shape[0])
        rows_step = self.backend.upload_step(StepInputs(token_ids=step.token_ids[r], positions=step.positions[r],
                                                        token_seq=step.token_seq[r], page_table=step.page_table,
                                                        rows=rows, logit_rows=rows))
        return LogitRows(rows_step, self.logit_rows_workspace.activations(r.shape[0], 0))

    def _check_kv(self, kv: PagedKVCache) -> None:
        """Refuse a KV cache this model did not make. This and the batch's checks (``step_inputs``,
        or inside the compiled CPU step) guard memory the kernels would otherwise read or write
        out of bounds."""
        c = self.config
        shape = (len(self.layers), kv.num_pages, c.num_key_value_heads, kv.page_size, c.head_dim)
        if (kv.backend_name != self.backend_name or kv.dtype != self.dtype or kv.num_layers != len(self.layers)
                or tuple(kv.k.shape) != shape or tuple(kv.v.shape) != shape):
            raise ValueError("this KV cache was not made by this model's new_kv_cache()")

