"""Metrics snapshots: the autosave skips one equal to the last saved (timestamps aside) but keeps a
heartbeat, and the snapshot list charts one engine's snapshots by the rules of
``engines.history.metrics_charts`` (rates, idle stretches held flat, breaks where none was taken)."""
from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone as dt_timezone
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from engines.history import save_metrics_snapshot
from engines.history.autosave import (HistoryAutosave, UnchangedMetricsGate, comparable_metrics,
                                      is_timestamp_key)
from engines.history.metrics_charts import CHARTS, chart_data, snapshot_charts
from engines.models import MetricsSnapshot

SNAPSHOTS = "admin:engines_metricssnapshot_changelist"
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt_timezone.utc)


def metrics(decode: int = 0, running: int = 0, **extra: Any) -> dict[str, Any]:
    return {"decode_tokens_processed": decode, "prefill_tokens_processed": decode // 10,
            "num_running_requests": running, "num_waiting_requests": 0, "kv_cache_usage": 0.25 * running,
            "num_preemptions": 0, "ttft_s": {"p50": 0.01, "p99": 0.02, "last_60s": {"count": 0}}, **extra}


# --------------------------------------------------------------------- which samples are saved


def test_timestamp_fields_are_told_from_measurements() -> None:
    assert all(is_timestamp_key(k)
               for k in ("timestamp", "time", "now", "sampled_at", "started_ts", "last_timestamp"))
    assert not any(is_timestamp_key(k) for k in ("engine_decode_time_sum", "ttft_s", "queue_time_s",
                                                 "decode_tokens_sum", "num_finished_requests", "last_finished_request"))


def test_the_gate_skips_equal_metrics_and_keeps_a_heartbeat() -> None:
    gate = UnchangedMetricsGate(heartbeat_s=600)
    first = metrics(100, 2, sampled_at=1.0, last_finished_request={"finish_ts": 5, "ttft_s": 0.1})
    assert gate.wanted("e", first, now=0)
    gate.saved("e", first, now=0)
    # Only timestamps moved (at any depth): nothing to save.
    same = metrics(100, 2, sampled_at=9.0, last_finished_request={"finish_ts": 7, "ttft_s": 0.1})
    assert not gate.wanted("e", same, now=10)
    assert not gate.wanted("e", same, now=599.9)
    assert gate.wanted("e", same, now=600)  # the heartbeat
    # Any measurement that moved is saved at once, nested ones included.
    assert gate.wanted("e", metrics(101, 2), now=10)
    assert gate.wanted("e", metrics(100, 2, last_finished_request={"ttft_s": 0.2}), now=10)
    assert gate.wanted("other", same, now=10)  # per engine
    # Not-a-number equals itself here: an engine reporting NaN while idle is still idle.
    nan = metrics(100, 2, ratio=float("nan"))
    gate.saved("e", nan, now=20)
    assert not gate.wanted("e", metrics(100, 2, ratio=float("nan")), now=30)
    assert comparable_metrics({"a": [float("inf"), {"t_at": 1}]}) == {"a": [None, {}]}


