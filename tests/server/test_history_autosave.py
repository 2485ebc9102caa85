"""Background history capture (``HistoryAutosave``): periodic trace windows and metrics snapshots on
real demo engines, its ``serve`` flags, and ``serve`` running it end to end."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from django.core.management import CommandError, call_command

from engines.history.autosave import HistoryAutosave
from engines.models import MetricsSnapshot, RequestSummary, TraceRecord
from engines.registry import registry
from engines.server.server_identity import server_id
from tests.server.conftest import TRACED, UNTRACED

REPO = Path(__file__).resolve().parents[2]
INTERVAL = 0.2



def uses_database(test):
    """The marks of a test that writes to the database from the event loop's worker threads."""
    return pytest.mark.django_db(transaction=True)(pytest.mark.usefixtures("async_db_connections_closed")(test))


async def generate(http: httpx.AsyncClient, user: str, max_tokens: int = 4) -> None:
    body = {"model": TRACED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "user": user, "debug_config": {"ignore_eos": True}}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


async def eventually(check, timeout: float = 15.0) -> None:
    """Await ``check()`` (an async predicate) until it holds."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def automatic_records() -> list[TraceRecord]:
    return [r async for r in TraceRecord.objects.filter(source="automatic").order_by("id")]


async def summaries_of(records: list[TraceRecord]) -> list[RequestSummary]:
    return [s async for s in RequestSummary.objects.filter(trace__in=[r.pk for r in records])]


# ------------------------------------------------------------------------- trace windows


@uses_database
async def test_one_window_is_saved_cleared_and_skipped_when_empty(client, engines) -> None:
    autosave = HistoryAutosave([engines[TRACED]], trace_interval_s=60)
    assert await autosave.save_trace_window(engines[TRACED]) is None  # nothing recorded: nothing saved
    await generate(client, "window-1", max_tokens=3)
    record = await autosave.save_trace_window(engines[TRACED])
    assert (record.engine, record.source, record.request_count) == (TRACED, "automatic", 1)
    assert engines[TRACED].engine.tracer.event_count == 0
    assert await autosave.save_trace_window(engines[TRACED]) is None
    assert await TraceRecord.objects.acount() == 1


@uses_database
async def test_autosave_saves_windows_after_traffic_and_nothing_when_idle(client, engines) -> None:
    autosave = HistoryAutosave([engines[TRACED], engines[UNTRACED]], trace_interval_s=INTERVAL)
    assert autosave.traced_engines == [engines[TRACED]]
    autosave.start()
    try:
        await asyncio.sleep(3 * INTERVAL)
        assert await TraceRecord.objects.acount() == 0  # idle: no empty records

        await generate(client, "auto-1", max_tokens=6)

        async def saved() -> bool:
            return engines[TRACED].engine.tracer.event_count == 0 and bool(await automatic_records())
        await eventually(saved)
        await asyncio.sleep(2 * INTERVAL)  # a window being saved right now lands
        records = await automatic_records()
        # The request may straddle a window boundary; then its lane is in two slices, but its
        # "finish" (a request summary with a finish reason) is in exactly one.
        assert {r.engine for r in records} == {TRACED}
        summaries = await summaries_of(records)
        assert {s.request_id for s in summaries} == {"auto-1"}
        assert [(s.finish_reason, s.completion_tokens) for s in summaries if s.finish_reason] == [("length", 6)]

        await asyncio.sleep(3 * INTERVAL)
        assert len(await automatic_records()) == len(records)  # idle again: nothing new
    finally:
        await autosave.stop()
    assert not autosave.running
    assert len(await automatic_records()) == len(records)  # the last window was empty too


@uses_database
async def test_stop_saves_the_last_window_and_ends_promptly(client, engines) -> None:
    tracer = engines[TRACED].engine.tracer
    autosave = HistoryAutosave([engines[TRACED]], trace_interval_s=3600, metrics_interval_s=3600)
    autosave.start()
    tasks = {t for t in asyncio.all_tasks() if t.get_name().startswith(("trace-autosave-", "metrics-snapshot-"))}
    assert len(tasks) == 2
    await generate(client, "last-1")
    started = time.monotonic()
    await autosave.stop()
    assert time.monotonic() - started < 5  # not an interval's wait
    assert all(t.done() for t in tasks) and not autosave.running
    [record] = await automatic_records()
    assert [s.request_id for s in await summaries_of([record])] == ["last-1"]
    assert tracer.event_count == 0
    await autosave.stop()  # twice is harmless

    # Without the last window: the trace stays where it is.
    autosave = HistoryAutosave([engines[TRACED]], trace_interval_s=3600)
    autosave.start()
    await generate(client, "last-2")
    await autosave.stop(save_last_window=False)
    assert len(await automatic_records()) == 1 and tracer.request_ids() == ["last-2"]


@uses_database
async def test_metrics_snapshots_are_written_periodically(client, engines) -> None:
    await generate(client, "metered")
    # Heartbeat 0: every sample is saved, changed or not (the skipping of unchanged ones is
    # tested in tests/history/test_metrics_snapshots.py).
    autosave = HistoryAutosave(engines.values(), metrics_interval_s=0.1, metrics_heartbeat_s=0)
    assert autosave.traced_engines == []  # trace autosave off
    autosave.start()
    try:
        async def three_each() -> bool:
            counts = [await MetricsSnapshot.objects.filter(engine=name).acount() for name in (TRACED, UNTRACED)]
            return min(counts) >= 3
        await eventually(three_each)
    finally:
        await autosave.stop()
    count = await MetricsSnapshot.objects.acount()
    await asyncio.sleep(0.3)
    assert await MetricsSnapshot.objects.acount() == count  # stopped
    snapshots = [s async for s in MetricsSnapshot.objects.filter(engine=TRACED).order_by("taken_at", "id")]
    assert all(s.model == "demo" and (s.server, s.fleet) == (server_id(), "default") for s in snapshots)
    assert snapshots[-1].metrics["completion_tokens_sum"] == 4
    assert snapshots[0].taken_at < snapshots[-1].taken_at
    assert not await TraceRecord.objects.aexists()


def test_intervals_must_be_seconds() -> None:
    for bad in (-1, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match="number of seconds >= 0"):
            HistoryAutosave([], trace_interval_s=bad)
    assert not HistoryAutosave([]).running


# ---------------------------------------------------------------------------- serve flags


@pytest.mark.parametrize("argv, message", [
    (["--trace-autosave", "5"], "add --enable-tracing"),
    (["--enable-tracing", "--trace-autosave", "-1"], "seconds >= 0"),
    (["--metrics-snapshot-interval", "soon"], "expected a number of seconds"),
    (["--metrics-snapshot-interval", "nan"], "seconds >= 0"),
])
def test_serve_refuses_bad_history_flags(argv: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        call_command("serve", *argv)
    assert len(registry) == 0  # refused before any engine was built


@pytest.mark.slow
def test_serve_snapshots_metrics_while_serving_and_saves_the_last_window_on_sigterm(tmp_path) -> None:
    """``serve`` starts the autosave on Daphne's loop and stops it before the engines on SIGTERM."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env |= {"DEBUGSITE_VAR_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--model", "demo", "--enable-tracing", "--port", str(port),
         "--backend", "cpu",
         "--max-num-seqs", "2", "--max-total-tokens", "1024", "--prefill-chunk-size", "64",
         # The interval is far away: the only trace record can come from the save on shutdown.
         "--trace-autosave", "3600", "--metrics-snapshot-interval", "0.2"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    db = tmp_path / "db.sqlite3"

    def rows(sql: str) -> list[tuple]:
        with sqlite3.connect(db, timeout=30) as conn:
            return conn.execute(sql).fetchall()

    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            deadline = time.monotonic() + 180
            while True:
                assert process.poll() is None, process.stdout.read()
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the server did not answer /health in time"
                time.sleep(0.2)
            response = http.post("/v1/completions", json={
                "model": "demo", "prompt": "The lighthouse", "max_tokens": 3, "user": "e2e-autosave",
                "debug_config": {"ignore_eos": True}})
            assert response.status_code == 200, response.text
        # The request changed the metrics, so a snapshot shows it (unchanged ones are skipped).
        deadline = time.monotonic() + 30
        while rows("SELECT count(*) FROM engines_metricssnapshot "
                   "WHERE json_extract(metrics, '$.completion_tokens_sum') = 3")[0][0] < 1:
            assert time.monotonic() < deadline, "no metrics snapshot of the request while serving"
            time.sleep(0.1)
        assert rows("SELECT count(*) FROM engines_tracerecord") == [(0,)]
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    output = process.stdout.read()
    assert "traces saved every 3600 s; metrics every 0.2 s" in output
    assert "Engines stopped." in output and "Traceback" not in output
    assert rows("SELECT engine, source, request_count FROM engines_tracerecord") == [("demo", "automatic", 1)]
    assert rows("SELECT request_id, completion_tokens FROM engines_requestsummary") == [("e2e-autosave", 3)]
    # Every row names the server that wrote it by where it listened, and its fleet.
    here = (f"{socket.gethostname()}:{port}", "default")
    for table in ("tracerecord", "requestsummary", "metricssnapshot"):
        assert rows(f"SELECT DISTINCT server, fleet FROM engines_{table}") == [here], table
