"""Saving what the engine's real ``TraceRecorder`` exports (docs/interfaces.md)."""
from __future__ import annotations

import gzip

import orjson
import pytest
from django.urls import reverse

from engines.history import save_trace
from engines.models import RequestSummary, TraceRecord
from engines.runtime.telemetry.trace_recorder import TraceRecorder

PROMPT = {"r-short": 5, "r-long": 12, "r-cut": 7}
COMPLETION = {"r-short": 2, "r-long": 4}


def recorded_run() -> TraceRecorder:
    """Three requests: two finish ("length" after 2 and 4 tokens), one is still queued."""
    rec = TraceRecorder(engine="eng-rec", model="demo", backend="cpu")
    for rid, tokens in PROMPT.items():
        rec.add_event(rid, "request added to engine", {"prompt_tokens": tokens})
        rec.add_event(rid, "start queue")
    running = ["r-short", "r-long"]
    rec.add_event(running, "finish queue")
    rec.add_event(running, "start prefill", {"batch_size": 2}, engine_lane=True)
    rec.add_event(running, "finish prefill", {"batch_size": 2, "tokens": 17}, engine_lane=True)
    rec.add_event(running, "first token")
    for step in range(3):
        active = running if step == 0 else ["r-long"]
        rec.add_event(active, "start decode", {"batch_size": len(active)}, engine_lane=True)
        rec.add_event(active, "finish decode", engine_lane=True)
        if step == 0:
            rec.add_event("r-short", "finish", {"finish_reason": "length", "prompt_tokens": 5,
                                                "completion_tokens": 2, "prefill_tokens": 5})
    rec.add_event("r-long", "finish", {"finish_reason": "length", "prompt_tokens": 12, "completion_tokens": 4,
                                       "prefill_tokens": 12})
    return rec


@pytest.mark.django_db
@pytest.mark.parametrize("form", ["bytes", "dict"])
def test_recorder_trace_round_trip(admin_client, form):
    rec = recorded_run()
    raw = rec.dump_json()
    trace = orjson.loads(raw)  # one dump: each dump closes the open queue span at its own time
    record = save_trace(raw if form == "bytes" else trace, engine="eng-rec", model="demo")

    rows = {r.request_id: r for r in RequestSummary.objects.filter(trace=record)}
    assert record.request_count == 3 and set(rows) == set(PROMPT)
    for rid, tokens in PROMPT.items():
        assert rows[rid].prompt_tokens == tokens
    for rid, tokens in COMPLETION.items():
        row = rows[rid]
        assert (row.completion_tokens, row.finish_reason) == (tokens, "length")
        assert 0 <= row.queue_us <= row.ttft_us <= row.e2e_us
        assert row.prefill_us >= 0 and row.decode_us >= 0
    cut = rows["r-cut"]
    assert (cut.completion_tokens, cut.ttft_us, cut.e2e_us, cut.finish_reason) == (None, None, None, "")
    assert cut.queue_us is not None  # its open queue span is closed at dump time (args.unclosed)
    assert record.event_count == trace["otherData"]["event_count"]
    phases = {(p["lane"], p["phase"]): p["count"] for p in TraceRecord.objects.get(pk=record.pk).stats["phases"]}
    assert phases[("engine", "decode")] == 3 and phases[("request", "decode")] == 4

    url = reverse("admin:engines_tracerecord_download_json", args=[record.pk])
    downloaded = b"".join(admin_client.get(url).streaming_content)
    assert orjson.loads(downloaded) == trace
    if form == "bytes":
        assert downloaded == raw  # what dump_event_trace returned, byte for byte
        gz = admin_client.get(reverse("admin:engines_tracerecord_download_gzip", args=[record.pk])).content
        assert gzip.decompress(gz) == raw
