"""Saving traces and metrics snapshots into the history."""
from __future__ import annotations

import gzip
import threading

import orjson
import pytest

from engines.history import (
    TraceFormatError,
    asave_metrics_snapshot,
    asave_trace,
    save_metrics_snapshot,
    save_trace,
)
from engines.history.payload import decompress_json
from engines.models import MetricsSnapshot, RequestSummary, TraceRecord
from tests.history.trace_builder import T0, serving_trace


@pytest.mark.django_db
def test_save_stores_metadata_payload_and_summaries():
    trace = serving_trace(num_requests=3, prompt_tokens=10, completion_tokens=4)
    record = save_trace(trace, engine="eng-a", model="demo", source="dashboard", note="n", tags=["x", "y", "x"])
    record = TraceRecord.objects.get(pk=record.pk)
    assert (record.engine, record.model, record.backend, record.source) == ("eng-a", "demo", "cpu", "dashboard")
    assert (record.event_count, record.request_count, record.dropped_events) == (39, 3, 0)
    assert record.first_event_ts == T0
    assert record.duration_us == record.last_event_ts - T0 == 300 + 1001 + 1800
    assert record.tags == "x,y" and record.tag_list == ["x", "y"]
    assert record.engine_version == "test"

    payload = bytes(record.payload)
    assert record.compressed_bytes == len(payload) < record.payload_bytes
    assert orjson.loads(gzip.decompress(payload)) == trace  # a plain gzip file
    assert orjson.loads(decompress_json(payload)) == trace

    rows = list(RequestSummary.objects.filter(trace=record).order_by("request_id"))
    assert [r.request_id for r in rows] == ["req-0", "req-1", "req-2"]
    assert [(r.prompt_tokens, r.completion_tokens, r.finish_reason) for r in rows] == [(10, 4, "length")] * 3
    assert [r.ttft_us for r in rows] == [1101, 1201, 1301]
    assert [r.e2e_us for r in rows] == [2901, 3001, 3101]
    assert all(r.engine == "eng-a" and r.decode_us == 1500 for r in rows)
    assert record.stats["requests"]["ttft_us"]["p50"] == 1201
    assert {p["phase"] for p in record.stats["phases"]} == {"queue", "prefill", "decode"}


@pytest.mark.django_db
def test_save_bytes_keeps_them_verbatim():
    raw = orjson.dumps(serving_trace(num_requests=1), option=orjson.OPT_INDENT_2)
    record = save_trace(raw, engine="eng-a", model="demo", backend="cuda")
    assert gzip.decompress(bytes(TraceRecord.objects.get(pk=record.pk).payload)) == raw
    assert record.backend == "cuda" and record.request_count == 1


@pytest.mark.django_db
@pytest.mark.parametrize("trace, message", [
    (b"{not json", "not valid JSON"),
    (b"[1", "not valid JSON"),
    ({"events": []}, "traceEvents"),
    ("a string", "not str"),
    ({"traceEvents": [{"ts": object()}]}, "cannot be serialised"),
])
def test_save_rejects_non_traces(trace, message):
    with pytest.raises(TraceFormatError, match=message):
        save_trace(trace, engine="eng-a", model="demo")
    assert not TraceRecord.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("kwargs, message", [
    ({"engine": ""}, "engine must be a non-empty string"),
    ({"engine": "e" * 201}, "at most 200"),
    ({"model": None}, "model must be"),
    ({"source": "cron"}, "source must be one of api, dashboard, automatic"),
    ({"tags": ["t" * 200, "u" * 200]}, "tags are"),
    # PostgreSQL text cannot hold NUL: refused up front, on every database alike.
    ({"note": "a\x00b"}, "note must not contain NUL"),
    ({"note": 5}, "note must be a string"),
    ({"tags": ["a\x00b"]}, "tags must not contain NUL"),
    ({"engine": "e\x00"}, "engine must not contain NUL"),
])
def test_save_rejects_bad_metadata(kwargs, message):
    args = {"engine": "eng-a", "model": "demo", **kwargs}
    with pytest.raises(ValueError, match=message):
        save_trace(serving_trace(num_requests=1), **args)


