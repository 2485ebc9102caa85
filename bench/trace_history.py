"""Benchmark the trace history: saving a 1,000,000-event trace, and admin list pages at scale.

Goals (issue 5): save ≤ 3 s on PostgreSQL including summaries; the admin trace list with
100,000 records and the request list with 1,000,000 rows ≤ 300 ms server time per page.

    .venv/bin/python bench/trace_history.py                 # PostgreSQL, database trace_history_bench
    .venv/bin/python bench/trace_history.py --database-url sqlite:////tmp/bench.sqlite3 --skip-lists
    .venv/bin/python bench/trace_history.py --events 200000 --skip-lists   # a quick run

The benchmark database is created if missing and rebuilt (flushed) each run; it is never
the development or test database. Page times are Django test-client round trips (URL
routing, views, queries, template rendering): the server's time, without a network.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

T0 = 1_700_000_000_000_000

from bench.results_file import add_results_option, ResultsFile  # noqa: E402


def recorded_trace(target_events: int, batch: int = 32, decode_steps: int = 235):
    """A ``TraceRecorder`` filled the way a busy engine fills it: waves of ``batch``
    requests, each queued, prefilled together, then decoded ``decode_steps`` steps, with
    the engine-lane step spans; about ``target_events`` trace events in all."""
    from engines.runtime import TraceRecorder

    per_request = 2 * decode_steps + 10  # request-lane events per request, engine lane aside
    num_requests = max(batch, target_events // per_request)
    rec = TraceRecorder(engine="bench", model="demo", backend="cpu", max_events=2 * target_events)
    ids = [f"chatcmpl-{i:08d}" for i in range(num_requests)]
    for wave in range(0, num_requests, batch):
        lanes = ids[wave:wave + batch]
        for rid in lanes:
            rec.add_event(rid, "request added to engine", {"prompt_tokens": 100})
            rec.add_event(rid, "start queue")
        rec.add_event(lanes, "finish queue")
        rec.add_event(lanes, "start prefill", {"batch_size": len(lanes)}, engine_lane=True)
        rec.add_event(lanes, "finish prefill", {"batch_size": len(lanes), "tokens": 100 * len(lanes)},
                      engine_lane=True)
        rec.add_event(lanes, "first token")
        for _ in range(decode_steps):
            rec.add_event(lanes, "start decode", {"batch_size": len(lanes)}, engine_lane=True)
            rec.add_event(lanes, "finish decode", engine_lane=True)
        for rid in lanes:
            rec.add_event(rid, "finish", {"finish_reason": "length", "prompt_tokens": 100,
                                          "completion_tokens": decode_steps + 1, "prefill_tokens": 100})
    return rec


def setup_django(database_url: str) -> None:
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "debugsite.settings")
    if database_url.startswith("postgres"):
        _create_pg_database(database_url)
    import django
    from django.conf import settings

    django.setup()
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    settings.DEBUG = False
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    call_command("flush", interactive=False, verbosity=0)


def _create_pg_database(url: str) -> None:
    from urllib.parse import urlsplit

    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin_url = parts._replace(path="/postgres").geturl()
    with psycopg.connect(admin_url, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median wall time in ms over ``repeat`` runs (after one warm-up), and the last result."""
    result = fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples), result


def bench_save(events: int, repeat: int, results: ResultsFile) -> dict[str, Any]:
    import orjson

    from engines.history import save_trace
    from engines.history.analysis import analyze_trace
    from engines.history.digest import _gc_paused
    from engines.history.payload import compress_json
    from django.db import connection

    from engines.models import RequestSummary, TraceRecord

    rec = recorded_trace(events)
    where = {"database": connection.vendor, "events": events}

    def stage(label: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - start) * 1000
        print(f"  {label:<34} {ms:8.0f} ms")
        results.add(f"stage alone: {label}", ms, "ms", **where)
        return out

    print("stages, each alone (save_trace overlaps gzip with the analysis):")
    raw = stage("recorder dump_json (engine side)", rec.dump_json)

    def parse() -> Any:
        with _gc_paused():
            return orjson.loads(raw)
    trace = stage("orjson.loads (GC paused)", parse)
    stage("orjson.dumps (dict input only)", lambda: orjson.dumps(trace))
    stored = stage("gzip", lambda: compress_json(raw))
    analysis = stage("analyze (summaries, stats)", lambda: analyze_trace(trace))
    print(f"  {analysis.event_count:,} events, {len(analysis.requests):,} requests; "
          f"JSON {len(raw) / 1e6:.1f} MB -> gzip {len(stored.data) / 1e6:.1f} MB")

    saved: dict[str, Any] = {"events": analysis.event_count}
    for label, value in (("bytes (dump_json)", raw), ("dict (dump)", trace)):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            record = save_trace(value, engine="bench-save", model="demo", retention=False)
            times.append((time.perf_counter() - start) * 1000)
        assert RequestSummary.objects.filter(trace=record).count() == len(analysis.requests)
        print(f"save_trace({label}): median {statistics.median(times):.0f} ms, "
              f"runs {', '.join(f'{t:.0f}' for t in times)} ms")
        results.add(f"save_trace, {label}", statistics.median(times) / 1000, "s", **where)
        saved[label] = statistics.median(times)
        saved["record"] = record
    TraceRecord.objects.filter(engine="bench-save").exclude(pk=saved["record"].pk).defer("payload").delete()
    return saved


