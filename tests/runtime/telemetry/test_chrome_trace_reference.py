"""The fast Chrome-trace exporter against its plain-Python reference, over random workloads."""
from __future__ import annotations

import dataclasses
import json
import random
import types
from collections import Counter
from itertools import pairwise
from typing import Any

import numpy as np
import pytest

from engines.runtime.telemetry.chrome_trace import export_json
from engines.runtime.telemetry.chrome_trace_reference import export_dict
from engines.runtime.telemetry.trace_recorder import TraceRecorder
from engines.runtime.telemetry.trace_window import TraceWindow

WORKLOADS = 400
CALLS_PER_WORKLOAD = 120


class FakeClock:
    """A nanosecond clock the test moves by hand, so timestamps collide on purpose."""

    def __init__(self, start_ns: int) -> None:
        self.ns = start_ns

    def __call__(self) -> int:
        return self.ns


REQUEST_IDS = ["req-1", "req-2", 'quo"te', "back\\slash", "ünïcödé 🚀", "", "chatcmpl-0"]
SPAN_NAMES = ["prefill", "decode", "queue", 'we"ird ]}', "ünï", " padded"]
INSTANTS = ["first token", "preempt", "finish", "start", "finish ", "start ", "jump forward"]


def random_args(rng: random.Random) -> Any:
    """None, empty, or an object of the JSON types engine code passes (numpy numbers included)."""
    if rng.random() < 0.4:
        return rng.choice([None, {}])
    values = [0, -7, 2**53, 1.5, -0.25, 1e-300, "", 'q"u\\o\nte ü 🚀', True, False, None,
              [1, "a", None], (2, 3), {"nested": {"deep": [1.0, {}]}}, [], np.int64(42),
              np.float64(0.125), np.float32(0.5), np.bool_(True)]
    keys = ["batch_size", "tokens", 'k"ey', "ключ", "", "request_id", "request_ids", "request_tids"]
    args = {rng.choice(keys): rng.choice(values) for _ in range(rng.randint(1, 4))}
    return types.MappingProxyType(args) if rng.random() < 0.1 else args


def random_event(rng: random.Random, open_spans: list[str]) -> str:
    r = rng.random()
    if r < 0.3:
        return f"start {rng.choice(SPAN_NAMES)}"
    if r < 0.55 and open_spans:
        return f"finish {open_spans[-1]}"           # well nested
    if r < 0.7:
        return f"finish {rng.choice(SPAN_NAMES)}"   # out of order, or an orphan
    return rng.choice(INSTANTS)


def check(window: TraceWindow) -> dict[str, Any]:
    """The differential check itself; returns the trace for the coverage tally."""
    fast = json.loads(export_json(window))  # the standard library parser: strict JSON
    reference = export_dict(window)
    assert fast == reference
    return reference


def run_workload(seed: int, tally: Counter[str]) -> None:
    rng = random.Random(seed)
    clock = FakeClock(rng.randint(0, 10**18))
    rec = TraceRecorder(rng.choice(["engine", 'e"ng ü']), "model", "cpu",
                        max_events=rng.choice([4, 15, 40, 10_000]), version="v", clock=clock)
    open_spans: dict[str, list[str]] = {rid: [] for rid in REQUEST_IDS}
    backwards = rng.random() < 0.2   # at_ns readings taken earlier, so ts may go back on a lane
    for _ in range(CALLS_PER_WORKLOAD):
        clock.ns += rng.choice([0, 0, 1, 999, 1000, 1500, 250_000])
        batch = rng.sample(REQUEST_IDS, rng.choice([0, 1, 1, 1, 2, 3]))
        spans = open_spans[batch[0]] if batch else []
        event = random_event(rng, spans)
        if event.startswith("start ") and len(event) > 6:
            spans.append(event[6:])
        elif spans and event == f"finish {spans[-1]}":
            spans.pop()
        at_ns = None
        r = rng.random()
        if r < 0.15:
            at_ns = clock.ns                          # an equal timestamp, taken "elsewhere"
        elif r < 0.25 and backwards:
            at_ns = clock.ns - rng.choice([1, 1000, 5000])
        request_id: Any = batch[0] if len(batch) == 1 and rng.random() < 0.5 else batch
        rec.add_event(request_id, event, random_args(rng), engine_lane=rng.random() < 0.25,
                      at_ns=at_ns)
        r = rng.random()
        if r < 0.02:
            rec.clear()
        elif r < 0.1:
            # A slice served by the recorder itself (the fake clock stands still meanwhile),
            # sometimes taking the window with it.
            clear = rng.random() < 0.5
            window = rec.snapshot()
            served = rec.dump(clear) if rng.random() < 0.3 else json.loads(rec.dump_json(clear))
            assert served == check(window)
            tally_trace(window, served, tally)
    window = rec.snapshot(clear=rng.random() < 0.5)
    tally_trace(window, check(window), tally)


