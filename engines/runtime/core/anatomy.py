"""Where a request's time went: its end-to-end latency cut into phases that add up to it.

Each live request carries a :class:`RequestAnatomy`. The engine charges it once per step it is in
(:meth:`RequestAnatomy.charge_step`: a few float adds, no allocation), and the time between two
such steps when it is charged next; its end closes the last stretch. Every second from its arrival
to its finish lands in exactly one phase (docs/metrics.md, "Anatomy of a request"), so the phases
sum to ``end_to_end_latency_s``.

A step's wall time is shared among the requests in it by tokens: a prefill chunk of ``k`` of the
step's ``T`` tokens owns ``k / T`` of it as its own prefill, the step's other prefill tokens are
time it waited behind others' prefill, and the step's decode tokens are charged to its prefill too
(they ride along almost free). A decoding request's share of a step is the step's decode tokens
(its decode compute) and the rest, the step's prefill tokens, is its decode stretched by others'
prefill: the step would have taken that much less without them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["PHASES", "QueueClock", "RequestAnatomy", "TimeBreakdown"]

#: The phases, in the order a request meets them (each a field of :class:`TimeBreakdown`).
PHASES = ("server", "queued", "prefill", "behind_prefill", "decode", "decode_stretched", "preemption",
          "kv_transfer", "grammar", "engine_overhead")


@dataclass(frozen=True, slots=True)
class TimeBreakdown:
    """A request's end-to-end latency by phase (seconds; they sum to it). docs/metrics.md defines each."""

    server: float
    queued: float
    prefill: float
    behind_prefill: float
    decode: float
    decode_stretched: float
    preemption: float
    kv_transfer: float
    grammar: float
    engine_overhead: float

    @property
    def total(self) -> float:
        """Their sum: the request's end-to-end latency from arrival."""
        return sum(getattr(self, p) for p in PHASES)

    def as_dict(self) -> dict[str, float]:
        """JSON-ready (``usage.extra.time_breakdown``)."""
        return asdict(self)


class QueueClock:
    """Why the waiting queue waited, summed over the engine's life: O(1) a step, however long the
    queue. A request reads it when it comes and when it is first admitted; the difference, capped
    at its queue time, is how much of its queue was others' prefill taking the step's token budget."""

    __slots__ = ("mark", "prefill_blocked_s", "blocker_tokens")

    def __init__(self) -> None:
        self.mark: float | None = None
        self.prefill_blocked_s = 0.0
        self.blocker_tokens = 0

    def step(self, start: float, end: float, blocked_by_prefill: bool, blocker_tokens: int) -> None:
        """A step ran ``start``..``end``; ``blocked_by_prefill``: requests waited while its budget
        went to prefill. The gap since the previous step counts too when that one was blocked."""
        if blocked_by_prefill:
            since = start if self.mark is None else self.mark
            self.prefill_blocked_s += end - since
            self.blocker_tokens = blocker_tokens
            self.mark = end
        else:
            self.mark = None