def populate_lists(records: int, summaries: int) -> None:
    """Fill the tables quickly: set-based SQL on PostgreSQL (bulk_create elsewhere)."""
    from django.db import connection

    from engines.models import RequestSummary, TraceRecord

    start = time.perf_counter()
    per_trace = max(1, summaries // records)
    if connection.vendor == "postgresql":
        stats = '{"phases": [], "requests": {}}'
        with connection.cursor() as cur:
            cur.execute(f"""
                INSERT INTO engines_tracerecord (engine, model, backend, source, captured_at, engine_version,
                    first_event_ts, last_event_ts, duration_us, event_count, request_count, dropped_events,
                    payload_bytes, compressed_bytes, payload_crc32, payload, stats, note, tags, server, fleet)
                SELECT 'engine-' || mod(g, 8), 'model-' || mod(g, 3),
                    CASE WHEN mod(g, 2) = 0 THEN 'cpu' ELSE 'cuda' END,
                    (ARRAY['api','dashboard','automatic'])[1 + mod(g, 3)],
                    now() - make_interval(secs => g * 20), '', {T0}, {T0} + 1000000, 1000000, 50000,
                    {per_trace}, 0, 5000000, 20, 0, decode(repeat('00', 20), 'hex'), %s::jsonb,
                    'run ' || g || ' batch ' || mod(g, 97), '', 'host-' || mod(g, 3) || ':8000', 'bench'
                FROM generate_series(1, %s) AS g""", [stats, records])
            cur.execute(f"""
                INSERT INTO engines_requestsummary (trace_id, engine, server, fleet, request_id, added_ts,
                    prompt_tokens, completion_tokens, queue_us, ttft_us, prefill_us, decode_us, e2e_us, finish_reason,
                    preemptions)
                SELECT t.id, t.engine, t.server, t.fleet, 'chatcmpl-' || t.id || '-' || s, {T0}, 100 + s, 200,
                    (hashtext(t.id::text || s) & 1023), 1000 + (hashtext(s::text || t.id) & 65535),
                    500, 20000, 30000 + (hashtext(t.id::text || 'e' || s) & 262143),
                    CASE WHEN s % 10 = 0 THEN 'stop' ELSE 'length' END, 0
                FROM (SELECT id, engine, server, fleet FROM engines_tracerecord WHERE engine <> 'bench-save') t,
                     generate_series(1, {per_trace}) AS s""")
            cur.execute("ANALYZE engines_tracerecord")
            cur.execute("ANALYZE engines_requestsummary")
    else:
        from django.utils import timezone

        now = timezone.now()
        TraceRecord.objects.bulk_create(
            [TraceRecord(engine=f"engine-{g % 8}", model=f"model-{g % 3}", backend="cpu", captured_at=now,
                         request_count=per_trace, payload=b"\0" * 20, note=f"run {g}", server=f"host-{g % 3}:8000",
                         fleet="bench") for g in range(records)],
            batch_size=5000)
        ids = list(TraceRecord.objects.filter(engine__startswith="engine-").values_list("id", "engine", "server"))
        RequestSummary.objects.bulk_create(
            [RequestSummary(trace_id=i, engine=e, server=server, fleet="bench", request_id=f"chatcmpl-{i}-{s}",
                            ttft_us=(i * 31 + s) % 65536, e2e_us=(i * 17 + s) % 262144, finish_reason="length")
             for i, e, server in ids for s in range(per_trace)], batch_size=5000)
    print(f"populated {TraceRecord.objects.count():,} trace records and "
          f"{RequestSummary.objects.count():,} request summaries in {time.perf_counter() - start:.0f} s")


def bench_pages(saved: Any, repeat: int, results: ResultsFile, records: int, summaries: int) -> None:
    from django.contrib.auth.models import User
    from django.core.signals import request_finished
    from django.db import close_old_connections, connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext
    from django.urls import reverse

    from engines.models import RequestSummary, TraceRecord

    # As Django's test runner does: keep one connection across requests, so query
    # capture works and connection setup is not part of the page time.
    request_finished.disconnect(close_old_connections)
    user = User.objects.create_superuser("bench", password="bench")
    client = Client()
    client.force_login(user)
    some_request = RequestSummary.objects.order_by("id").values_list("request_id", flat=True)[500]
    traces = reverse("admin:engines_tracerecord_changelist")
    requests = reverse("admin:engines_requestsummary_changelist")
    deep_page = max(1, min(500, TraceRecord.objects.count() // 100))
    newest = TraceRecord.objects.order_by("-id").values_list("id", flat=True)[1]
    pages = [
        ("trace list", traces, {}),
        ("trace list, engine filter", traces, {"engine": "engine-3"}),
        ("trace list, server filter", traces, {"server": "host-1:8000"}),
        ("trace list, server + engine", traces, {"server": "host-1:8000", "engine": "engine-3"}),
        (f"trace list, page {deep_page}", traces, {"p": str(deep_page)}),
        ("trace list, search request id", traces, {"q": some_request}),
        ("trace list, search note", traces, {"q": "batch 42"}),
        ("request list", requests, {}),
        ("request list, TTFT desc", requests, {"o": "-8"}),
        ("request list, e2e desc", requests, {"o": "-11"}),
        ("request list, engine + e2e desc", requests, {"engine": "engine-5", "o": "-11"}),
        ("request list, server filter", requests, {"server": "host-2:8000"}),
        ("request list, server + engine", requests, {"server": "host-2:8000", "engine": "engine-5"}),
        ("request list, finish reason", requests, {"finish_reason": "stop"}),
        ("request list, search id", requests, {"q": some_request}),
        ("trace detail (the saved trace)", reverse("admin:engines_tracerecord_change", args=[saved.pk]), {}),
        ("compare", reverse("admin:engines_tracerecord_compare"), {"a": saved.pk, "b": newest}),
        (".json.gz download (saved trace)",
         reverse("admin:engines_tracerecord_download_gzip", args=[saved.pk]), {}),
        (".json download (saved trace)",
         reverse("admin:engines_tracerecord_download_json", args=[saved.pk]), {}),
    ]
    print(f"{'page':<36} {'median ms':>10} {'queries':>8}")
    for label, url, params in pages:
        def get(label: str = label, url: str = url, params: dict = params) -> Any:
            response = client.get(url, params)
            assert response.status_code == 200, (label, response.status_code)
            if response.streaming:
                for _ in response.streaming_content:
                    pass
            return response
        with CaptureQueriesContext(connection) as queries:
            get()
        query_count = len(queries.captured_queries)  # before the next request resets the log
        ms, _ = timed(get, repeat)
        print(f"{label:<36} {ms:10.1f} {query_count:8d}")
        where = {"database": connection.vendor, "records": records, "summaries": summaries, "page": label}
        results.add("server time", ms, "ms", **where)
        results.add("queries", query_count, "queries", **where)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default="postgres://postgres@127.0.0.1:5432/trace_history_bench")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--summaries", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-lists", action="store_true", help="only the save benchmark")
    add_results_option(parser, "trace_history")
    args = parser.parse_args()
    results = ResultsFile(args.results, "trace_history")

    setup_django(args.database_url)
    from django.db import connection

    print(f"database: {connection.vendor} {connection.settings_dict['NAME']}")
    saved = bench_save(args.events, args.repeat, results)
    if not args.skip_lists:
        populate_lists(args.records, args.summaries)
        bench_pages(saved["record"], max(args.repeat, 5), results, args.records, args.summaries)


if __name__ == "__main__":
    main()
