"""Deriving request summaries and phase statistics from Chrome traces (no database)."""
from __future__ import annotations

import pytest

from engines.history.analysis import TraceFormatError, analyze_trace
from tests.history.trace_builder import T0, TraceBuilder, serving_trace


def test_summaries_of_a_known_run():
    analysis = analyze_trace(serving_trace(num_requests=3, prompt_tokens=10, completion_tokens=4))
    assert [r.request_id for r in analysis.requests] == ["req-0", "req-1", "req-2"]
    for i, r in enumerate(analysis.requests):
        queue = 100 * (i + 1)
        assert (r.prompt_tokens, r.completion_tokens, r.finish_reason) == (10, 4, "length")
        assert r.queue_us == queue
        assert r.ttft_us == queue + 1001
        assert r.prefill_us == 1000
        assert r.decode_us == 500 * 3
        assert r.e2e_us == queue + 1001 + 600 * 3
        assert r.preemptions == 0
    phases = {(p.lane, p.phase): p.durations for p in analysis.phases}
    assert phases[("request", "decode")].count == 9
    assert phases[("request", "decode")].p50 == 500
    assert phases[("request", "queue")].total == 600
    assert analysis.request_distributions["completion_tokens"].total == 12
    assert analysis.first_ts == T0
    # per request: added, queue B+E, prefill B+E, first token, 3 decode B+E, finish
    assert analysis.event_count == 3 * 13


def test_event_count_and_window():
    trace = serving_trace(num_requests=2, completion_tokens=2)
    analysis = analyze_trace(trace)
    assert analysis.event_count == len([e for e in trace["traceEvents"] if e["ph"] != "M"])
    assert analysis.duration_us == analysis.last_ts - analysis.first_ts == 200 + 1001 + 600


def test_missing_pieces_become_none():
    b = TraceBuilder()
    # Window opened mid-request: no "request added", an E without its B, no finish.
    b.add("late", "first token", T0 + 5)
    b._events.append((1, T0 + 10, 0, 99, {"name": "decode (3)", "ph": "E", "ts": T0 + 10, "pid": 1, "tid": 1,
                                          "args": {"request_id": "late"}}))
    b.add("late", "start decode", T0 + 20)
    analysis = analyze_trace(b.export())
    (r,) = analysis.requests
    assert r.request_id == "late"
    assert (r.ttft_us, r.e2e_us, r.queue_us, r.prefill_us, r.decode_us) == (None, None, None, None, None)
    assert (r.prompt_tokens, r.completion_tokens, r.finish_reason) == (None, None, "")


def test_finished_request_without_decode_has_zero_decode_time():
    b = TraceBuilder()
    b.add("one", "request added to engine", T0, {"prompt_tokens": 7})
    b.add("one", "start prefill", T0 + 1).add("one", "finish prefill", T0 + 11)
    b.add("one", "first token", T0 + 12)
    b.add("one", "finish", T0 + 13, {"finish_reason": "length", "completion_tokens": 1})
    (r,) = analyze_trace(b.export()).requests
    assert (r.prefill_us, r.decode_us, r.queue_us, r.prompt_tokens) == (10, 0, None, 7)


