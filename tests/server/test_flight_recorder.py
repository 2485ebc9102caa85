"""The flight recorder (issue 62, part 1): every request that ends is kept, bounded, as a workload
another server can be sent; ``/debug/dump_workload`` answers it, figures equal to the clients'."""
from __future__ import annotations

import asyncio

import pytest

from engines.registry import registry
from engines.runtime.telemetry.flight_recorder import WORKLOAD_FORMAT, FlightRecorder, WorkloadRequest
from tests.server.conftest import TRACED


async def test_the_workload_holds_each_request_as_its_client_measured_it(client) -> None:
    bodies = [{"model": TRACED, "prompt": "a" * (i + 1), "max_tokens": 3 + i, "temperature": 0.5, "seed": i,
               "user": f"flight-{i}", "debug_config": {"ignore_eos": True}} for i in range(3)]
    replies = []
    for body in bodies:
        replies.append(await client.post("/v1/completions", json=body))
        await asyncio.sleep(0.05)
    workload = (await client.post("/debug/dump_workload", json={"model": TRACED})).json()
    assert (workload["format"], workload["version"], workload["engine"]) == (WORKLOAD_FORMAT, 1, TRACED)
    assert workload["dropped"] == 0 and workload["first_arrival_unix"] > 0
    rows = workload["requests"]
    assert [r["request_id"] for r in rows] == ["flight-0", "flight-1", "flight-2"]
    assert rows[0]["offset_s"] == 0 and rows[0]["offset_s"] < rows[1]["offset_s"] < rows[2]["offset_s"]
    for row, body, reply in zip(rows, bodies, replies, strict=True):
        usage = reply.json()["usage"]
        extra = usage["extra"]
        assert (row["prompt_tokens"], row["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert (row["max_tokens"], row["temperature"], row["seed"], row["ignore_eos"]) == (
            body["max_tokens"], 0.5, body["seed"], True)
        assert row["finish_reason"] == "length"
        assert row["ttft_s"] == extra["ttft_s"] and row["e2e_s"] == extra["end_to_end_latency_s"]
        assert row["queue_s"] == extra["queue_time_s"]
        assert "prompt" not in row and "text" not in row  # no text: a replay sends prompts of these lengths
    # A reset starts a new window, as every figure of the engine does.
    await registry.get(TRACED).reset()
    assert (await client.post("/debug/dump_workload", json={})).json()["requests"] == []


def test_the_window_is_bounded_and_counts_what_fell_out() -> None:
    recorder = FlightRecorder(capacity=3)
    for i in range(5):
        recorder.record(WorkloadRequest(f"r{i}", 10.0 + i, 4, 2, 0, 2, 1.0, 1.0, 1, None, False, "length",
                                        0.01, 0.1, 0.2))
    workload = recorder.dump("eng")
    assert [r["request_id"] for r in workload.requests] == ["r2", "r3", "r4"] and workload.dropped == 2
    assert [r["offset_s"] for r in workload.requests] == pytest.approx([0.0, 1.0, 2.0])
