"""A CPU decode step as one compiled function: what the CUDA graph is to the GPU backend.

The per-kernel path (``LlamaModel._launch``) calls nine kernels a layer from Python, each through
numba's dispatcher, which unboxes and type-checks every array argument (many times slower once
the step's weights have streamed through the caches), ~75 calls a step, plus the backend's Python
around each. :func:`decode_step_cpu` makes the same calls from compiled code, where a call is a
native call, and Python pays one dispatch a step; that pays most where steps are shortest
(``bench/cpu_anchors.py --per-kernel``; docs/perf-log/cpu-anchors.md#2026-11-25-compiled-cpu-step).

The step takes the batch as the caller made it (:class:`~engines.runtime.model.forward_batch.ForwardBatch`'s
int32 arrays) and checks and derives its metadata itself (``step_inputs.derive_int32``), so that
Python pays one call a step: apart, the checks, the metadata's dataclass and attention's split
each cost another call into cold caches (docs/perf-log/cpu-anchors.md#2026-11-26-one-numba-call-a-step).
A batch it finds invalid runs nothing and goes to the per-kernel path, which raises the reference's
``ValueError``.

It runs the backend's own kernels, in the same order, on the same buffers, with the same
attention split, but for one fusion: in a step of one token the MLP's gate/up projection and its
SwiGLU are one kernel (``matmul.matmul_swiglu_cpu``), whose ``[gate | up]`` product is never
stored nor read back (docs/perf-log/cpu-anchors.md#2026-11-26-fused-swiglu). LLVM optimises the
kernels again inside the step and may sum a reassociated reduction in another order, so results
match the per-kernel path's to float32
rounding, not bit for bit (tests/runtime/model/test_cpu_step.py diffs the two). It covers the
steps whose every op is one of those numba kernels: at most ``matmul.CPU_ROWS_KERNEL_MAX_ROWS``
new tokens (so no BLAS matmul and no BLAS attention run). The profiler's timed backend replaces the model's own, and the
model then launches kernel by kernel, as the CUDA backend launches without its graph while
profiling.

A step of one token (batch-1 decode) runs as a thread team (:func:`one_token_team_step`, on
``thread_team``'s barriers): one parallel region a step where the kernels' own ``prange`` loops
fork and join numba's threads some 45 times, with the norms, RoPE and the split attention's merge
run by one thread in between. Each member takes its chunks of every matmul (its own run first, then
what is left of the others': ``thread_team.claim``), its attention items, and appends the new
token's k and v for the heads of its item that holds the token's position; the residual stream, the
norms, q's rotation and the merge of attention's key slices it computes itself, into buffers of its
own, so a layer has five barriers, one after each op whose output every member reads whole. The
work is the kernels' own bodies (``matmul.row_blocks``, the row loop of ``matmul_rows_cpu`` for a
last odd row; ``matmul.swiglu_block``, ``attention.attention_item`` and ``merge_key_slices``,
``rope_kv.rotate_q_head`` and ``append_kv_head``, which the kernels call too), so the results are
the per-kernel path's to float32 rounding, as the rest of the step's. After a team step the
activations hold the same ``hidden``, ``final``, ``logits`` and ``next_ids``; the others are the
team's scratch (``qkv`` keeps q unrotated, the members rotate their own copies). Against the same
compiled step forking per kernel, step by step in turn (bench/cpu_team_step.py):
docs/perf-log/cpu-anchors.md#2026-11-26-thread-team.
If the team cannot meet (its members put on one thread), it is called off before any work, the step
runs the forking way, and the next 64 steps too (twice as many after each call-off in a row, up to
65,536) before a team is tried again.

The weights may be float arrays or quantized ones in the interleaved layout (each op's kernel
picked by the weight's storage when numba compiles the step: ``kernels.step_weights``, and
:func:`team_matmul` here); a quantized model's step is the same source compiled for its types.

The step holds most kernels compiled into itself; its cache entry, as every compiled runtime
function's, is stamped with all the runtime's compiled sources (``engines.runtime.numba_cache``),
so that an edit to any kernel compiles it anew.
"""
from __future__ import annotations