@pytest.mark.django_db
def test_long_request_ids_are_cut_to_fit():
    trace = {"traceEvents": [{"name": "finish", "ph": "i", "ts": 1, "pid": 1, "tid": 1,
                              "args": {"request_id": "r" * 300, "finish_reason": "x" * 50}}]}
    record = save_trace(trace, engine="eng-a", model="demo")
    row = RequestSummary.objects.get(trace=record)
    assert (len(row.request_id), len(row.finish_reason)) == (255, 32)


@pytest.mark.django_db
def test_nul_in_request_ids_is_replaced_so_the_trace_still_saves():
    """A request id is the client's ``user`` field; a NUL in it must not make the trace unsavable
    (PostgreSQL text cannot hold NUL) and so lose a window an autosave already cleared."""
    trace = {"traceEvents": [{"name": "finish", "ph": "i", "ts": 1, "pid": 1, "tid": 1,
                              "args": {"request_id": "a\x00b", "finish_reason": "st\x00op"}}]}
    record = save_trace(trace, engine="eng-a", model="demo")
    row = RequestSummary.objects.get(trace=record)
    assert (row.request_id, row.finish_reason) == ("a\ufffdb", "st\ufffdop")


@pytest.mark.django_db
def test_save_applies_retention(settings):
    settings.TRACE_RETENTION_MAX_RECORDS = 2
    records = [save_trace(serving_trace(num_requests=1), engine="eng-a", model="demo") for _ in range(3)]
    assert set(TraceRecord.objects.values_list("pk", flat=True)) == {records[1].pk, records[2].pk}
    assert RequestSummary.objects.count() == 2
    save_trace(serving_trace(num_requests=1), engine="eng-a", model="demo", retention=False)
    assert TraceRecord.objects.count() == 3


@pytest.mark.django_db
def test_metrics_snapshot():
    snap = save_metrics_snapshot("eng-a", "demo", {"ttft_s": float("nan"), "ok": 1.5, "nested": {"inf": float("inf")}})
    snap = MetricsSnapshot.objects.get(pk=snap.pk)
    assert snap.metrics == {"ttft_s": None, "ok": 1.5, "nested": {"inf": None}}
    with pytest.raises(ValueError, match="metrics must be a mapping"):
        save_metrics_snapshot("eng-a", "demo", [1, 2])


@pytest.mark.django_db(transaction=True)
async def test_async_wrappers_run_off_the_event_loop(monkeypatch):
    import engines.history.digest as digest

    threads: list[int] = []
    real_analyze = digest.analyze_trace

    def spying_analyze(trace):
        threads.append(threading.get_ident())
        return real_analyze(trace)

    monkeypatch.setattr(digest, "analyze_trace", spying_analyze)
    record = await asave_trace(serving_trace(num_requests=2), engine="eng-async", model="demo", note="async")
    assert threads and threads[0] != threading.get_ident()
    stored = await TraceRecord.objects.filter(pk=record.pk).values_list("request_count", "note").aget()
    assert stored == (2, "async")
    snap = await asave_metrics_snapshot("eng-async", "demo", {"requests": 2})
    assert await MetricsSnapshot.objects.filter(pk=snap.pk, engine="eng-async").aexists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_saves_do_not_collide(settings):
    settings.TRACE_RETENTION_MAX_RECORDS = 0  # keep all: count exactly what was saved
    errors: list[BaseException] = []
    engines = ["eng-x", "eng-y"]

    def worker(n: int) -> None:
        from django.db import connection
        try:
            for _ in range(3):
                save_trace(serving_trace(num_requests=4), engine=engines[n % 2], model="demo", note=f"t{n}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert TraceRecord.objects.count() == 12
    assert TraceRecord.objects.filter(engine="eng-x").count() == 6
    assert RequestSummary.objects.count() == 48
    for record in TraceRecord.objects.all():
        assert record.summaries.count() == 4
        assert orjson.loads(decompress_json(record.payload))["otherData"]["request_count"] == 4
