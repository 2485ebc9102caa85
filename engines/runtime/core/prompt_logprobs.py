"""Prompt logprobs: from the logits rows of a prefill chunk, each next prompt token's
log-probability and the most likely alternatives (what ``echo`` with ``logprobs`` returns, and
``SamplingParams.prompt_logprobs`` asks for).

Row ``i`` of a chunk's logits is the model's prediction after position ``i``, so it scores the
prompt token at position ``i + 1`` (``targets[i]``). The log-softmax is the raw model's, before
any bias, penalty or grammar (those shape what is sampled, and a prompt is not sampled), and is
taken as the sampler takes it for a generated token (``Sampler._logprobs``: the row's peak, the
exponentials in float32, their sum in float64), so the last prompt row and the first generated
token are scored alike.

Two forms compute the same :class:`TokenLogprob` list:

* :func:`prompt_logprobs_reference`, row by row through the sampler's own function: the plain
  reference the tests diff against;
* :func:`prompt_logprobs`, the engine's, a block of rows per NumPy call (a 512-token chunk is
  512 rows of the vocabulary: row by row, the Python around each row would cost more than its
  arithmetic). A block at a time, so what it allocates beside the chunk's logits stays a block's.

A token's own logprob and its entry among the alternatives come from the same subtraction, so a
prompt token that is the most likely one has exactly the top logprob (lm-evaluation-harness tells
a greedy continuation by that equality).
"""
from __future__ import annotations

import numpy as np

from engines.runtime.core.sampler import Sampler, TokenLogprob

__all__ = ["BLOCK_ROWS", "prompt_logprobs", "prompt_logprobs_reference"]

#: Rows per NumPy call: a block's temporaries are BLOCK_ROWS x vocabulary float32s (64 x 128k
#: = 32 MB at most), next to a chunk's logits that may be ten times as large.
BLOCK_ROWS = 64


def prompt_logprobs(logits: np.ndarray, targets: np.ndarray, top: int) -> list[TokenLogprob]:
    """``targets[i]``'s log-probability under row ``i`` of ``logits`` (float32 ``[R, V]``), with
    the ``top`` most likely tokens (most likely first, equal ones by id) when ``top`` > 0."""
    rows, vocab = logits.shape
    targets = np.asarray(targets, dtype=np.int64)
    if targets.shape != (rows,):
        raise ValueError(f"{rows} logits rows need {rows} target tokens, got shape {targets.shape}")
    out: list[TokenLogprob] = []
    k = min(top, vocab)
    for begin in range(0, rows, BLOCK_ROWS):
        block = logits[begin:begin + BLOCK_ROWS]
        n = block.shape[0]
        peak = block.max(axis=1)
        lse = peak.astype(np.float64) + np.log(np.exp(block - peak[:, None]).sum(axis=1, dtype=np.float64))
        # float64 subtractions, as the sampler's: a token and its entry among the alternatives agree.
        own = (block[np.arange(n), targets[begin:begin + n]].astype(np.float64) - lse).tolist()
        tokens = targets[begin:begin + n].tolist()
        if not k:
            out.extend(TokenLogprob(t, lp) for t, lp in zip(tokens, own, strict=True))
            continue
        # The k largest of each row, then ordered: most likely first, ties by id.
        idx = np.argpartition(-block, k - 1, axis=1)[:, :k] if k < vocab else np.tile(np.arange(vocab), (n, 1))
        values = np.take_along_axis(block, idx, axis=1)
        order = np.lexsort((idx, -values), axis=1)
        idx = np.take_along_axis(idx, order, axis=1)
        values = np.take_along_axis(values, order, axis=1)
        finite = np.isfinite(values).tolist()  # a masked (-inf) entry is no alternative
        alt = (values.astype(np.float64) - lse[:, None]).tolist()
        ids = idx.tolist()
        for r in range(n):
            alternatives = tuple((t, v) for t, v, f in zip(ids[r], alt[r], finite[r], strict=True) if f)
            out.append(TokenLogprob(tokens[r], own[r], alternatives))
    return out


def prompt_logprobs_reference(logits: np.ndarray, targets: np.ndarray, top: int) -> list[TokenLogprob]:
    """:func:`prompt_logprobs`, one row at a time through ``Sampler._logprobs`` (the plain form)."""
    return [Sampler._logprobs(np.array(row, dtype=np.float32), row.max(), int(token), top)
            for row, token in zip(logits, targets, strict=True)]