class FakeEngine:
    """What the autosave reads of an engine: its name, checkpoint name, liveness and metrics."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.checkpoint = SimpleNamespace(name="demo")
        self.is_alive = True
        self.tracing_enabled = False
        self.value = metrics()

    async def metrics(self) -> dict[str, Any]:
        return dict(self.value, sampled_at=asyncio.get_running_loop().time())  # a timestamp that always moves


async def count(engine: str) -> int:
    return await MetricsSnapshot.objects.filter(engine=engine).acount()


async def eventually(check, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.mark.django_db(transaction=True)
async def test_an_idle_engine_adds_no_snapshot_per_interval_but_a_busy_one_does() -> None:
    idle, busy = FakeEngine("idle"), FakeEngine("busy")
    autosave = HistoryAutosave([idle, busy], metrics_interval_s=0.05)
    assert await autosave.save_metrics_snapshot(idle) is not None  # the first is always saved
    assert await autosave.save_metrics_snapshot(idle) is None
    autosave.start()
    try:
        for step in range(1, 6):
            busy.value = metrics(100 * step, 3)
            await eventually(lambda step=step: _has(busy.name, 100 * step))
        await asyncio.sleep(0.3)  # six intervals of an idle engine
    finally:
        await autosave.stop()
    assert await count("idle") == 1
    assert await count("busy") >= 5
    saved = [s.metrics async for s in MetricsSnapshot.objects.filter(engine="busy").order_by("taken_at", "id")]
    assert all(comparable_metrics(a) != comparable_metrics(b) for a, b in pairwise(saved))


async def _has(engine: str, decode: int) -> bool:
    return await MetricsSnapshot.objects.filter(engine=engine, metrics__decode_tokens_processed=decode).aexists()


@pytest.mark.django_db(transaction=True)
async def test_an_unchanged_engine_is_still_saved_every_heartbeat() -> None:
    idle = FakeEngine("idle")
    autosave = HistoryAutosave([idle], metrics_interval_s=0.05, metrics_heartbeat_s=0.25)
    autosave.start()
    try:
        await eventually(lambda: _at_least("idle", 3))
    finally:
        await autosave.stop()
    times = [s.taken_at async for s in MetricsSnapshot.objects.filter(engine="idle").order_by("taken_at")]
    gaps = [(b - a).total_seconds() for a, b in pairwise(times)]
    assert all(0.2 <= gap < 1.0 for gap in gaps), gaps  # one a heartbeat, not one an interval


async def _at_least(engine: str, n: int) -> bool:
    return await count(engine) >= n


def test_the_heartbeat_must_be_seconds() -> None:
    with pytest.raises(ValueError, match=r"metrics_heartbeat_s must be a number of seconds >= 0 \(0: save every"):
        HistoryAutosave([], metrics_heartbeat_s=-1)


# ----------------------------------------------------------------------------- chart series


def series(data: dict[str, Any], label: str) -> list[float | None]:
    return next(s["values"] for chart in data["charts"] for s in chart["series"] if s["label"] == label)


def points(spec: list[tuple[float, dict[str, Any]]]) -> list[tuple[datetime, dict[str, Any]]]:
    flat = [(T0 + timedelta(seconds=t), {"decode_tokens_processed": m["decode_tokens_processed"],
                                         "num_running_requests": m["num_running_requests"],
                                         "ttft_s__p99": m["ttft_s"]["p99"]}) for t, m in spec]
    return flat


def test_rates_are_counter_changes_over_the_seconds_between_snapshots() -> None:
    data = chart_data(points([(0, metrics(0, 1)), (10, metrics(500, 1)), (20, metrics(1500, 1))]))
    assert data["x"] == [T0.timestamp() + t for t in (0, 10, 20)]
    assert series(data, "decode tok/s") == [None, 50.0, 100.0]
    assert series(data, "running") == [1, 1, 1]
    assert series(data, "TTFT p99") == [20.0, 20.0, 20.0]  # ms
    assert series(data, "TTFT p50") == [None, None, None]  # not among the points' metrics
    assert data["interval_s"] == 10 and data["count"] == 3 and not data["truncated"]
    assert [chart["key"] for chart in data["charts"]] == [chart.key for chart in CHARTS]


def test_a_skipped_idle_stretch_is_held_flat_until_one_interval_before_the_next_snapshot() -> None:
    data = chart_data(points([(0, metrics(0, 2)), (10, metrics(100, 2)), (20, metrics(200, 0)),
                              (300, metrics(200, 0)),   # the heartbeat of an idle engine
                              (400, metrics(700, 4))]))  # busy again
    start = T0.timestamp()
    assert data["x"] == [start + t for t in (0, 10, 20, 290, 300, 390, 400)]
    assert series(data, "running") == [2, 2, 0, 0, 0, 0, 4]
    # The rate after the stretch counts over one interval, not the hundred seconds since the last row.
    assert series(data, "decode tok/s") == [None, 10.0, 10.0, 0.0, 0.0, 0.0, 50.0]


def test_lines_break_where_no_snapshot_was_taken_and_a_reset_gives_no_rate() -> None:
    data = chart_data(points([(0, metrics(0, 1)), (10, metrics(100, 1)), (20, metrics(200, 1)),
                              (20 + 3600, metrics(50, 1)),  # the server was down an hour; counters restarted
                              (3630, metrics(150, 1))]), heartbeat_s=600)
    start = T0.timestamp()
    assert data["x"] == [start + t for t in (0, 10, 20, 20 + 1800, 3620, 3630)]
    assert series(data, "running") == [1, 1, 1, None, 1, 1]
    assert series(data, "decode tok/s") == [None, 10.0, 10.0, None, None, 10.0]


def test_nothing_to_chart() -> None:
    data = chart_data([])
    assert data["x"] == [] and data["count"] == 0 and data["first"] is None
    assert all(s["values"] == [] for chart in data["charts"] for s in chart["series"])


@pytest.mark.django_db
def test_the_newest_snapshots_are_charted_reading_only_the_charted_metrics(django_assert_num_queries) -> None:
    for i in range(5):
        save_metrics_snapshot("eng", "demo", metrics(100 * i, i), taken_at=T0 + timedelta(seconds=10 * i),
                              retention=False)
    save_metrics_snapshot("eng", "demo", {"decode_tokens_processed": "lots", "ttft_s": [1]},
                          taken_at=T0 + timedelta(seconds=50), retention=False)
    save_metrics_snapshot("other", "demo", metrics(10**6, 9), taken_at=T0, retention=False)
    with django_assert_num_queries(1):
        data = snapshot_charts(MetricsSnapshot.objects.filter(engine="eng"), limit=4)
    assert data["truncated"] and data["count"] == 4
    assert data["x"] == [(T0 + timedelta(seconds=t)).timestamp() for t in (20, 30, 40, 50)]
    assert series(data, "running") == [2, 3, 4, None]  # a value that is not a number is no point
    assert series(data, "decode tok/s") == [None, 10.0, 10.0, None]
    assert series(data, "TTFT p99") == [20.0, 20.0, 20.0, None]
    assert series(data, "KV cache %") == [50.0, 75.0, 100.0, None]


# ---------------------------------------------------------------------------- the admin page


@pytest.mark.django_db
def test_the_snapshot_list_charts_the_engine_it_is_filtered_to(admin_client, django_assert_max_num_queries) -> None:
    now = timezone.now()
    for i in range(30):
        save_metrics_snapshot("eng-a", "demo", metrics(100 * i, i % 3),
                              taken_at=now - timedelta(seconds=10 * (30 - i)), retention=False)
    save_metrics_snapshot("eng-b", "demo", metrics(), retention=False)
    # Session, user, count, rows, the engine and server filters' values, the (server, engine) pairs,
    # the newest snapshot's server, the chart: however many snapshots.
    with django_assert_max_num_queries(9):
        page = admin_client.get(reverse(SNAPSHOTS), {"engine": "eng-a"})
    html = page.content.decode()
    data = page.context["snapshot_charts"]
    assert data["count"] == 30 and len(data["x"]) == 30
    embedded = html.split('<script id="snapshot-charts-data" type="application/json">')[1].split("</script>")[0]
    assert json.loads(embedded) == json.loads(json.dumps(data))
    assert "vendor/uplot-1.6.32/uPlot.iife.min.js" in html and "engines/js/history/snapshots.js" in html
    assert '<meta name="time-zone" content="UTC">' in html  # the zone the charts' times are in (format.js)
    assert html.index('id="snapshot-charts"') < html.index('id="result_list"')  # above the table
    # The dashboard's links name the engine with the plain lookup: the same charts.
    assert admin_client.get(reverse(SNAPSHOTS), {"engine__exact": "eng-a"}).context["snapshot_charts"]["count"] == 30
    # The list prints what a row holds, to the second.
    first = MetricsSnapshot.objects.filter(engine="eng-a").order_by("-taken_at").first()
    assert f"{first.taken_at:%H:%M:%S}" in html and "50.0 %" in html


@pytest.mark.django_db
def test_the_unfiltered_snapshot_list_offers_each_engines_charts(admin_client) -> None:
    save_metrics_snapshot("eng-a", "demo", metrics(), retention=False)
    save_metrics_snapshot("eng-<b>", "demo", metrics(), retention=False)
    page = admin_client.get(reverse(SNAPSHOTS))
    html = page.content.decode()
    assert "snapshot_charts" not in page.context and "uPlot.iife.min.js" not in html
    assert '<a href="?engine=eng-a">eng-a</a>' in html and "eng-&lt;b&gt;" in html and "<b>" not in html
    empty = admin_client.get(reverse(SNAPSHOTS), {"engine": "gone"})
    assert empty.context["snapshot_charts"]["count"] == 0 and "No snapshot of gone" in empty.content.decode()