import threading
from typing import Protocol, Sequence

import numpy as np
from numba import float32, njit, prange, types
from numba.extending import overload

from engines.runtime.model import step_inputs, thread_team
from engines.runtime.model.backend import Activations, Array, CpuBackend, CpuWeight, Workspace
from engines.runtime.model.config import ModelConfig
from engines.runtime.model.forward_batch import ForwardBatch
from engines.runtime.model.quant.interleaved_weight import GROUP, InterleavedWeight
from engines.runtime.model.kernels import (add_rmsnorm, argmax, attention, interleaved_dot,
                                           matmul, rope_kv, silu_mul, step_weights)
from engines.runtime.model.kernels.fast_exp import exp_f32
from engines.runtime.model.kv_storage import PagedKVCache
from engines.runtime.model.layer_weights import LayerWeights
from engines.runtime.model.quant.quantized_weight import BLOCK

__all__ = ["CpuDecodeStep", "decode_step_cpu", "one_token_team_step", "team_matmul"]

# Reassociation for the inlined kernel bodies, as their own modules compile them (matmul, attention).
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# Weight bytes a chunk of a team's matmul holds (thread_team.claim): a few microseconds of streaming
# for one member, so that the member who finishes last waits little, in long enough runs to stream
# (smaller chunks were no faster: docs/perf-log/cpu-anchors.md#2026-11-26-zen4-night-batch1-share).
TEAM_CHUNK_BYTES = 128 << 10


