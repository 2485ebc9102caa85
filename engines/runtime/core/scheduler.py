"""Continuous batching: which sequences compute which tokens in the next step.

Every sequence is a list of tokens and a count of how many of them already have
their K/V in the cache. A step feeds each scheduled sequence a chunk of its
not-yet-computed tokens: the rest of a prompt (chunked prefill), the tokens a
grammar forced (jump-forward), or the one token sampled last step (decode). So
prefill and decode share one forward pass and one token budget, as in vLLM v1.

Policy, in order:
1. Running sequences, oldest first, each take what they need from the budget.
   When the KV pool is out of pages, the newest running sequence is preempted
   (its pages freed, it goes back to the front of the waiting queue and is
   recomputed later; the prefix cache usually gives most of it back).
2. Waiting sequences, first come first served, are admitted while the budget,
   the sequence limit and the pool allow. Nothing is admitted in a step that had
   to preempt, so a full pool does not thrash.
Oldest-first everywhere means no request starves.

A sequence that cannot get its pages while no other sequence holds any will never
get them: what it lacks is pinned (``pinned_system_prompt``), and pins last until
the engine is reset. Waiting for room would spin the engine forever, so such a
sequence is dropped and reported in ``SchedulerOutput.out_of_pages``; the engine
ends it as it ends one that reached the context limit.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engines.runtime.core.kv_pool import Admission, KVCachePool

if TYPE_CHECKING:
    from engines.runtime.core.request import Sequence


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq``, starting at token ``start``, computed this step."""

    seq: "Sequence"
    start: int
    num_tokens: int

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the sequence's last token."""
        return self.start + self.num_tokens == len(self.seq.token_ids)

    @property
    def prefills(self) -> bool:
        """Whether this chunk computes prompt tokens (a prefill chunk; else a decode: the token
        sampled last step, or tokens a grammar forced)."""
        return self.start < self.seq.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """Whether a new token is sampled after this chunk: it completes the sequence, which is not
        one that only prefills (to send its K/V to another engine, or with ``max_tokens`` 0)."""
        return self.completes and not self.seq.prefill_only

    @property
    def is_prefill(self) -> bool:
        """Prompt (or recompute) work rather than one decode token."""
        return self.start < self.seq.num_prompt_tokens or self.num_tokens > 1


@dataclass
class SchedulerOutput:
    """What one step computes, plus the sequences it preempted to make room.

    ``out_of_pages``: sequences dropped because the pool, less its pinned pages, can
    never hold them (see the module docstring); they hold no pages any more.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list["Sequence"] = field(default_factory=list)
    admitted: list["Sequence"] = field(default_factory=list)
    out_of_pages: list["Sequence"] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (the forward batch's length)."""
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of prefill (or recompute) chunks."""
        return sum(c.num_tokens for c in self.chunks if c.is_prefill)

    @property
    def num_decode_seqs(self) -> int:
        """Sequences decoding one token this step."""
        return sum(1 for c in self.chunks if not c.is_prefill)


class Scheduler:
    """FCFS continuous-batching scheduler over a :class:`KVCachePool`.

    Args:
        kv_pool: the page allocator (with its prefix cache).
        max_num_seqs: most sequences running at once.
        token_budget: most tokens computed in one step (prefill chunks + decodes).
    """

    def __init__(self, kv_pool: KVCachePool, max_num_seqs: int, token_budget: int) -> None:
        if token_budget < max_num_seqs:
            raise ValueError(
                f"the per-step token budget ({token_budget}) must be at least max_num_seqs "
                f"({max_num_seqs}), or some running sequences could never decode"
            )
        self.kv_pool = kv_pool
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: "Sequence") -> None:
        """Queue a new sequence behind every earlier one."""
        self.waiting.append(seq)

    def remove(self, seq: "Sequence") -> None:
        """Drop a finished or aborted sequence and release its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_pool.free(seq.seq_id)

    def clear(self) -> None:
        """Forget every sequence (engine reset; the caller resets the pool)."""
        self.waiting.clear()
        self.running.clear()
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        """Whether any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks; see the module docstring for the policy."""
        out = SchedulerOutput()
        budget = self.token_budget
        for seq in list(self.running):
            if seq not in self.running:  # preempted earlier in this loop
                continue
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            if n <= 0:
                continue
            while not self.kv_pool.try_allocate(seq.seq_id, n):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    self._drop(seq)
                    out.out_of_pages.append(seq)
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            admission = self._admit(seq, budget)
            if admission is None:
                if self.running:  # they will finish and free pages
                    break
                self.waiting.popleft()
                out.out_of_pages.append(seq)
                continue
            self.waiting.popleft()
            seq.preempted = False
            seq.num_computed = admission.cached_tokens
            seq.num_cached_prefix_tokens = admission.cached_tokens
            self.running.append(seq)
            out.admitted.append(seq)
            out.chunks.append(ScheduledChunk(seq, admission.cached_tokens, admission.new_tokens))
            budget -= admission.new_tokens
        return out

    def _admit(self, seq: "Sequence", budget: int) -> Admission | None:
        """The pool's admission of a waiting sequence; one that already holds pages (its prompt's
        K/V arrived from another engine: disaggregated serving) only reserves its next chunk."""
        if seq.seq_id not in self.kv_pool:
            return self.kv_pool.admit(seq.seq_id, seq.token_ids, budget, seq.prefix_cache_limit)
        computed = self.kv_pool.num_computed_tokens(seq.seq_id)
        n = min(len(seq.token_ids) - computed, budget)
        return Admission(computed, n) if self.kv_pool.try_allocate(seq.seq_id, n) else None

    def _drop(self, seq: "Sequence") -> None:
        self.running.remove(seq)
        self.kv_pool.free(seq.seq_id)

    def _preempt(self, seq: "Sequence") -> None:
        self.running.remove(seq)
        self.kv_pool.free(seq.seq_id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.preempted = True
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