class RequestAnatomy:
    """The running sums of one request's phases (engine thread only)."""

    __slots__ = ("arrival", "mark", "step", "server", "queued", "prefill", "behind_prefill", "decode",
                 "decode_stretched", "preemption", "kv_transfer", "grammar", "engine_overhead",
                 "grammar_pending", "kv_pending", "preempted", "prefilling", "preemptions",
                 "running_at_add", "max_num_seqs", "blocker_tokens", "blocker_s", "chunk_tokens", "clock_at_add")

    def __init__(self, arrival: float, added: float, running_at_add: int = 0, max_num_seqs: int = 0) -> None:
        self.arrival = arrival
        self.server = max(added - arrival, 0.0)  # tokenizing, the handover to the engine thread
        self.mark = added  # the end of what is charged so far
        self.step = -1  # the last step charged (a request of n choices is charged once a step)
        self.queued = self.prefill = self.behind_prefill = self.decode = self.decode_stretched = 0.0
        self.preemption = self.kv_transfer = self.grammar = self.engine_overhead = 0.0
        self.grammar_pending = 0.0  # grammar-mask time since the last charge (part of the next gap)
        self.kv_pending = 0.0  # the same for sending its K/V
        self.preempted = False  # preempted since the last charge: the gap is the preemption's
        self.prefilling = True  # its prompt is not computed yet
        self.preemptions = 0
        #: For the diagnosis: the engine's load when it came, the largest other prefill it shared
        #: a step with while prefilling (its prompt tokens, and the seconds charged to it), the chunk.
        self.running_at_add = running_at_add
        self.max_num_seqs = max_num_seqs
        self.blocker_tokens = 0
        self.blocker_s = 0.0
        self.chunk_tokens = 0
        self.clock_at_add = 0.0  # QueueClock.prefill_blocked_s when it came

    def admitted(self, now: float, clock: QueueClock | None = None) -> None:
        """Its first admission: the queue ends (a readmission after preemption is charged as a gap).
        The part of the queue others' prefill held the budget (``clock``) is time behind prefill."""
        if self.queued == 0.0 and self.step < 0:
            waited = max(now - self.mark, 0.0)
            blocked = 0.0 if clock is None else min(clock.prefill_blocked_s - self.clock_at_add, waited)
            if blocked > 0.0:
                self.behind_prefill += blocked
                self.blocker_s += blocked
                self.blocker_tokens = max(self.blocker_tokens, clock.blocker_tokens if clock else 0)
            self.queued = waited - max(blocked, 0.0)
            self.mark = now

    def was_preempted(self) -> None:
        """It lost its K/V; the time until it is recomputed is the preemption's."""
        self.preempted = True
        self.preemptions += 1

    def _close_gap(self, until: float) -> None:
        gap = until - self.mark
        if gap <= 0.0:
            return
        g = min(self.grammar_pending, gap)
        self.grammar += g
        k = min(self.kv_pending, gap - g)
        self.kv_transfer += k
        self.grammar_pending = self.kv_pending = 0.0
        rest = gap - g - k
        if self.preempted:
            self.preemption += rest
        elif self.prefilling:
            self.behind_prefill += rest  # waiting for token budget the others' prefill took
        else:
            self.engine_overhead += rest  # scheduling, sampling, detokenizing between its steps
        self.mark = until

    def charge_step(self, step: int, start: float, end: float, own_tokens: int, own_prefills: bool,
                    completes_prompt: bool, step_tokens: int, step_prefill_tokens: int,
                    blocker_tokens: int) -> None:
        """Charge its share of one step's forward pass (``start``..``end``), and the gap before it.

        ``own_prefills``: its chunk computes prompt tokens (after a preemption: recompute).
        ``blocker_tokens``: the prompt length of the step's largest other prefilling request.
        """
        if step == self.step:
            return
        self.step = step
        self._close_gap(start)
        wall = end - max(start, self.mark)
        self.mark = max(self.mark, end)
        if wall <= 0.0 or step_tokens <= 0:
            return
        others_prefill = step_prefill_tokens - (own_tokens if own_prefills else 0)
        behind = wall * others_prefill / step_tokens
        if own_prefills:
            mine = wall - behind
            if self.preempted or self.preemptions:
                self.preemption += mine  # recompute of what the preemption threw away
            else:
                self.prefill += mine
                self.chunk_tokens = max(self.chunk_tokens, own_tokens)
            self.behind_prefill += behind
            if others_prefill and blocker_tokens > self.blocker_tokens:
                self.blocker_tokens = blocker_tokens
            if others_prefill:
                self.blocker_s += behind
            if completes_prompt:
                self.prefilling = False
        else:
            self.decode += wall - behind
            self.decode_stretched += behind
        self.preempted = False

    def close(self, finish: float) -> TimeBreakdown:
        """Its phases, the last stretch (sampling and output of its last step) charged at ``finish``."""
        if self.step < 0 and self.queued == 0.0:
            self.queued = max(finish - self.mark, 0.0)  # never admitted (aborted while waiting)
            self.mark = finish
        self._close_gap(finish)
        return TimeBreakdown(self.server, self.queued, self.prefill, self.behind_prefill, self.decode,
                             self.decode_stretched, self.preemption, self.kv_transfer, self.grammar,
                             self.engine_overhead)
