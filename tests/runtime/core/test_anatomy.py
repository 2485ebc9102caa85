"""A request's time breakdown (core.anatomy) and its diagnosis rules (core.diagnosis)."""
from __future__ import annotations

import dataclasses

import pytest

from engines.runtime.core.anatomy import PHASES, QueueClock, RequestAnatomy, TimeBreakdown
from engines.runtime.core.diagnosis import (AnatomyFacts, diagnose, rule_behind_prefill, rule_decode_stretched,
                                            rule_grammar, rule_preempted, rule_queued, rule_server)
from tests.runtime.demo_engine import prompts, request, run_all

ZERO = TimeBreakdown(*([0.0] * len(PHASES)))


def facts(**kw: object) -> AnatomyFacts:
    breakdown = dataclasses.replace(ZERO, **{k: v for k, v in kw.items() if k in PHASES})
    rest = {"running_at_add": 0, "max_num_seqs": 64, "blocker_tokens": 0, "token_budget": 512, "preemptions": 0,
            "prompt_tokens": 10, **{k: v for k, v in kw.items() if k not in PHASES}}
    return AnatomyFacts(breakdown, **rest)  # type: ignore[arg-type]


def test_queued_rule_names_busy_slots_or_room() -> None:
    assert rule_queued(facts(queued=1.9, decode=1.0, running_at_add=64)) == "queued 1.9 s: all 64 sequence slots busy"
    assert "no room in the KV cache" in rule_queued(facts(queued=1.9, decode=1.0, running_at_add=3))
    assert rule_queued(facts(queued=0.01, decode=1.0)) is None  # too small a share


def test_behind_prefill_rule_names_the_blocker() -> None:
    assert (rule_behind_prefill(facts(behind_prefill=7.6, decode=1.0, blocker_tokens=3855))
            == "waited 7.6 s behind one 3,855-token prefill (chunk 512)")
    assert rule_behind_prefill(facts(behind_prefill=0.0, decode=1.0)) is None


def test_preempted_rule_counts() -> None:
    assert rule_preempted(facts(preemption=0.5, decode=1.0, preemptions=2)).startswith(
        "preempted twice: KV cache full")
    assert rule_preempted(facts(decode=1.0)) is None


def test_grammar_rule_share_of_decode() -> None:
    assert rule_grammar(facts(grammar=0.4, decode=0.6)) == "grammar masks took 40% of its decode"
    assert rule_grammar(facts(grammar=0.01, decode=0.6)) is None


def test_stretched_and_server_rules() -> None:
    assert "stretched 0.5 s" in rule_decode_stretched(facts(decode_stretched=0.5, decode=1.0))
    assert "server took 0.6 s" in rule_server(facts(server=0.6, decode=1.0))
    assert diagnose(facts(decode=1.0)) == []


def test_phases_sum_to_end_to_end_by_construction() -> None:
    a = RequestAnatomy(arrival=10.0, added=10.1)
    a.admitted(10.5)
    a.charge_step(1, 10.5, 10.7, 64, True, True, 128, 128, 300)  # half its chunk, half another's
    a.grammar_pending = 0.01
    a.charge_step(2, 10.8, 10.9, 1, False, True, 65, 64, 300)
    b = a.close(11.0)
    assert b.total == pytest.approx(1.0, abs=1e-9)
    assert b.server == pytest.approx(0.1) and b.queued == pytest.approx(0.4)
    assert b.prefill == pytest.approx(0.1) and b.behind_prefill == pytest.approx(0.1)
    assert b.grammar == pytest.approx(0.01) and b.engine_overhead == pytest.approx(0.19)
    assert b.decode == pytest.approx(0.1 / 65) and b.decode_stretched == pytest.approx(0.1 * 64 / 65)
    assert a.blocker_tokens == 300


def test_queue_clock_turns_queue_into_behind_prefill() -> None:
    clock = QueueClock()
    a = RequestAnatomy(arrival=0.0, added=0.0)
    a.clock_at_add = clock.prefill_blocked_s
    clock.step(0.0, 0.3, True, 3855)
    clock.step(0.3, 0.6, True, 3855)
    a.admitted(1.0, clock)
    b = a.close(1.0)
    assert b.behind_prefill == pytest.approx(0.6) and b.queued == pytest.approx(0.4)
    assert a.blocker_tokens == 3855


def test_short_request_behind_long_prefill(make_engine, demo) -> None:
    """End to end on the demo engine: a long prompt, then a short one; the short one's phases sum to
    its E2E and its diagnosis says it waited behind the long prefill."""
    engine = make_engine(prefill_chunk_size=16, max_num_seqs=4, num_pages=64)
    long_p, short_p = prompts(demo, 1, length=400)[0], prompts(demo, 1, length=5, seed=1)[0]
    results = run_all(engine, [request("long", long_p, max_tokens=2), request("short", short_p, max_tokens=2)])
    for rid in ("long", "short"):
        extra = results[rid].usage["extra"]
        assert set(extra["time_breakdown"]) == set(PHASES)
        assert sum(extra["time_breakdown"].values()) == pytest.approx(extra["end_to_end_latency_s"], abs=1e-3)
    short = results["short"].usage["extra"]
    assert short["time_breakdown"]["behind_prefill"] > short["time_breakdown"]["prefill"]
    assert any("behind one 400-token prefill (chunk 16)" in s for s in short["diagnosis"]), short["diagnosis"]