@njit(inline="always")
def _chunks_per_run(blocks, block_bytes, team):
    """Chunks a member's run of an op of ``blocks`` blocks of ``block_bytes`` bytes is cut into."""
    return max(1, min(blocks, blocks * block_bytes // TEAM_CHUNK_BYTES) // team)


@njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _team_matmul(x, w, bias, out, member, team, state, drawn, swiglu):
    """A member's part of ``out = x @ w.T + bias`` for one row (2-D, one row each), or with
    ``swiglu`` of ``matmul_swiglu_cpu`` (``w`` ``[gate | up]``, no bias): the chunks of the kernel's
    blocks it claims (``thread_team.claim``), and for the last member of a plain product the columns
    past them. The tickets drawn a run once the op is done."""
    blocks = w.shape[0] // 4
    per_run = _chunks_per_run(blocks, 4 * w.shape[1] * w.itemsize, team)
    chunks = per_run * team
    chunk, step = thread_team.claim(state, member, team, 0, drawn, per_run)
    while chunk >= 0:
        first, end = chunk * blocks // chunks, (chunk + 1) * blocks // chunks
        if swiglu:
            for block in range(first, end):
                matmul.swiglu_block(x[0], w, out[0], block, blocks)
        else:
            matmul.row_blocks(x[0], w, bias, out[0], first, end)
        chunk, step = thread_team.claim(state, member, team, step, drawn, per_run)
    if not swiglu and member == team - 1:
        matmul.row_last_columns(x, w, bias, out)
    return drawn + per_run + team


# Integer dots; the SwiGLU's floats as silu_mul_cpu's.
@njit(nogil=True, cache=True, error_model="numpy", fastmath=False)
def _team_interleaved_matmul(x, quants, scales, minima, table, bias, out, member, team, state, drawn, swiglu,
                             xq, xd, xs, gate_up):
    """:func:`_team_matmul` for an interleaved quantized weight (``step_weights.step_form``): the
    member quantizes the row itself into its own ``xq, xd, xs`` (1-D, long enough), then takes the
    chunks of the weight's groups it claims. With ``swiglu`` a chunk is of the gates' groups, each
    with its ups' (``[gate | up]``: group ``g``'s ups are group ``g + groups / 2``), both into the
    member's own ``gate_up`` row, and their SwiGLU into ``out`` as ``silu_mul_cpu`` computes it."""
    inner = x.shape[1]
    blocks = inner // BLOCK
    q = xq[:inner].reshape((1, inner))
    d = xd[:blocks].reshape((1, blocks))
    s = xs[:blocks].reshape((1, blocks))
    interleaved_dot.quantize_input(x, quants, scales, minima, q, d, s)
    groups = quants.shape[0] // 2 if swiglu else quants.shape[0]
    per_run = _chunks_per_run(groups, quants.shape[1] * (2 if swiglu else 1), team)
    chunks = per_run * team
    chunk, step = thread_team.claim(state, member, team, 0, drawn, per_run)
    while chunk >= 0:
        first, end = chunk * groups // chunks, (chunk + 1) * groups // chunks
        if swiglu:
            interleaved_dot.group_rows(quants, scales, minima, table, q, d, s, gate_up, first, end, 0, 1)
            interleaved_dot.group_rows(quants, scales, minima, table, q, d, s, gate_up, first + groups, end + groups,
                                       0, 1)
            width = GROUP * groups
            for n in range(GROUP * first, GROUP * end):
                g = gate_up[0, n]
                out[0, n] = g / (float32(1.0) + exp_f32(-g)) * gate_up[0, width + n]
        else:
            interleaved_dot.group_rows(quants, scales, minima, table, q, d, s, out, first, end, 0, 1)
            matmul.add_bias(out, bias, GROUP * first, GROUP * end)
        chunk, step = thread_team.claim(state, member, team, step, drawn, per_run)
    return drawn + per_run + team


def team_matmul(x, w, bias, out, member, team, state, drawn, swiglu, scratch):  # noqa: ANN001, ANN201
    """A member's part of one matmul in a team step, for either storage of ``w``
    (``step_weights``); ``scratch`` the member's own ``(xq, xd, xs, gate_up)``, which a quantized
    weight's part uses. The tickets drawn a run once the op is done."""


@overload(team_matmul, jit_options={"nogil": True})
def _team_matmul_overload(x, w, bias, out, member, team, state, drawn, swiglu, scratch):  # noqa: ANN001, ANN202
    if isinstance(w, types.BaseTuple):
        def interleaved(x, w, bias, out, member, team, state, drawn, swiglu, scratch):  # noqa: ANN001, ANN202
            quants, scales, minima, table = w
            xq, xd, xs, gate_up = scratch
            return _team_interleaved_matmul(x, quants, scales, minima, table, bias, out, member, team, state, drawn,
                                            swiglu, xq, xd, xs, gate_up)
        return interleaved

    def plain(x, w, bias, out, member, team, state, drawn, swiglu, scratch):  # noqa: ANN001, ANN202
        return _team_matmul(x, w, bias, out, member, team, state, drawn, swiglu)
    return plain


@njit(nogil=True, cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def one_token_team_step(state, team, token_ids, positions, token_seq, page_table, rows,  # the step
                        embed, input_norm, qkv_w, qkv_bias, o_w, post_norm, gate_up_w, down_w,  # weights
                        final_norm, lm_head_w, no_bias, no_residual, cos, sin, eps, num_q_heads, scale,
                        k_cache, v_cache, head_splits, key_splits, greedy,
                        hidden, qkv, attn, delta, act, final, logits, next_ids):
    """A step of one token run by a team of ``team`` threads in one parallel region (see the
    module's docstring and ``thread_team``). True once run; False, and nothing run, if the team
    could not meet. ``state`` counts the steps run and called off."""
    if team < 1 or team > thread_team.max_parties(state):  # no counters for it
        return False
    width = hidden.shape[1]
    head_dim = k_cache.shape[4]
    own_hidden = np.empty((team, 1, width), np.float32)
    own_normed = np.empty((team, 1, width), np.float32)
    q_width = attn.shape[1]
    own_q = np.empty((team, 1, q_width), np.float32)
    own_attn = np.empty((team, 1, q_width), np.float32)
    # A quantized weight's member quantizes its matmul's input itself (no barrier for it), and
    # takes the MLP's gate/up products into a row of its own before their SwiGLU.
    widest = max(width, q_width, act.shape[1])
    own_xq = np.empty((team, widest), np.int8)
    own_xd = np.empty((team, widest // BLOCK), np.float32)
    own_xs = np.empty((team, widest // BLOCK), np.float32)
    own_gate_up = np.empty((team, 1, 2 * act.shape[1]), np.float32)
    num_kv_heads = k_cache.shape[2]
    page_size = k_cache.shape[3]
    parts = key_splits if key_splits > 1 else 0
    part_max = np.empty((parts, num_q_heads), np.float32)
    part_sum = np.empty((parts, num_q_heads), np.float32)
    part_out = np.empty((parts, num_q_heads, head_dim), np.float32)
    position = positions[0]
    c = cos[position]
    s = sin[position]
    page = page_table[token_seq[0], position // page_size]
    slot = position % page_size
    items = head_splits * key_splits
    kv_per_item = num_kv_heads // head_splits
    thread_team.reset(state, team)
    for index in prange(team):
        member = np.int64(index)  # prange's index is unsigned in the parallel body, signed elsewhere
        if thread_team.rendezvous(state, team):
            h = own_hidden[member]
            n = own_normed[member]
            q = own_q[member]
            merged = own_attn[member]
            scratch = (own_xq[member], own_xd[member], own_xs[member], own_gate_up[member])
            passed = 0  # barriers passed
            drawn = np.int64(0)  # tickets drawn (thread_team.claim); not a literal: one compiled _team_matmul
            step_weights.gather(token_ids, embed, h)
            for layer in range(len(qkv_w)):
                add_rmsnorm.add_rmsnorm_cpu(h, no_residual if layer == 0 else delta, rows, input_norm[layer], eps,
                                            n)
                drawn = team_matmul(n, qkv_w[layer], qkv_bias[layer], qkv, member, team, state, drawn, False,
                                    scratch)
                passed += 1
                thread_team.barrier(state, team, passed)
                # q rotated into the member's own row, every head (no barrier for RoPE); the
                # new token's k and v appended by the member whose item holds its position.
                for i in range(q_width):
                    q[0, i] = qkv[0, i]
                for head in range(num_q_heads):
                    rope_kv.rotate_q_head(q[0], head, head_dim, c, s)
                for item in range(member, items, team):
                    if item % key_splits == key_splits - 1:
                        first_kv_head = item // key_splits * kv_per_item
                        for kv_head in range(first_kv_head, first_kv_head + kv_per_item):
                            rope_kv.append_kv_head(qkv[0], kv_head, num_q_heads, num_kv_heads, c, s,
                                                   k_cache[layer, page, kv_head, slot],
                                                   v_cache[layer, page, kv_head, slot])
                    attention.attention_item(item, head_splits, key_splits, q, positions, token_seq, page_table,
                                             k_cache, v_cache, layer, num_q_heads, scale, attn, part_max, part_sum,
                                             part_out)
                passed += 1
                thread_team.barrier(state, team, passed)
                if key_splits > 1:  # every member merges every head, into its own row
                    for head in range(num_q_heads):
                        attention.merge_key_slices(0, head, key_splits, part_max, part_sum, part_out, merged)
                drawn = team_matmul(merged if key_splits > 1 else attn, o_w[layer], no_bias, delta, member, team,
                                    state, drawn, False, scratch)
                passed += 1
                thread_team.barrier(state, team, passed)
                add_rmsnorm.add_rmsnorm_cpu(h, delta, rows, post_norm[layer], eps, n)
                drawn = team_matmul(n, gate_up_w[layer], no_bias, act, member, team, state, drawn, True, scratch)
                passed += 1
                thread_team.barrier(state, team, passed)
                drawn = team_matmul(act, down_w[layer], no_bias, delta, member, team, state, drawn, False,
                                    scratch)
                passed += 1
                thread_team.barrier(state, team, passed)
            add_rmsnorm.add_rmsnorm_cpu(h, delta, rows, final_norm, eps, n)
            drawn = team_matmul(n, lm_head_w, no_bias, logits, member, team, state, drawn, False, scratch)
            passed += 1
            thread_team.barrier(state, team, passed)
            if member == 0:
                for i in range(width):
                    hidden[0, i] = h[0, i]
                    final[0, i] = n[0, i]
                if greedy:
                    argmax.argmax_cpu(logits, next_ids)
    ran = state[thread_team.ARRIVED] >= team
    state[thread_team.TEAM_STEPS if ran else thread_team.CALLED_OFF] += 1
    return ran


@njit(nogil=True, cache=True, fastmath=False)
def decode_step_cpu(token_ids, query_starts, cached_lens, page_table, all_logits,  # the batch
                    vocab_size, max_positions,
                    embed, input_norm, qkv_w, qkv_bias, o_w, post_norm, gate_up_w, down_w,  # weights
                    final_norm, lm_head_w, no_bias, cos, sin, eps, num_q_heads, scale,
                    k_cache, v_cache, parallel_attention_min_work, threads, greedy,  # KV, attention's split
                    hidden, no_residual, normed, qkv, attn, delta, gate_up, act, final, logits, next_ids,
                    team_state):
    """``LlamaModel._launch`` for one step of a checked batch (False, and nothing run, for an
    invalid one), kernel for kernel but, for one token, the MLP's gate/up projection and
    SwiGLU as one kernel (``matmul_swiglu_cpu``); attention split over numba's threads as
    ``CpuBackend.attention_splits`` splits it ((0, 0): single-threaded). A step of one token
    with whole (gate, up) pairs in the fused kernel's blocks runs as :func:`one_token_team_step`
    unless ``team_state`` says not to (``thread_team.may_try``: switched off, or waiting after a
    call-off)."""
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
    # One token, and whole (gate, up) pairs in each block of the fused kernel: see matmul_swiglu_cpu
    # and step_weights.fuses_swiglu (a team has conditions of its own for quantized weights).
    one_token = token_ids.shape[0] == 1
    swiglu_fused = one_token and step_weights.fuses_swiglu(gate_up_w, False)
    if one_token and step_weights.fuses_swiglu(gate_up_w, True) and thread_team.may_try(team_state):
        team = max(1, min(threads, thread_team.max_parties(team_state)))
        team_heads, team_keys = head_splits, key_splits
        if head_splits == 0:  # the team is awake anyway: its members take slices of the heads
            team_heads, team_keys = attention.head_splits(token_ids.shape[0], k_cache.shape[2], team), 1
        ran = one_token_team_step(team_state, team, token_ids, positions, token_seq, page_table, rows,
                                  embed, input_norm, qkv_w, qkv_bias, o_w, post_norm, gate_up_w, down_w,
                                  final_norm, lm_head_w, no_bias, no_residual, cos, sin, eps, num_q_heads,
                                  scale, k_cache, v_cache, team_heads, team_keys, greedy,
                                  hidden, qkv, attn, delta, act, final, logits, next_ids)
        thread_team.back_off(team_state, not ran)
        if ran:
            return True
    step_weights.gather(token_ids, embed, hidden)
    for layer in range(len(qkv_w)):
        residual = no_residual if layer == 0 else delta
        add_rmsnorm.add_rmsnorm_cpu(hidden, residual, rows, input_norm[layer], eps, normed)
        step_weights.rows_matmul(normed, qkv_w[layer], qkv_bias[layer], qkv, threads)
        rope_kv.rope_kv_append_cpu(qkv, positions, token_seq, page_table, cos, sin, k_cache, v_cache, layer,
                                   num_q_heads)
        if head_splits > 0:
            attention.paged_attention_cpu(qkv, positions, token_seq, page_table, k_cache, v_cache, layer,
                                          num_q_heads, scale, attn, head_splits, key_splits)
        else:
            # Splits of one, as ints rather than literals: the same compiled kernel the backend calls.
            attention.paged_attention_serial_cpu(qkv, positions, token_seq, page_table, k_cache, v_cache, layer,
                                                 num_q_heads, scale, attn, max(head_splits, 1),
                                                 max(key_splits, 1))
        step_weights.rows_matmul(attn, o_w[layer], no_bias, delta, threads)
        add_rmsnorm.add_rmsnorm_cpu(hidden, delta, rows, post_norm[layer], eps, normed)
        if swiglu_fused:
            step_weights.swiglu_matmul(normed, gate_up_w[layer], act, gate_up, no_bias, threads)
        else:
            step_weights.rows_matmul(normed, gate_up_w[layer], no_bias, gate_up, threads)
            silu_mul.silu_mul_cpu(gate_up, act)
        step_weights.rows_matmul(act, down_w[layer], no_bias, delta, threads)
    add_rmsnorm.add_rmsnorm_cpu(hidden, delta, logit_rows, final_norm, eps, final)
    step_weights.rows_matmul(final, lm_head_w, no_bias, logits, threads)
    if greedy:
        argmax.argmax_cpu(logits, next_ids)
    return True


class SteppedAttention(Protocol):
    """What the step reads of the first layer's attention: its constants, the same in every layer."""

    @property
    def num_q_heads(self) -> int: ...
    @property
    def scale(self) -> np.float32: ...
    @property
    def cos(self) -> Array: ...
    @property
    def sin(self) -> Array: ...


class SteppedLayer(Protocol):
    @property
    def attention(self) -> SteppedAttention: ...


class SteppedModel(Protocol):
    """What :class:`CpuDecodeStep` reads of its model (``llama.LlamaModel`` is one): the step is
    handed the weights and buffers, not the model's methods, so this module needs nothing above it."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def workspace(self) -> Workspace: ...
    @property
    def layers(self) -> Sequence[SteppedLayer]: ...
    @property
    def layer_weights(self) -> LayerWeights: ...
    @property
    def embed_tokens(self) -> Array: ...
    @property
    def norm(self) -> Array: ...
    @property
    def lm_head_w(self) -> Array: ...
    @property
    def no_bias(self) -> Array: ...
    @property
    def eps(self) -> np.float32: ...


class CpuDecodeStep:
    """A model's small steps on the CPU backend as one call of :func:`decode_step_cpu`: float
    weights, or quantized ones in the interleaved layout (every weight of the model's either)."""

    @staticmethod
    def takes(model: SteppedModel) -> bool:
        """Whether the step can run ``model``: its weights each a float array or interleaved."""
        w = model.layer_weights
        weights: list[CpuWeight] = [model.embed_tokens, model.lm_head_w]
        for layers in (w.qkv_w, w.o_w, w.gate_up_w, w.down_w):
            weights.extend(layers)  # a float [layers, ...] array's layers are arrays too
        return all(isinstance(weight, (np.ndarray, InterleavedWeight)) for weight in weights)

    def __init__(self, model: SteppedModel, backend: CpuBackend) -> None:
        self.backend = backend
        self.model = model
        first = model.layers[0].attention
        self.num_q_heads, self.scale = first.num_q_heads, first.scale
        self.cos, self.sin = first.cos, first.sin
        w, c = model.layer_weights, model.config
        layers, form = step_weights.step_layers, step_weights.step_form
        #: The weights as the step takes them (``step_weights``), from the embedding to the LM head.
        self.weights = (form(model.embed_tokens), w.input_norm, layers(w.qkv_w), w.qkv_bias, layers(w.o_w),
                        w.post_attention_norm, layers(w.gate_up_w), layers(w.down_w), model.norm,
                        form(model.lm_head_w))
        # The step's arguments that never change, gathered once.
        self._model_args = (c.vocab_size, c.max_position_embeddings, *self.weights, model.no_bias, self.cos,
                            self.sin, model.eps, self.num_q_heads, self.scale)
        self.team_state = thread_team.new_state(backend.numba_threads)
        # One step at a time: two teams counting in one state would wait for each other forever
        # (and two steps would overwrite each other's buffers anyway).
        self._one_at_a_time = threading.Lock()

    @property
    def team(self) -> bool:
        """Whether the next step of one token tries a thread team (:func:`one_token_team_step`):
        True unless switched off here, or in the wait after a team was called off (the steps
        then fork per kernel; see ``thread_team``)."""
        return not (self.team_state[thread_team.SWITCHED_OFF] or self.team_state[thread_team.SKIPS_LEFT])

    @team.setter
    def team(self, on: bool) -> None:
        self.team_state[thread_team.SWITCHED_OFF] = 0 if on else 1

    @property
    def team_steps(self) -> tuple[int, int]:
        """``(run, called off)``: this model's steps run as a team, and teams called off."""
        return int(self.team_state[thread_team.TEAM_STEPS]), int(self.team_state[thread_team.CALLED_OFF])

    def forward(self, batch: ForwardBatch, kv: PagedKVCache, greedy: bool) -> Activations | None:
        """Run ``batch`` if it is a step this covers (int32 arrays, at most
        ``matmul.CPU_ROWS_KERNEL_MAX_ROWS`` new tokens: no BLAS matmul, no BLAS attention run) and
        valid; its results (``logits``, ``next_ids``, ``hidden``, ``final``) are in the activations
        returned, as the per-kernel path's would be. None, and nothing run, otherwise (the per-kernel
        path then runs it, or raises). A batch whose ``seq_all_logits`` flags some sequences goes
        kernel by kernel too: the compiled step returns every row's logits or each sequence's last."""
        if not step_inputs.int32_batch(batch):
            return None
        if batch.seq_all_logits is not None and not batch.all_logits and np.any(batch.seq_all_logits):
            return None
        num_tokens = batch.token_ids.shape[0]
        num_rows = num_tokens if batch.all_logits else batch.query_starts.shape[0] - 1
        # A valid batch has 1 <= rows <= tokens: checked before its buffers are sized by it.
        if not 0 < num_rows <= num_tokens <= matmul.CPU_ROWS_KERNEL_MAX_ROWS:
            return None
        act = self.model.workspace.activations(num_tokens, num_rows)
        return act if self.run(batch, act, kv, greedy) else None

    def run_team_step_alone(self, kv: PagedKVCache) -> bool:
        """One team step of one token (scratch K/V at page 0's first slot), called from Python with
        the arguments :func:`decode_step_cpu` gives it: its compiled form is then the one the step
        calls. A cold start compiles it so in one process while another compiles the step's other
        callees (``frontend.precompile``); the team step is half of the step's compilation."""
        batch = ForwardBatch(np.zeros(1, np.int32), np.array([0, 1], np.int32), np.zeros(1, np.int32),
                             np.zeros((1, 1), np.int32))
        be, c = self.backend, self.model.config
        ok, positions, token_seq, page_table, logit_rows = step_inputs.derive_int32(
            batch.token_ids, batch.query_starts, batch.cached_lens, batch.page_table, c.vocab_size,
            c.max_position_embeddings, kv.page_size, kv.num_pages)
        act = self.model.workspace.activations(1, 1)
        team = max(1, min(be.numba_threads, thread_team.max_parties(self.team_state)))
        m = self.model
        with self._one_at_a_time:
            return one_token_team_step(
                self.team_state, team, batch.token_ids, positions, token_seq, page_table,
                np.arange(1, dtype=np.int32), *self.weights, m.no_bias, act.no_residual,
                self.cos, self.sin, m.eps, self.num_q_heads, self.scale, kv.k, kv.v,
                attention.head_splits(1, c.num_key_value_heads, team), 1, True, act.hidden, act.qkv, act.attn,
                act.delta, act.act, act.final, act.logits, act.next_ids)

    def run(self, batch: ForwardBatch, act: Activations, kv: PagedKVCache, greedy: bool) -> bool:
        """One call of :func:`decode_step_cpu` on buffers sized for ``batch`` (see :meth:`forward`);
        False, and nothing run, for an invalid batch or buffers of another size."""
        be = self.backend
        with self._one_at_a_time:
            return decode_step_cpu(batch.token_ids, batch.query_starts, batch.cached_lens, batch.page_table,
                                   batch.all_logits, *self._model_args, kv.k, kv.v, be.parallel_attention_min_work,
                                   be.numba_threads, greedy, act.hidden, act.no_residual, act.normed, act.qkv,
                                   act.attn, act.delta, act.gate_up, act.act, act.final, act.logits, act.next_ids,
                                   self.team_state)
