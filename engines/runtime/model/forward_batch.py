"""A forward step's input: the ragged batch of sequences the model runs (:class:`ForwardBatch`).

Below ``llama`` and the modules it calls (``step_inputs``, which checks a batch and derives its
metadata, and ``cpu_step``, the compiled CPU step), so that they can name the batch without
importing the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ForwardBatch"]


@dataclass
class ForwardBatch:
    """One step's ragged batch of sequences."""

    token_ids: np.ndarray     # int32 [num_tokens]: the new tokens of every sequence, concatenated
    query_starts: np.ndarray  # int32 [num_seqs + 1]: sequence i owns token_ids[query_starts[i]:query_starts[i+1]]
    cached_lens: np.ndarray   # int32 [num_seqs]: tokens already in the KV cache (= position of its first new token)
    page_table: np.ndarray    # int32 [num_seqs, max_pages]: the sequence's page ids in order, -1 padded
    all_logits: bool = False  # return logits of every new token, not only each sequence's last
    #: bool [num_seqs], or None: the sequences that return logits of every new token (a prefill chunk
    #: whose prompt logprobs are wanted), the others of their last alone; rows in token order. With
    #: ``all_logits`` every sequence does.
    seq_all_logits: np.ndarray | None = None
