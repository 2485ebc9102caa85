"""A forward step's metadata from its ragged batch: every bound checked, then the per-token
arrays the kernels read (positions, owning sequence, a page table of power-of-two width).

Two forms compute the same :class:`~engines.runtime.model.backend.StepInputs`:

* :func:`step_inputs_reference`, plain NumPy over any integer arrays, which raises the
  ``ValueError`` that names what is wrong;
* :func:`step_inputs`, the form the model's per-kernel path calls: for int32 arrays (what the
  engine and the benches pass) one compiled pass, :func:`derive_int32`, checks and derives
  everything (the compiled CPU step calls that pass itself, from inside). The NumPy form is some 25
  array operations, each many times slower right after a decode step has streamed the weights
  through every cache, where a batch-1 step pays for them all
  (docs/perf-log/cpu-anchors.md#2026-11-25-python-around-a-step). A batch it finds invalid, or one
  of other dtypes, goes to the reference, which raises (or derives).

tests/runtime/model/test_step_inputs.py diffs the two on valid batches and checks that both
refuse the same invalid ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from engines.runtime.model.backend import StepInputs

if TYPE_CHECKING:
    from engines.runtime.model.config import ModelConfig
    from engines.runtime.model.forward_batch import ForwardBatch
    from engines.runtime.model.kv_storage import PagedKVCache

__all__ = ["IdentityRows", "derive_int32", "int32_batch", "logit_rows_of", "step_inputs", "step_inputs_reference"]


class IdentityRows:
    """``0 .. n-1`` as int32 views of one array that grows (doubling) as steps do: the ``rows``
    of every step without an allocation a step."""

    def __init__(self) -> None:
        self._rows = np.arange(0, dtype=np.int32)

    def __call__(self, n: int) -> np.ndarray:
        if self._rows.shape[0] < n:
            self._rows = np.arange(max(n, 2 * self._rows.shape[0]), dtype=np.int32)
        return self._rows[:n]


def step_inputs_reference(batch: "ForwardBatch", kv: "PagedKVCache", config: "ModelConfig",
                          identity_rows: IdentityRows) -> StepInputs:
    """Check the batch and derive the per-token metadata the kernels read (host arrays).

    Every check guards memory the kernels would otherwise read or write out of bounds.
    """
    token_ids = np.ascontiguousarray(batch.token_ids, dtype=np.int32)
    starts = np.asarray(batch.query_starts, dtype=np.int64)
    cached = np.asarray(batch.cached_lens, dtype=np.int64)
    table = np.ascontiguousarray(batch.page_table, dtype=np.int32)
    num_tokens, num_seqs = token_ids.shape[0], starts.shape[0] - 1
    lens = np.diff(starts)
    if num_seqs < 1 or starts[0] != 0 or starts[-1] != num_tokens or (lens < 1).any():
        raise ValueError("query_starts must rise from 0 to len(token_ids), every sequence with >= 1 new token")
    if cached.shape != (num_seqs,) or (cached < 0).any():
        raise ValueError(f"cached_lens must hold {num_seqs} non-negative counts")
    if table.ndim != 2 or table.shape[0] != num_seqs:
        raise ValueError(f"page_table must be [num_seqs={num_seqs}, max_pages]")
    if token_ids.min() < 0 or token_ids.max() >= config.vocab_size:
        raise ValueError(f"token ids must lie in [0, {config.vocab_size})")
    last_pos = cached + lens - 1
    if last_pos.max() >= config.max_position_embeddings:
        raise ValueError(f"position {last_pos.max()} is past max_position_embeddings "
                         f"({config.max_position_embeddings})")
    pages_used = last_pos // kv.page_size + 1
    if pages_used.max() > table.shape[1]:
        raise ValueError("page_table has fewer pages than the sequences' tokens need")
    used = table[np.arange(table.shape[1])[None, :] < pages_used[:, None]]
    if used.min() < 0 or used.max() >= kv.num_pages:
        raise ValueError(f"page_table holds page ids outside [0, {kv.num_pages}) where tokens live")

    # Page tables are passed at a power-of-two width: a growing sequence then changes
    # the step's layout (and CUDA graph) only log2(pages) times. Entries past a
    # sequence's last page are never read.
    width = 1 << int(pages_used.max() - 1).bit_length()
    if width != table.shape[1]:
        padded = np.full((num_seqs, width), -1, np.int32)
        keep = min(width, table.shape[1])
        padded[:, :keep] = table[:, :keep]
        table = padded

    token_seq = np.repeat(np.arange(num_seqs, dtype=np.int32), lens)
    positions = (cached[token_seq] + np.arange(num_tokens) - starts[token_seq]).astype(np.int32)
    rows = identity_rows(num_tokens)
    logit_rows = logit_rows_of(batch, rows, (starts[1:] - 1).astype(np.int32))
    return StepInputs(token_ids=token_ids, positions=positions, token_seq=token_seq, page_table=table,
                      rows=rows, logit_rows=logit_rows)


def logit_rows_of(batch: "ForwardBatch", rows: np.ndarray, last_rows: np.ndarray) -> np.ndarray:
    """The rows whose logits ``batch`` returns, given every row (``rows``) and each sequence's last
    (``last_rows``): all of them with ``all_logits``, each sequence's last, or with
    ``seq_all_logits`` every row of the sequences it flags and the last of the others (in token
    order). A ``seq_all_logits`` of the wrong length is a ``ValueError``."""
    if batch.all_logits:
        return rows
    flags = batch.seq_all_logits
    if flags is None:
        return last_rows
    flags = np.asarray(flags, dtype=np.bool_)
    if flags.shape != last_rows.shape:
        raise ValueError(f"seq_all_logits must hold one flag per sequence ({last_rows.shape[0]}), "
                         f"got shape {flags.shape}")
    if not flags.any():
        return last_rows
    # Every row of a flagged sequence, and every sequence's last.
    keep = np.repeat(flags, np.diff(last_rows, prepend=-1))
    keep[last_rows] = True
    return rows[keep]


@njit(nogil=True, cache=True, fastmath=False)
def derive_int32(token_ids, starts, cached, table, vocab_size, max_positions, page_size, num_pages):
    """:func:`step_inputs_reference`'s checks and derivations in one pass over int32 arrays.
    Returns ``(ok, positions, token_seq, page_table, logit_rows)``; when ``ok`` is False the
    batch is invalid and the arrays are empty. The compiled CPU step (``cpu_step``) calls it too."""
    empty = np.empty(0, np.int32)
    failed = (False, empty, empty, table, empty)
    num_tokens = token_ids.shape[0]
    num_seqs = starts.shape[0] - 1
    if num_seqs < 1 or starts[0] != 0 or starts[num_seqs] != num_tokens:
        return failed
    if cached.shape[0] != num_seqs or table.shape[0] != num_seqs:
        return failed
    for t in range(num_tokens):
        if token_ids[t] < 0 or token_ids[t] >= vocab_size:
            return failed
    max_pages = 0
    for s in range(num_seqs):
        new = np.int64(starts[s + 1]) - np.int64(starts[s])
        if new < 1 or cached[s] < 0:
            return failed
        last = np.int64(cached[s]) + new - 1
        if last >= max_positions:
            return failed
        pages = last // page_size + 1
        if pages > table.shape[1]:
            return failed
        for p in range(pages):
            if table[s, p] < 0 or table[s, p] >= num_pages:
                return failed
        max_pages = max(max_pages, pages)
    width = 1
    while width < max_pages:
        width *= 2
    if width != table.shape[1]:
        padded = np.full((num_seqs, width), -1, np.int32)
        keep = min(width, table.shape[1])
        for r in range(num_seqs):  # not a slice assignment: see kernels/__init__.py
            for c in range(keep):
                padded[r, c] = table[r, c]
        table = padded
    positions = np.empty(num_tokens, np.int32)
    token_seq = np.empty(num_tokens, np.int32)
    logit_rows = np.empty(num_seqs, np.int32)
    for s in range(num_seqs):
        for t in range(starts[s], starts[s + 1]):
            token_seq[t] = s
            positions[t] = cached[s] + (t - starts[s])
        logit_rows[s] = starts[s + 1] - 1
    return True, positions, token_seq, table, logit_rows


def int32_batch(batch: "ForwardBatch") -> bool:
    """Whether ``batch``'s arrays are what :func:`derive_int32` takes: C-contiguous int32 NumPy
    arrays of the right ranks (what the engine and the benches pass)."""
    return (_int32_array(batch.token_ids, 1) and _int32_array(batch.query_starts, 1)
            and _int32_array(batch.cached_lens, 1) and _int32_array(batch.page_table, 2))


def _int32_array(value: object, ndim: int) -> bool:
    return (type(value) is np.ndarray and value.dtype == np.int32 and value.ndim == ndim
            and value.flags.c_contiguous)


def step_inputs(batch: "ForwardBatch", kv: "PagedKVCache", config: "ModelConfig",
                identity_rows: IdentityRows) -> StepInputs:
    """:func:`step_inputs_reference`'s result, in one compiled pass when the batch's arrays are
    int32 (``ValueError`` for an invalid batch, from the reference)."""
    if int32_batch(batch):
        ok, positions, token_seq, table, logit_rows = derive_int32(
            batch.token_ids, batch.query_starts, batch.cached_lens, batch.page_table, config.vocab_size,
            config.max_position_embeddings, kv.page_size, kv.num_pages)
        if ok:
            rows = identity_rows(batch.token_ids.shape[0])
            return StepInputs(token_ids=batch.token_ids, positions=positions, token_seq=token_seq, page_table=table,
                              rows=rows, logit_rows=logit_rows_of(batch, rows, logit_rows))
    return step_inputs_reference(batch, kv, config, identity_rows)
