"""The step's execute verb: one forward pass over the scheduled chunks (``ModelRunner``).

As vLLM's model runner: it gathers the chunks' tokens, positions and pages into one
``ForwardBatch``, runs the model over it (``forward_greedy`` when no row needs its logits, so the
argmax runs on the device and only ids come back; ``forward`` otherwise) and hands the engine's
update a ``ModelOutput``: a row per chunk that samples, and the rows that score a prompt.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engines.runtime.model.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from engines.runtime.core.kv_pool import KVCachePool
    from engines.runtime.core.scheduler import ScheduledChunk, SchedulerOutput
    from engines.runtime.core.step_observer import StepObserver
    from engines.runtime.model.kv_storage import PagedKVCache
    from engines.runtime.model.llama import LlamaModel

__all__ = ["ModelOutput", "ModelRunner"]


@dataclass
class ModelOutput:
    """What ``ModelRunner.execute`` hands ``Engine._update``: one row per chunk that samples.

    Exactly one of ``token_ids`` (int32 ``[len(sampled)]``: every row was greedy, so the
    argmax ran on the device and only ids came back) and ``logits`` (``[len(sampled),
    vocab_size]``, for the sampler) is set. ``prompt_rows``: the chunks that gather prompt
    logprobs, each with the logits of its every row (views of the step's logits, dropped
    with this output at the end of the step).
    """

    sampled: list[ScheduledChunk]
    token_ids: np.ndarray | None = None
    logits: np.ndarray | None = None
    prompt_rows: list[tuple[ScheduledChunk, np.ndarray]] = field(default_factory=list)


class ModelRunner:
    """Runs the model over a step's chunks; engine thread only.

    Args:
        model: the engine's model (shared: a profile swaps its backend).
        kv: the paged K/V tensors the forward pass reads and writes.
        kv_pool: whose page table maps each sequence to its pages.
    """

    def __init__(self, model: LlamaModel, kv: PagedKVCache, kv_pool: KVCachePool) -> None:
        self.model = model
        self.kv = kv
        self.kv_pool = kv_pool

    def execute(self, sched: SchedulerOutput, obs: StepObserver | None) -> ModelOutput:
        """The forward pass over every scheduled chunk: writes their K/V and returns a row per
        chunk that samples (token ids when every such row is greedy, else logits). ``obs``: the
        step's observer, told as the pass starts and ends (None: nobody watches)."""
        chunks = sched.chunks
        # Plain lists, then one array each: right after a step has streamed the weights through
        # the caches every NumPy call is slow
        # (docs/perf-log/cpu-anchors.md#2026-11-26-cycle-counter-pages-in-runs-key-halves).
        token_ids: list[int] = []
        starts = [0]
        for c in chunks:
            token_ids += c.seq.token_ids[c.start:c.start + c.num_tokens]
            starts.append(starts[-1] + c.num_tokens)
        # Chunks whose every row returns logits: a prompt whose logprobs are wanted (rare: the
        # flag's absence keeps every other step as it was).
        every = [_scores_prompt(c) for c in chunks]
        scoring = any(every)
        batch = ForwardBatch(
            token_ids=np.array(token_ids, dtype=np.int32),
            query_starts=np.array(starts, dtype=np.int32),
            cached_lens=np.array([c.start for c in chunks], dtype=np.int32),
            page_table=self.kv_pool.page_table([c.seq.seq_id for c in chunks]),
            seq_all_logits=np.array(every, dtype=np.bool_) if scoring else None,
        )
        rows = [i for i, c in enumerate(chunks) if c.samples]
        sampled = [chunks[i] for i in rows]
        # Argmax on the device when no row needs its logits: only token ids come back.
        greedy = not scoring and not any(
            c.seq.grammar is not None or not c.seq.request.params.is_greedy or c.seq.request.params.logprobs
            or c.seq.sampling.modifies_logits or c.seq.stop_checker.banned_tokens() for c in sampled)
        if obs is not None:
            obs.forward_starting(sched)
        result = (self.model.forward_greedy if greedy else self.model.forward)(batch, self.kv)
        if obs is not None:
            obs.forward_done(sched)
        prompt_rows: list[tuple[ScheduledChunk, np.ndarray]] = []
        if scoring:
            # A row per token of the scoring chunks, one (their last) per other chunk.
            ends = np.cumsum([c.num_tokens if e else 1 for c, e in zip(chunks, every, strict=True)])
            prompt_rows = [(c, result[ends[i] - c.num_tokens:ends[i]]) for i, c in enumerate(chunks) if every[i]]
            result = result[ends[rows] - 1]
        elif len(rows) < len(chunks):  # some chunks end mid-prompt: keep the sampling rows
            result = result[rows]
        if greedy:
            return ModelOutput(sampled, token_ids=result)
        return ModelOutput(sampled, logits=result, prompt_rows=prompt_rows)


def _scores_prompt(chunk: ScheduledChunk) -> bool:
        """Whether ``chunk`` computes positions whose logits score a prompt token still missing a
        logprob (its choice gathers them, and it reaches past the ones it has)."""
        seq = chunk.seq
        if not seq.gathers_prompt_logprobs:
            return False
        got = seq.request.prompt_logprobs
        assert got is not None  # gathers_prompt_logprobs: the request asked for them
        # Position p scores prompt token p + 1: the positions len(got) - 1 .. prompt - 2 are due.
        return chunk.start < seq.num_prompt_tokens - 1 and chunk.start + chunk.num_tokens >= len(got)
