"""Causal attention of a run of new tokens with BLAS: the CPU backend's fast path for prefill.

A prefill chunk is a *run*: consecutive rows of the step that are one sequence's consecutive
positions. For a run of ``n`` tokens after ``first`` cached ones, each query head's scores
against the ``first + n`` keys are a matrix product, and so is the weighted sum of values:
work BLAS does at tens of GFLOP/s where the scalar kernel (``attention.paged_attention_cpu``,
one (token, head) at a time) reaches a few. The queries go in tiles of ``TILE`` rows, each
against only the keys its last row may see, so the causal half above the diagonal is mostly
never computed; what the tile's diagonal block holds beyond a row's position is masked.

The scalar kernel stays the plain reference: the tests diff the two on mixed steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MIN_RUN", "TILE", "AttentionSplit", "run_attention", "split_step", "token_runs"]

#: Query rows per matrix product (the scores of a tile are ``TILE x keys`` floats).
TILE = 256
#: Runs shorter than this go to the scalar kernel: for a handful of queries it is as fast.
MIN_RUN = 48

_ABOVE_DIAGONAL = np.triu(np.ones((TILE, TILE), dtype=np.bool_), 1)


def token_runs(positions: np.ndarray, token_seq: np.ndarray) -> list[tuple[int, int]]:
    """The step's maximal row ranges ``[start, end)`` of one sequence at consecutive positions."""
    n = len(positions)
    if n == 0:
        return []
    breaks = np.flatnonzero((token_seq[1:] != token_seq[:-1]) | (positions[1:] != positions[:-1] + 1)) + 1
    edges = [0, *breaks.tolist(), n]
    return list(zip(edges[:-1], edges[1:]))


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
                  out: np.ndarray) -> None:
    """``out[start:end]`` for rows ``start..end-1`` of ``qkv``: sequence ``seq``'s tokens at
    positions ``first ..``, whose keys and values are in the cache already (as for the scalar
    kernel: ``rope_kv_append`` ran first)."""
    n = end - start
    num_keys = first + n
    _, _, num_kv_heads, page_size, head_dim = k_cache.shape
    group = num_q_heads // num_kv_heads
    pages = page_table[seq, :-(-num_keys // page_size)]
    # The sequence's keys and values, contiguous per head: [kv_heads, keys, head_dim].
    keys = k_cache[layer, pages].transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :num_keys]
    values = v_cache[layer, pages].transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :num_keys]
    for kv_head in range(num_kv_heads):
        k, v = keys[kv_head], values[kv_head]
        for g in range(group):
            col = (kv_head * group + g) * head_dim
            q = qkv[start:end, col:col + head_dim] * scale
            for t0 in range(0, n, TILE):
                t1 = min(n, t0 + TILE)
                visible = first + t1  # keys the tile's last row may see
                scores = q[t0:t1] @ k[:visible].T
                scores[:, first + t0:visible][_ABOVE_DIAGONAL[:t1 - t0, :t1 - t0]] = -np.inf
                scores -= scores.max(axis=1, keepdims=True)
                np.exp(scores, out=scores)
                weighted = scores @ v[:visible]
                weighted /= scores.sum(axis=1, keepdims=True)
                out[start + t0:start + t1, col:col + head_dim] = weighted
