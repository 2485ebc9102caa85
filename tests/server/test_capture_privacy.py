"""Privacy by default (issue 61, item 7): what the server captures of a request (the event trace,
a saved trace's record and request summaries, the live table, the KV cache dump, a profile, the
metrics) holds its ids, counts and times, never its prompt or output text."""
from __future__ import annotations

import httpx
import orjson
import pytest
from asgiref.sync import sync_to_async

from engines.history.payload import decompress_json
from engines.models import ProfileRecord, RequestSummary, TraceRecord
from tests.server.conftest import TRACED

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "Quokkaquartz Zanzibarnix florpwhistle lighthouse"


def _no_text(blob: bytes | str, output: str) -> None:
    text = blob if isinstance(blob, str) else blob.decode("utf-8", errors="replace")
    assert SECRET not in text
    for word in ("Quokkaquartz", "Zanzibarnix", "florpwhistle"):
        assert word not in text, word
    # The demo's output is random tokens; any run of 12 characters of it would be a leak.
    for start in range(0, max(len(output) - 12, 0), 6):
        piece = output[start:start + 12]
        if piece.strip():
            assert piece not in text, piece


async def test_no_capture_holds_the_prompt_or_the_output(client: httpx.AsyncClient) -> None:
    await client.post("/debug/reset_engine", json={"model": TRACED, "clear_trace": True})
    profile = await client.post("/debug/profile_start", json={"model": TRACED, "max_steps": 50})
    assert profile.status_code == 200
    body = {"model": TRACED, "prompt": SECRET, "max_tokens": 24, "user": "privacy-check",
            "debug_config": {"ignore_eos": True}}
    reply = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "privacy-1"})
    assert reply.status_code == 200, reply.text
    output = reply.json()["choices"][0]["text"]
    assert len(output) >= 12  # enough to look for

    trace = await client.post("/debug/dump_event_trace", json={"model": TRACED})
    assert b"privacy-check" in trace.content  # the request is in it, named by its user
    _no_text(trace.content, output)
    for path, extra in (("/debug/list_requests", {}), ("/debug/dump_kv_cache", {"max_entries": 4096}),
                        ("/debug/dump_engine_metrics", {}), ("/debug/dump_workload", {})):
        dumped = await client.post(path, json={"model": TRACED, **extra})
        assert dumped.status_code == 200, (path, dumped.text)
        _no_text(dumped.content, output)
    kv = (await client.post("/debug/dump_kv_cache", json={"model": TRACED})).json()
    assert kv["entries"], "the prompt's pages are cached: the dump lists them, without text"
    _no_text((await client.get("/metrics")).content, output)

    saved = await client.post("/debug/save_event_trace", json={"model": TRACED})
    assert saved.status_code == 200, saved.text
    record = await TraceRecord.objects.aget(pk=saved.json()["id"])
    _no_text(decompress_json(record.payload), output)
    summaries = await sync_to_async(list)(RequestSummary.objects.filter(trace=record).values())
    assert summaries
    _no_text(orjson.dumps(summaries, default=str), output)

    stopped = await client.post("/debug/profile_stop", json={"model": TRACED})
    assert stopped.status_code == 200, stopped.text
    profile_record = await ProfileRecord.objects.aget(pk=stopped.json()["profile_id"])
    _no_text(decompress_json(profile_record.payload), output)


async def test_with_capture_text_the_live_table_shows_the_prompt_start_and_output_end(serve) -> None:
    """``serve --capture-text`` opts in: a live row carries its prompt's first tokens and its output's
    last as text, in /debug/list_requests and the dashboard's snapshot; without it (above) none."""
    import asyncio

    from engines.dashboard.sampler import read_engine
    from engines.registry import registry

    async with serve(enable_debug=True, capture_text=True) as http:
        engine = registry.get(TRACED)
        await engine.reset()
        body = {"model": TRACED, "prompt": SECRET, "max_tokens": 400, "user": "texted",
                "debug_config": {"ignore_eos": True}}
        running = asyncio.ensure_future(http.post("/v1/completions", json=body))
        try:
            for _ in range(300):
                rows = (await http.post("/debug/list_requests", json={"model": TRACED})).json()["requests"]
                if rows and rows[0]["output_text"]:
                    break
                await asyncio.sleep(0.02)
            (row,) = rows
            assert row["prompt_text"].startswith("Quokkaquartz") and row["output_text"]
            _, reading, _ = await read_engine(engine)
            assert reading.live.requests[0].prompt_text == row["prompt_text"]
        finally:
            await running
        await engine.reset()
