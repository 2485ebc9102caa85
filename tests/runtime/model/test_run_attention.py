"""The CPU backend's BLAS attention for prefill runs against the scalar kernel (its plain
reference) and a float64 dense softmax, on a step that mixes long runs, short ones and decodes."""
from __future__ import annotations

import numpy as np

from engines.runtime.model.backend import CpuBackend, StepInputs
from engines.runtime.model.kernels import attention, run_attention
from tests.runtime.model.test_kernels import HEAD_DIM, KV_HEADS, PAGE_SIZE, Q_HEADS, dense_attention


def mixed_step(rng: np.random.Generator) -> tuple[StepInputs, int]:
    """(sequence, cached tokens, new tokens): a long run after cached ones (two tiles), a decode,
    a run from position 0, a run shorter than MIN_RUN, another decode."""
    plan = [(0, 70, 300), (1, 500, 1), (2, 0, 60), (3, 33, 20), (4, 7, 1)]
    pages_per_seq = -(-501 // PAGE_SIZE)  # the longest sequence holds 501 tokens
    perm = rng.permutation(len(plan) * pages_per_seq).astype(np.int32)
    page_table = perm.reshape(len(plan), pages_per_seq)
    positions = np.concatenate([np.arange(c, c + n) for _, c, n in plan]).astype(np.int32)
    token_seq = np.concatenate([np.full(n, s) for s, _, n in plan]).astype(np.int32)
    rows = np.arange(len(positions), dtype=np.int32)
    step = StepInputs(token_ids=rows, positions=positions, token_seq=token_seq, page_table=page_table, rows=rows,
                      logit_rows=rows)
    return step, len(plan) * pages_per_seq


def test_runs_split_where_the_sequence_or_the_positions_break():
    positions = np.array([5, 6, 7, 0, 1, 9, 10, 3], dtype=np.int32)
    token_seq = np.array([0, 0, 0, 1, 1, 1, 1, 0], dtype=np.int32)
    assert run_attention.token_runs(positions, token_seq) == [(0, 3), (3, 5), (5, 7), (7, 8)]
    assert run_attention.token_runs(positions[:0], token_seq[:0]) == []
    decode = run_attention.split_step(np.arange(100, dtype=np.int32), np.arange(100, dtype=np.int32))
    assert decode.runs == () and decode.other_rows is None  # 100 one-token rows: all scalar


def test_blas_runs_match_the_scalar_kernel_and_a_dense_softmax():
    rng = np.random.default_rng(7)
    step, num_pages = mixed_step(rng)
    shape = (2, num_pages, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    qkv = rng.standard_normal((len(step.positions), (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    scale = np.float32(HEAD_DIM ** -0.5)
    cpu = CpuBackend()
    step = cpu.upload_step(step)
    # The fast path takes the two long runs, the scalar kernel the rest.
    assert step.attention_split.runs == ((0, 300), (301, 361))
    assert step.attention_split.other_rows.tolist() == [300, *range(361, 382)]

    got = np.full((len(step.positions), Q_HEADS * HEAD_DIM), np.nan, np.float32)
    cpu.attention(qkv, step, k, v, 1, Q_HEADS, scale, got)
    want = np.empty_like(got)
    attention.paged_attention_cpu(qkv, step.positions, step.token_seq, step.page_table, k, v, 1, Q_HEADS, scale, want,
                                  1, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(got, dense_attention(qkv, step, k, v, 1), rtol=1e-4, atol=1e-5)
