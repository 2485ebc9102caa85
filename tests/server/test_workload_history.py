"""Workloads kept in the history (issue 62, part 1): the flight recorder saved by
``/debug/dump_workload {"save": true}`` and by the dashboard's action, text only with
``--capture-text``, and a saved trace's requests made a workload."""
from __future__ import annotations

import gzip

import httpx
import orjson
import pytest
from asgiref.sync import sync_to_async

from engines.engine_actions import ActionRequest, run_action
from engines.history.workloads import EmptyWorkloadError, read_json_payload, workload_from_trace
from engines.models import TraceRecord, WorkloadRecord
from engines.registry import registry
from engines.runtime.telemetry.flight_recorder import FlightRecorder, WorkloadRequest
from engines.workloads.replay import _body, check_workload
from tests.server.conftest import TRACED

pytestmark = pytest.mark.django_db(transaction=True)


async def _send(client: httpx.AsyncClient, prompts: list[str]) -> list[str]:
    out = []
    for i, prompt in enumerate(prompts):
        reply = await client.post("/v1/completions", json={"model": TRACED, "prompt": prompt, "max_tokens": 3 + i,
                                                          "temperature": 0, "debug_config": {"ignore_eos": True}},
                                  headers={"X-Request-Id": f"wl-{i}"})
        assert reply.status_code == 200, reply.text
        out.append(reply.json()["choices"][0]["text"])
    return out


async def test_dump_workload_saves_into_the_history_and_refuses_an_empty_one(client: httpx.AsyncClient) -> None:
    assert (await client.post("/debug/dump_workload", json={"model": TRACED, "save": True})).status_code == 409
    await _send(client, ["alpha beta", "gamma delta epsilon"])
    saved = await client.post("/debug/dump_workload", json={"model": TRACED, "save": True, "note": "before upgrade"})
    assert saved.status_code == 200, saved.text
    body = saved.json()
    assert body["requests"] == 2 and body["text_captured"] is False
    record = await WorkloadRecord.objects.aget(pk=body["id"])
    assert (record.engine, record.note, record.source, record.request_count) == (TRACED, "before upgrade", "api", 2)
    workload = await sync_to_async(read_json_payload)(record)
    requests = check_workload(workload)
    assert [r["request_id"] for r in requests] == ["wl-0", "wl-1"]
    assert [r["completion_tokens"] for r in requests] == [3, 4]
    assert "prompt_token_ids" not in requests[0] and "output_text" not in requests[0]
    bad = await client.post("/debug/dump_workload", json={"model": TRACED, "save": "yes"})
    assert bad.status_code == 400 and "save" in bad.text
    await registry.get(TRACED).reset()


async def test_with_capture_text_a_workload_keeps_prompts_and_outputs_and_replays_them(serve) -> None:
    async with serve(enable_debug=True, capture_text=True) as client:
        await registry.get(TRACED).reset(clear_trace=True)
        outputs = await _send(client, ["the quick brown fox"])
        workload = (await client.post("/debug/dump_workload", json={"model": TRACED})).json()
        assert workload["text_captured"] is True
        row = workload["requests"][0]
        tokens = (await client.post("/tokenize", json={"model": TRACED, "prompt": "the quick brown fox"})).json()
        assert row["prompt_token_ids"] == tokens["tokens"]
        assert row["output_text"] == outputs[0] and len(row["output_token_ids"]) == 3
        # The replay sends the recorded prompt itself.
        assert _body(0, row, TRACED)["prompt"] == row["prompt_token_ids"]
        await registry.get(TRACED).reset()


async def test_the_dashboard_action_saves_a_workload(client: httpx.AsyncClient) -> None:
    await _send(client, ["one two three"])
    progress: list[str] = []

    async def hear(message: str) -> None:
        progress.append(message)

    result = await run_action(ActionRequest(action="save_workload", id=1, note="from the page"),
                              registry.get(TRACED), hear, source="dashboard", user="admin")
    record = await WorkloadRecord.objects.aget(pk=result["record_id"])
    assert record.source == "dashboard" and record.request_count == 1 and record.note == "from the page"
    assert result["url"].endswith(f"/workloadrecord/{record.pk}/change/")
    await registry.get(TRACED).reset()


async def test_a_saved_trace_becomes_a_workload_with_its_offsets_and_lengths(client: httpx.AsyncClient) -> None:
    await _send(client, ["aa bb", "cc dd ee ff"])
    saved = (await client.post("/debug/save_event_trace", json={"model": TRACED})).json()
    trace = await TraceRecord.objects.aget(pk=saved["id"])
    record = await sync_to_async(workload_from_trace)(trace)
    assert record.source == "trace" and record.trace_id == trace.pk and record.request_count == 2
    requests = check_workload(await sync_to_async(read_json_payload)(record))
    assert [r["request_id"] for r in requests] == ["wl-0", "wl-1"]
    assert [r["completion_tokens"] for r in requests] == [3, 4]
    assert requests[0]["offset_s"] == 0 and requests[1]["offset_s"] > 0
    assert all(r["temperature"] == 0 for r in requests)
    await registry.get(TRACED).reset(clear_trace=True)
    empty = await sync_to_async(TraceRecord.objects.create)(engine=TRACED, model="demo", payload=gzip.compress(b"{}"))
    with pytest.raises(EmptyWorkloadError):
        await sync_to_async(workload_from_trace)(empty)


def test_the_recorder_keeps_token_ids_within_its_budget_oldest_first() -> None:
    recorder = FlightRecorder(capacity=3, token_budget=40)

    def request(i: int) -> WorkloadRequest:
        return WorkloadRequest(f"r{i}", float(i), 3, 2, 0, 2, 0.0, 1.0, 1, None, False, "length", 0.0, 0.1, 0.2)

    for i in range(4):
        recorder.record(request(i), [1, 2, 3], [4, 5])  # 20 bytes each
    assert recorder.token_bytes == 40
    rows = recorder.dump("e", decode=lambda ids: orjson.dumps(ids).decode()).requests
    assert [r["request_id"] for r in rows] == ["r1", "r2", "r3"]  # the window
    assert ["prompt_token_ids" in r for r in rows] == [False, True, True]  # the budget
    assert rows[2]["output_text"] == "[4,5]"
    assert all("prompt_token_ids" not in r for r in recorder.dump("e").requests)  # no text without decode


async def test_the_trace_lists_action_makes_a_workload_and_opens_it(client: httpx.AsyncClient, admin_client) -> None:
    await _send(client, ["one two", "three four five"])
    saved = (await client.post("/debug/save_event_trace", json={"model": TRACED})).json()
    post = sync_to_async(admin_client.post)
    reply = await post("/admin/engines/tracerecord/", {"action": "make_workloads", "_selected_action": [saved["id"]]})
    record = await WorkloadRecord.objects.aget(trace_id=saved["id"])
    assert reply.status_code == 302 and reply["Location"].endswith(f"/workloadrecord/{record.pk}/change/")
    assert (record.source, record.request_count) == ("trace", 2)
    page = await sync_to_async(admin_client.get)(reply["Location"])
    assert page.status_code == 200 and b'id="replay-form"' in page.content and b"from trace #" in page.content
    await registry.get(TRACED).reset(clear_trace=True)
