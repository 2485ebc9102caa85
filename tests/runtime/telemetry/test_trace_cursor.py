"""TraceRecorder.read_since: the live viewer's cursor (issue 12).

A reader that follows the recorder must see every call exactly once, in order, with what a dump
would show, and be told how many events it lost to eviction or a clear.
"""
from __future__ import annotations

import threading

import orjson
import pytest

from engines.runtime.telemetry.chrome_trace_reference import export_dict
from engines.runtime.telemetry.trace_recorder import TraceRecorder
from engines.runtime.telemetry.trace_window import TraceWindow
from tests.runtime.telemetry.test_trace_recorder import FakeClock, decode_run


def read_all(rec: TraceRecorder, cursor: int = 0, max_calls: int = 20_000,
             max_bytes: int = 1 << 30) -> tuple[list, int, int]:
    """Read until the recorder has nothing more; (calls, cursor, missed)."""
    calls: list = []
    missed = 0
    while True:
        delta = rec.read_since(cursor, max_calls, max_bytes)
        assert len(delta.calls_json) <= max_bytes or delta.calls == 1
        batch = orjson.loads(delta.calls_json)
        assert len(batch) == delta.calls
        calls += batch
        missed += delta.missed
        cursor = delta.cursor
        if not delta.more:
            return calls, cursor, missed


def window_of(rec: TraceRecorder, calls: list, now_us: int) -> TraceWindow:
    """The calls a reader collected, as the window a dump would export (anchor 0: ts already µs)."""
    raw = [(ts * 1000, tuple(ids), event, args, engine_lane) for ts, ids, event, args, engine_lane in calls]
    return TraceWindow(raw, now_us * 1000, 0, 0, rec.max_events, rec.engine, rec.model, rec.backend, rec.version)


def test_reads_every_call_once_in_order_and_rebuilds_the_dump():
    clock = FakeClock()
    rec = TraceRecorder(clock=clock, engine="e", model="m")
    cursor = 0
    seen: list = []
    for round_ in range(5):
        for rid in (f"r{round_}a", f"r{round_}b"):
            rec.add_event(rid, "start prefill", {"tokens": 3})
            clock.advance_us(2)
        rec.add_event([f"r{round_}a", f"r{round_}b"], "start decode", {"batch_size": 2}, engine_lane=True)
        clock.advance_us(5)
        rec.add_event([f"r{round_}a", f"r{round_}b"], "finish decode", engine_lane=True)
        delta = rec.read_since(cursor)
        assert delta.missed == 0 and not delta.more
        assert delta.calls == 4
        seen += orjson.loads(delta.calls_json)
        cursor = delta.cursor
    assert cursor == rec.event_count == 5 * (2 + 3 + 3)
    assert rec.read_since(cursor).calls == 0   # nothing new: an empty read
    # What the reader holds is exactly what a dump exports, spans, names and lanes included.
    dump = rec.dump()
    rebuilt = export_dict(window_of(rec, seen, rec.read_since(cursor).now_us))
    strip = lambda trace: [e for e in trace["traceEvents"] if not e.get("args", {}).get("unclosed")]  # noqa: E731
    assert strip(rebuilt) == strip(dump)


def test_timestamps_and_args_are_written_as_the_dump_writes_them():
    rec = TraceRecorder()
    rec.add_event("a", "kv cache admit", {"cached_tokens": 7, "nested": {"x": [1, 2]}})
    [[ts, ids, event, args, engine_lane]] = orjson.loads(rec.read_since(0).calls_json)
    [dumped] = [e for e in rec.dump()["traceEvents"] if e["ph"] == "i"]
    assert (ts, ids, event, args, engine_lane) == (dumped["ts"], ["a"], "kv cache admit", dumped["args"], False)
    rec.add_event("a", "first token")
    [[_, _, _, args, _]] = orjson.loads(rec.read_since(1).calls_json)
    assert args is None


def test_eviction_before_the_read_is_counted_as_missed():
    rec = TraceRecorder(max_events=10)
    decode_run(rec, ["a"], 2)          # 7 + 4 + 2 = 13 events: 3 evicted
    calls, cursor, missed = read_all(rec)
    assert missed == 3 == rec.dropped_events
    assert len(calls) == rec.event_count == 10
    assert cursor == 13
    # A reader that keeps up misses nothing afterwards even while eviction goes on.
    rec.add_event("a", "x")
    calls, cursor, missed = read_all(rec, cursor)
    assert (len(calls), missed, cursor) == (1, 0, 14)
    # A reader that falls behind by more than the buffer hears exactly how much.
    for _ in range(25):
        rec.add_event("a", "y")
    calls, cursor, missed = read_all(rec, cursor)
    assert (len(calls), missed, cursor) == (10, 15, 39)