def tally_trace(window: TraceWindow, trace: dict[str, Any], tally: Counter[str]) -> None:
    """Count the situations the workloads are meant to reach."""
    last_ns: dict[Any, int] = {}
    for ns, ids, _, _, engine_lane in window.calls:
        lanes = [*ids, *([None] if engine_lane else [])]   # None: the engine lane
        tally["recorded_ts_goes_back"] += any(ns < last_ns.get(lane, ns) for lane in lanes)
        last_ns.update(dict.fromkeys(lanes, ns))
    other = trace["otherData"]
    tally["orphan_finishes"] += other["orphan_finishes"]
    tally["unclosed_spans"] += other["unclosed_spans"]
    tally["dropped_events"] += other["dropped_events"]
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    tally["engine_lane"] += sum(e["tid"] == 0 for e in events)
    for a, b in pairwise(events):
        if a["tid"] == b["tid"] and a["ts"] == b["ts"]:
            tally["equal_ts"] += 1
            tally["E_then_B_at_equal_ts"] += (a["ph"], b["ph"]) == ("E", "B")
        if a["tid"] == b["tid"] and a["ts"] > b["ts"]:
            tally["ts_backwards"] += 1   # impossible: each lane is sorted by ts
    depth: Counter[int] = Counter()   # per tid: spans open
    for e in events:
        if e["ph"] == "B":
            tally["nested"] += depth[e["tid"]] > 0
            depth[e["tid"]] += 1
        elif e["ph"] == "E":
            depth[e["tid"]] -= 1


def test_fast_exporter_matches_reference_on_random_workloads():
    tally: Counter[str] = Counter()
    for seed in range(WORKLOADS):
        run_workload(seed, tally)
    # The workloads reach every rule they claim to exercise.
    for situation in ("orphan_finishes", "unclosed_spans", "dropped_events", "engine_lane",
                      "equal_ts", "E_then_B_at_equal_ts", "nested", "recorded_ts_goes_back"):
        assert tally[situation] > 0, (situation, tally)
    assert tally["ts_backwards"] == 0


# ---------------------------------------------------------------------- the check can fail

def tiny_window(**changes: Any) -> TraceWindow:
    """Request "a": prefill (0) nests sampling (0) (closed at an equal ts) and step (0), whose
    finish is recorded after prefill's at the same ts; an orphan finish; decode (0) left open.
    The engine lane has the step for ["a", "b"]; "b" also has an instant."""
    us = 1000  # the window's clock is in ns, one tick here is a microsecond
    calls = [
        (1 * us, ("a",), "start prefill", {"tokens": 3}, False),
        (2 * us, ("a",), "start sampling", None, False),
        (2 * us, ("a",), "finish sampling", None, False),   # zero length: E stays after its B
        (3 * us, ("a", "b"), "start step", {"batch_size": 2}, True),
        (4 * us, ("a",), "finish queue", None, False),      # orphan: no "start queue"
        (5 * us, ("a",), "finish prefill", None, False),
        (5 * us, ("a", "b"), "finish step", None, True),    # at 5: innermost E first, then B
        (5 * us, ("a",), "start decode", None, False),
        (6 * us, ("b",), "first token", None, False),
    ]
    fields = dict(calls=calls, now_ns=9 * us, epoch_anchor_ns=10**15, dropped_events=2,
                  max_events=50, engine="eng", model="m", backend="cpu", version="v")
    return TraceWindow(**{**fields, **changes})


