"""Replay (issue 62, part 2): a workload the flight recorder captured, sent back to a server at its
recorded offsets, each request doing the recorded work; what its client saw is the run."""
from __future__ import annotations

import asyncio

import orjson
import pytest
from django.core.management import CommandError, call_command

from engines.registry import registry
from engines.workloads.replay import RUN_FORMAT, WorkloadError, check_workload, prompt_for, replay
from tests.server.conftest import TRACED


async def test_a_captured_workload_replays_with_its_offsets_lengths_and_the_client_s_figures(client) -> None:
    for i, gap in enumerate((0.0, 0.3, 0.3)):
        await asyncio.sleep(gap)
        reply = await client.post("/v1/completions", json={
            "model": TRACED, "prompt": "b" * (5 + 10 * i), "max_tokens": 4 + i, "temperature": 0,
            "debug_config": {"ignore_eos": True}})
        assert reply.status_code == 200
    workload = (await client.post("/debug/dump_workload", json={"model": TRACED})).json()
    recorded = workload["requests"]
    await registry.get(TRACED).reset()
    run = await replay(workload, client, TRACED, "asgi", speed=2.0)
    result = run.as_dict()
    assert result["format"] == RUN_FORMAT and result["summary"]["succeeded"] == 3
    replayed = (await client.post("/debug/dump_workload", json={"model": TRACED})).json()["requests"]
    for sent, was, now in zip(run.requests, recorded, replayed, strict=True):
        assert sent.status == 200 and sent.error is None
        # The same work: the recorded prompt and output lengths.
        assert (now["prompt_tokens"], now["completion_tokens"]) == (was["prompt_tokens"], was["completion_tokens"])
        assert sent.finish_reason == "length" and sent.text
        assert sent.ttft_s is not None and 0 < sent.ttft_s <= sent.e2e_s
        # A gap a text chunk after the first (a chunk may carry two tokens' text).
        assert 1 <= len(sent.itl_s) <= was["completion_tokens"] - 1
        # Sent at the recorded offset, twice as fast.
        assert sent.sent_offset_s == pytest.approx(was["offset_s"] / 2, abs=0.15)
    await registry.get(TRACED).reset()


def test_a_value_that_is_not_a_workload_this_version_replays_is_refused(tmp_path) -> None:
    for bad, words in (({"format": "other"}, "not a workload"),
                       ({"format": "llm-debugsite.workload", "version": 9, "requests": []}, "version 9"),
                       ({"format": "llm-debugsite.workload", "version": 1, "requests": [{"offset_s": -1}]},
                        "request 0")):
        with pytest.raises(WorkloadError, match=words):
            check_workload(bad)
        path = tmp_path / "w.json"
        path.write_bytes(orjson.dumps({**bad, "engine": "demo"}))
        with pytest.raises(CommandError, match=words):
            call_command("replay", str(path), "--target", "http://127.0.0.1:9", "--output", str(tmp_path / "r.json"))
    assert len(prompt_for(3, 40)) == 40 and prompt_for(3, 40) != prompt_for(4, 40)


def test_an_extra_body_that_is_not_a_json_object_is_refused(tmp_path) -> None:
    path = tmp_path / "w.json"
    path.write_bytes(orjson.dumps({"format": "llm-debugsite.workload", "version": 1, "engine": "demo", "requests": []}))
    for bad, words in (("[1]", "must be a JSON object"), ("{nope", "--extra-body")):
        with pytest.raises(CommandError, match=words):
            call_command("replay", str(path), "--target", "http://127.0.0.1:9", "--extra-body", bad,
                         "--output", str(tmp_path / "r.json"))