def test_batched_calls_leave_together_and_count_their_events():
    rec = TraceRecorder(max_events=4)
    rec.add_event(["a", "b"], "start decode", engine_lane=True)   # 3 events
    rec.add_event(["a", "b"], "finish decode", engine_lane=True)  # 3 more: the first call goes
    calls, cursor, missed = read_all(rec)
    assert (len(calls), missed, cursor) == (1, 3, 6)


def test_clear_and_dump_with_clear_move_the_window_past_unread_events():
    rec = TraceRecorder()
    rec.add_event("a", "one")
    _, cursor, _ = read_all(rec)
    rec.add_event("a", "two")
    rec.clear()
    rec.add_event("a", "three")
    calls, cursor, missed = read_all(rec, cursor)
    assert [c[2] for c in calls] == ["three"] and missed == 1 and cursor == 3
    rec.add_event("a", "four")
    rec.dump_json(clear=True)
    rec.add_event("a", "five")
    calls, cursor, missed = read_all(rec, cursor)
    assert [c[2] for c in calls] == ["five"] and missed == 1 and cursor == 5
    # A reader that had read everything before the clear misses nothing.
    rec.clear()
    calls, cursor2, missed = read_all(rec, cursor)
    assert (calls, missed, cursor2) == ([], 0, 5)


def test_capped_reads_continue_where_they_stopped():
    rec = TraceRecorder()
    for i in range(25):
        rec.add_event(f"r{i % 3}", f"e{i}")
    first = rec.read_since(0, max_calls=10)
    assert first.calls == 10 and first.more and first.cursor == 10
    calls, cursor, missed = read_all(rec, first.cursor, max_calls=10)
    assert [c[2] for c in calls] == [f"e{i}" for i in range(10, 25)]
    assert (cursor, missed) == (25, 0)


def test_reads_stay_under_the_byte_cap_and_lose_nothing():
    """A websocket message has a size limit: a long backlog comes in several reads."""
    rec = TraceRecorder()
    batch = [f"request-{i:04d}" for i in range(64)]
    for i in range(300):
        rec.add_event(batch, f"step {i}", {"batch_size": 64}, engine_lane=True)
    first = rec.read_since(0, max_bytes=20_000)
    assert first.more and 1 < first.calls < 300 and len(first.calls_json) <= 20_000
    assert first.cursor == first.calls * 65   # 64 request events and the engine lane's each
    calls, cursor, missed = read_all(rec, max_bytes=20_000)
    assert [c[2] for c in calls] == [f"step {i}" for i in range(300)]
    assert (cursor, missed) == (rec.event_count, 0)
    # One call bigger than the cap still comes (alone): a reader never stalls.
    assert rec.read_since(0, max_bytes=10).calls == 1


@pytest.mark.parametrize("cursor", [-1, 1.5, "3", 99])
def test_bad_cursors_are_refused(cursor):
    rec = TraceRecorder()
    rec.add_event("a", "x")
    with pytest.raises(ValueError):
        rec.read_since(cursor)


def test_a_reader_concurrent_with_the_engine_sees_every_call_once():
    rec = TraceRecorder(max_events=1_000_000)
    stop = threading.Event()
    total = 20_000

    def engine() -> None:
        for i in range(total):
            rec.add_event([f"r{i % 7}", f"r{(i + 1) % 7}"], f"e{i}", engine_lane=(i % 2 == 0))
        stop.set()

    thread = threading.Thread(target=engine)
    thread.start()
    names: list[str] = []
    cursor = missed = 0
    while True:
        done = stop.is_set()
        delta = rec.read_since(cursor, max_calls=997)
        names += [c[2] for c in orjson.loads(delta.calls_json)]
        cursor, missed = delta.cursor, missed + delta.missed
        if done and not delta.more:
            break
    thread.join()
    assert names == [f"e{i}" for i in range(total)]
    assert missed == 0 and cursor == rec.event_count