def hand_computed_tiny_trace() -> dict[str, Any]:
    t0 = 10**12   # the anchor, in µs

    def ev(name: str, ph: str, ts: int, tid: int, **args: Any) -> dict[str, Any]:
        e = {"name": name, "cat": "engine" if tid == 0 else "request", "ph": ph, "ts": t0 + ts,
             "pid": 1, "tid": tid, "args": args}
        if ph == "i":
            e["s"] = "t"
        return e

    def meta(name: str, tid: int, value: str) -> dict[str, Any]:
        return {"name": name, "ph": "M", "pid": 1, "tid": tid, "args": {"name": value}}

    return {
        "traceEvents": [
            meta("process_name", 0, "eng"), meta("thread_name", 0, "engine"),
            meta("thread_name", 1, "a"), meta("thread_name", 2, "b"),
            ev("step (0)", "B", 3, 0, request_tids=[1, 2], batch_size=2),
            ev("step (0)", "E", 5, 0, request_tids=[1, 2]),
            ev("prefill (0)", "B", 1, 1, tokens=3),
            ev("sampling (0)", "B", 2, 1),
            ev("sampling (0)", "E", 2, 1),
            ev("step (0)", "B", 3, 1, batch_size=2),
            ev("step (0)", "E", 5, 1),
            ev("prefill (0)", "E", 5, 1),
            ev("decode (0)", "B", 5, 1),
            ev("decode (0)", "E", 9, 1, unclosed=True),
            ev("step (0)", "B", 3, 2, batch_size=2),
            ev("step (0)", "E", 5, 2),
            ev("first token", "i", 6, 2),
        ],
        "displayTimeUnit": "ms",
        "otherData": {"engine": "eng", "model": "m", "backend": "cpu", "version": "v",
                      "window": {"first_ts": t0 + 1, "last_ts": t0 + 9}, "event_count": 13,
                      "dropped_events": 2, "request_count": 2, "max_events": 50,
                      "unclosed_spans": 1, "orphan_finishes": 1},
    }


def test_reference_and_fast_exporter_match_a_hand_computed_trace():
    expected = hand_computed_tiny_trace()
    assert export_dict(tiny_window()) == expected
    assert json.loads(export_json(tiny_window())) == expected


def _mutate(calls: list, index: int, **fields: Any) -> list:
    names = ["ns", "ids", "event", "args", "engine_lane"]
    call = dict(zip(names, calls[index], strict=True))
    call.update(fields)
    return [*calls[:index], tuple(call[n] for n in names), *calls[index + 1:]]


MUTATIONS = {
    "one ts moved by 1 µs": lambda calls: _mutate(calls, 0, ns=calls[0][0] - 1000),
    "one event renamed": lambda calls: _mutate(calls, 8, event="first  token"),
    "a finish paired earlier": lambda calls: _mutate(calls, 4, event="finish prefill"),
    "one args value changed": lambda calls: _mutate(calls, 0, args={"tokens": 4}),
    "one engine-lane flag flipped": lambda calls: _mutate(calls, 6, engine_lane=False),
    "a B and its E at equal ts swapped": lambda calls: [calls[0], calls[2], calls[1], *calls[3:]],
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_differential_check_catches_a_one_call_change(mutation):
    """A wrong exporter would fail ``check``: the fast export of the window and the reference
    export of the window with one call changed always differ."""
    window = tiny_window()
    mutated = dataclasses.replace(window, calls=MUTATIONS[mutation](list(window.calls)))
    assert json.loads(export_json(window)) != export_dict(mutated)
    check(mutated)  # and the two exporters still agree on the changed window
