"""Why a request took as long as it did: sentences from its time breakdown, by rules.

Each rule is a small pure function of one :class:`AnatomyFacts` (the breakdown and what the engine
knew about the request) returning a sentence or None; :func:`diagnose` runs them all, in order.
A rule speaks only when its phase is large enough to matter (:data:`MIN_SHARE` of the end-to-end
latency and :data:`MIN_SECONDS`), so a fast request gets an empty list. docs/metrics.md,
"How to read a diagnosis", says what each sentence means.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engines.runtime.core.anatomy import TimeBreakdown

__all__ = ["MIN_SECONDS", "MIN_SHARE", "RULES", "AnatomyFacts", "diagnose"]

#: A phase below this share of the request's end-to-end latency is not worth a sentence.
MIN_SHARE = 0.2
#: Nor one below this many seconds (a 3 ms request queued 1 ms is fine).
MIN_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class AnatomyFacts:
    """A finished request's breakdown and the engine's facts the rules explain it with."""

    breakdown: TimeBreakdown
    #: Requests running when it reached the engine, and the engine's limit (``max_num_seqs``).
    running_at_add: int
    max_num_seqs: int
    #: Prompt tokens of the largest other request it shared a prefill step with (0: none).
    blocker_tokens: int
    #: The engine's per-step token budget (the prefill chunk size).
    token_budget: int
    preemptions: int
    prompt_tokens: int


def _matters(seconds: float, facts: AnatomyFacts) -> bool:
    total = facts.breakdown.total
    return seconds >= MIN_SECONDS and total > 0.0 and seconds / total >= MIN_SHARE


def rule_queued(f: AnatomyFacts) -> str | None:
    """Long in the queue: say whether the sequence slots were all taken (else KV cache or budget)."""
    q = f.breakdown.queued
    if not _matters(q, f):
        return None
    if f.max_num_seqs and f.running_at_add >= f.max_num_seqs:
        return f"queued {q:.1f} s: all {f.max_num_seqs} sequence slots busy"
    return f"queued {q:.1f} s: no room in the KV cache or the step's token budget ({f.running_at_add} running)"


def rule_behind_prefill(f: AnatomyFacts) -> str | None:
    """Its prefill shared steps with (or waited for the budget of) another request's prefill."""
    b = f.breakdown.behind_prefill
    if not _matters(b, f):
        return None
    if f.blocker_tokens:
        return (f"waited {b:.1f} s behind one {f.blocker_tokens:,}-token prefill (chunk {f.token_budget:,})")
    return f"waited {b:.1f} s behind other requests' prefill (chunk {f.token_budget:,})"


def rule_decode_stretched(f: AnatomyFacts) -> str | None:
    """Its decode steps carried others' prefill chunks."""
    s = f.breakdown.decode_stretched
    if not _matters(s, f):
        return None
    return f"decode stretched {s:.1f} s by other requests' prefill chunks in its steps"


def rule_preempted(f: AnatomyFacts) -> str | None:
    """It was preempted (its K/V freed for lack of pages) and recomputed."""
    if not f.preemptions:
        return None
    times = {1: "once", 2: "twice"}.get(f.preemptions, f"{f.preemptions} times")
    return f"preempted {times}: KV cache full ({f.breakdown.preemption:.1f} s waiting and recomputing)"


def rule_grammar(f: AnatomyFacts) -> str | None:
    """Grammar masks took a large share of its decode."""
    g = f.breakdown.grammar
    decode = f.breakdown.decode + f.breakdown.decode_stretched + g
    if g < MIN_SECONDS or decode <= 0.0 or g / decode < MIN_SHARE:
        return None
    return f"grammar masks took {g / decode:.0%} of its decode"


def rule_server(f: AnatomyFacts) -> str | None:
    """The server's own time (tokenizing, handing over) before the engine took it."""
    s = f.breakdown.server
    if not _matters(s, f):
        return None
    return f"the server took {s:.1f} s before the engine got it (tokenizing {f.prompt_tokens:,} tokens, handover)"


def rule_overhead(f: AnatomyFacts) -> str | None:
    """The engine's time between its steps (scheduling, sampling, detokenizing)."""
    o = f.breakdown.engine_overhead
    if not _matters(o, f):
        return None
    return f"engine overhead {o:.1f} s between its steps (scheduling, sampling, detokenizing)"


#: Every rule, in the order their sentences are listed.
RULES: tuple[Callable[[AnatomyFacts], str | None], ...] = (
    rule_server, rule_queued, rule_behind_prefill, rule_preempted, rule_decode_stretched, rule_grammar,
    rule_overhead)


def diagnose(facts: AnatomyFacts) -> list[str]:
    """The sentences every rule has for ``facts`` (empty: nothing stands out)."""
    return [s for rule in RULES if (s := rule(facts)) is not None]
