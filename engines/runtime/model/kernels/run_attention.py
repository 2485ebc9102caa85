"""Causal attention of a run of new tokens with BLAS: the CPU backend's fast path for prefill.

A prefill chunk is a *run*: consecutive rows of the step that are one sequence's consecutive
positions. For a run of ``n`` tokens after ``first`` cached ones, each query head's scores
against the ``first + n`` keys are a matrix product, and so is the weighted sum of values:
work BLAS does at tens of GFLOP/s where the scalar kernel (``attention.paged_attention_cpu``,
one (token, head) at a time) reaches a few. The queries go in tiles of ``TILE`` rows, each
against only the keys its last row may see, so the causal half above the diagonal is mostly
never computed; what the tile's diagonal block holds beyond a row's position is masked.

The softmax between the two products is one numba call a tile (:func:`causal_softmax_rows`:
each row's max, ``exp`` vectorised by ``fast_exp``, the sum, the row scaled by its inverse, the
masked tail zeroed), where NumPy took five passes over the tile
(docs/perf-log/cpu-anchors.md#2026-11-25-vectorised-exp). The rows leave it normalised, so the
second product writes the output's columns itself (``out=``): no weighted-sum buffer, division or
copy a tile (docs/perf-log/cpu-anchors.md#2026-11-26-xeon-amx-prefill). Each query head is one job
for a :class:`~engines.runtime.model.cpu_pool.CpuPool`: heads run side by side, one a core,
each with single-threaded BLAS and its own scores buffer.

The scalar kernel stays the plain reference: the tests diff the two on mixed steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from numba import float32, njit

from engines.runtime.model.cpu_pool import CpuPool, scratch
from engines.runtime.model.kernels.fast_exp import softmax_numerators
from engines.runtime.model.kernels.vector_width import prefer_wide_vectors

__all__ = ["MIN_RUN", "TILE", "AttentionSplit", "causal_softmax_rows", "run_attention", "split_step", "token_runs"]

#: Query rows per matrix product (the scores of a tile are ``TILE x keys`` floats).
TILE = 128
#: Runs shorter than this go to the scalar kernel: for a handful of queries it is as fast.
MIN_RUN = 48


@njit(nogil=True, cache=True, error_model="numpy", fastmath={"reassoc", "contract", "nsz", "arcp"})
def causal_softmax_rows(scores, first_row_keys):
    """The causal softmax of a tile of scores, in place: row ``i`` sees its first
    ``first_row_keys + i`` keys (capped at the tile's width), which become their softmax
    ``exp(s - row max) / sum``; the keys past them become 0. In 512-bit vectors where the CPU has
    them (``vector_width``: the exp's polynomial is bound by arithmetic;
    docs/perf-log/cpu-anchors.md#2026-11-26-xeon-amx-prefill)."""
    prefer_wide_vectors()
    rows, keys = scores.shape
    for i in range(rows):
        row = scores[i]
        seen = min(first_row_keys + i, keys)
        inverse = float32(1.0) / softmax_numerators(row, seen)
        for j in range(seen):
            row[j] *= inverse
        for j in range(seen, keys):
            row[j] = float32(0.0)


def token_runs(positions: np.ndarray, token_seq: np.ndarray) -> list[tuple[int, int]]:
    """The step's maximal row ranges ``[start, end)`` of one sequence at consecutive positions."""
    n = len(positions)
    if n == 0:
        return []
    breaks = np.flatnonzero((token_seq[1:] != token_seq[:-1]) | (positions[1:] != positions[:-1] + 1)) + 1
    edges = [0, *breaks.tolist(), n]
    return list(pairwise(edges))


@dataclass(frozen=True)
class AttentionSplit:
    """One step's rows for attention: ``runs`` (``[start, end)``, ``MIN_RUN`` tokens or more) go
    through :func:`run_attention`; ``other_rows`` through the scalar kernel (None: every row, no
    run is long enough)."""

    runs: tuple[tuple[int, int], ...]
    other_rows: np.ndarray | None


def split_step(positions: np.ndarray, token_seq: np.ndarray) -> AttentionSplit:
    """Which rows of a step attend through BLAS and which through the scalar kernel."""
    if len(positions) < MIN_RUN:  # a decode step: no run can be long enough
        return AttentionSplit((), None)
    runs = tuple(r for r in token_runs(positions, token_seq) if r[1] - r[0] >= MIN_RUN)
    if not runs:
        return AttentionSplit((), None)
    scalar = np.ones(len(positions), dtype=np.bool_)
    for start, end in runs:
        scalar[start:end] = False
    return AttentionSplit(runs, np.flatnonzero(scalar))


def run_attention(qkv: np.ndarray, start: int, end: int, first: int, seq: int, page_table: np.ndarray,
                  k_cache: np.ndarray, v_cache: np.ndarray, layer: int, num_q_heads: int, scale: np.float32,
                  out: np.ndarray, pool: CpuPool | None = None) -> None:
    """``out[start:end]`` for rows ``start..end-1`` of ``qkv``: sequence ``seq``'s tokens at
    positions ``first ..``, whose keys and values are in the cache already (as for the scalar
    kernel: ``rope_kv_append`` ran first). The query heads run side by side on ``pool``'s
    threads, or one after the other without one."""
    n = end - start
    num_keys = first + n
    _, _, num_kv_heads, page_size, head_dim = k_cache.shape
    group = num_q_heads // num_kv_heads
    pages = page_table[seq, :-(-num_keys // page_size)]

    def one_head(q_head: int) -> None:
        kv_head = q_head // group
        # The head's keys and values, contiguous: [keys, head_dim] (a copy: one gather of its pages).
        k = k_cache[layer, pages, kv_head].reshape(-1, head_dim)[:num_keys]
        v = v_cache[layer, pages, kv_head].reshape(-1, head_dim)[:num_keys]
        col = q_head * head_dim
        q = qkv[start:end, col:col + head_dim] * scale
        buffer = scratch(min(n, TILE) * num_keys)  # the scores of a tile
        for t0 in range(0, n, TILE):
            t1 = min(n, t0 + TILE)
            visible = first + t1  # keys the tile's last row may see
            scores = buffer[:(t1 - t0) * visible].reshape(t1 - t0, visible)
            np.matmul(q[t0:t1], k[:visible].T, out=scores)
            causal_softmax_rows(scores, first + t0 + 1)
            np.matmul(scores, v[:visible], out=out[start + t0:start + t1, col:col + head_dim])

    if pool is None:
        for q_head in range(num_q_heads):
            one_head(q_head)
    else:
        pool.run(one_head, range(num_q_heads))