def test_preemption_and_requeue():
    b = TraceBuilder()
    b.add("p", "request added to engine", T0)
    b.add("p", "start queue", T0).add("p", "finish queue", T0 + 10)
    b.add("p", "preempt", T0 + 20)
    b.add("p", "start queue", T0 + 20).add("p", "finish queue", T0 + 50)
    b.add("p", "finish", T0 + 60, {"finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2})
    (r,) = analyze_trace(b.export()).requests
    assert (r.preemptions, r.queue_us, r.e2e_us, r.finish_reason) == (1, 40, 60, "stop")


def test_engine_lane_is_not_a_request():
    b = TraceBuilder()
    b.add(["a", "b"], "start decode", T0, {"batch_size": 2}, engine_lane=True)
    b.add(["a", "b"], "finish decode", T0 + 300, engine_lane=True)
    analysis = analyze_trace(b.export())
    assert sorted(r.request_id for r in analysis.requests) == ["a", "b"]
    phases = {(p.lane, p.phase): p.durations.count for p in analysis.phases}
    assert phases == {("engine", "decode"): 1, ("request", "decode"): 2}


def test_nested_spans_close_latest_open():
    b = TraceBuilder()
    b.add("n", "start prefill", T0).add("n", "start embedding", T0 + 1)
    b.add("n", "finish embedding", T0 + 4).add("n", "finish prefill", T0 + 10)
    phases = {p.phase: p.durations.total for p in analyze_trace(b.export()).phases}
    assert phases == {"prefill": 10, "embedding": 3}


def test_array_form_and_complete_events():
    events = [{"name": "decode (0)", "ph": "X", "ts": 100, "dur": 40, "pid": 1, "tid": 1,
               "args": {"request_id": "x"}},
              {"name": "junk"}, "not an event", {"ph": "i", "ts": "later", "name": "finish"}]
    analysis = analyze_trace(events)
    assert analysis.event_count == 1
    assert (analysis.first_ts, analysis.last_ts) == (100, 140)
    assert analysis.requests[0].decode_us == 40
    assert analysis.phases[0].durations.total == 40


def test_empty_trace():
    analysis = analyze_trace({"traceEvents": []})
    assert (analysis.event_count, analysis.first_ts, analysis.requests, analysis.phases) == (0, None, [], [])


@pytest.mark.parametrize("bad", [{"events": []}, {"traceEvents": {}}, "text", 3, None])
def test_not_a_trace(bad):
    with pytest.raises(TraceFormatError):
        analyze_trace(bad)


def test_ttft_and_e2e_count_from_the_arrival_the_server_stamped():
    """A server stamps "receive request" and opens the queue span at the request's arrival; the
    engine took it later (after the step in flight): the summary's TTFT and end-to-end latency
    are the client's, from the arrival (docs/metrics.md)."""
    b = TraceBuilder()
    b.add("r", "receive request", T0)
    b.add("r", "start queue", T0)
    b.add("r", "start tokenization", T0 + 100).add("r", "finish tokenization", T0 + 300)
    b.add("r", "request added to engine", T0 + 400_000, {"prompt_tokens": 36})
    b.add("r", "finish queue", T0 + 7_600_000)
    b.add("r", "first token", T0 + 9_000_000)
    b.add("r", "finish", T0 + 9_500_000, {"finish_reason": "stop", "completion_tokens": 2})
    (r,) = analyze_trace(b.export()).requests
    assert (r.ttft_us, r.e2e_us, r.queue_us) == (9_000_000, 9_500_000, 7_600_000)
    # A trace from an engine that stamped nothing before its own admission reads as before.
    old = TraceBuilder()
    old.add("o", "request added to engine", T0).add("o", "first token", T0 + 50).add("o", "finish", T0 + 80)
    (o,) = analyze_trace(old.export()).requests
    assert (o.ttft_us, o.e2e_us) == (50, 80)


def test_a_request_s_anatomy_is_read_from_its_finish_and_kept_only_when_well_formed() -> None:
    from engines.runtime import PHASES

    good = {phase: 0.0 for phase in PHASES} | {"queued": 1.5, "prefill": 0.25}
    cases = {
        "good": (good, ["queued 1.5 s: all 4 sequence slots busy"]),
        "unknown-phase": ({**good, "lunch": 1.0}, "not a list"),
        "negative": ({**good, "decode": -0.1}, ["x"] * 17),
        "nan": ({**good, "decode": float("nan")}, [1, 2]),
        "bool": ({**good, "decode": True}, None),
        "missing-phases": ({"queued": 2.0}, ["a" * 900]),
    }
    b = TraceBuilder()
    for rid, (breakdown, diagnosis) in cases.items():
        b.add(rid, "request added to engine", T0, {"prompt_tokens": 3})
        b.add(rid, "finish", T0 + 10, {"finish_reason": "stop", "time_breakdown": breakdown,
                                       "diagnosis": diagnosis})
    b.add("old-server", "finish", T0 + 10, {"finish_reason": "stop"})
    stats = {r.request_id: r for r in analyze_trace(b.export()).requests}
    assert stats["good"].time_breakdown == good and list(stats["good"].time_breakdown) == list(PHASES)
    assert stats["good"].diagnosis == ("queued 1.5 s: all 4 sequence slots busy",)
    for rid in ("unknown-phase", "negative", "nan", "bool"):
        assert stats[rid].time_breakdown is None, rid
        assert stats[rid].diagnosis == (), rid
    # A server that records fewer phases: the rest are 0; a long sentence is cut, not dropped.
    assert stats["missing-phases"].time_breakdown == {phase: 2.0 if phase == "queued" else 0.0 for phase in PHASES}
    assert stats["missing-phases"].diagnosis == ("a" * 500,)
    assert (stats["old-server"].time_breakdown, stats["old-server"].diagnosis) == (None, ())
