"""Retention limits and ``manage.py prune_history``."""
from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from engines.history import apply_retention, save_metrics_snapshot, save_trace
from engines.models import MetricsSnapshot, RequestSummary, TraceRecord
from tests.history.conftest import newest_first
from tests.history.trace_builder import serving_trace


def _save(engine: str, days_ago: float = 0, **kwargs) -> TraceRecord:
    return save_trace(serving_trace(engine=engine, num_requests=2), engine=engine, model="demo", retention=False,
                      captured_at=timezone.now() - timedelta(days=days_ago), **kwargs)


@pytest.mark.django_db
def test_keeps_exactly_the_newest_n_per_engine():
    a = [_save("eng-a", days_ago=d) for d in (5, 4, 3, 2, 1)]
    b = [_save("eng-b", days_ago=d) for d in (9, 8)]
    result = apply_retention("eng-a", max_records=3, max_days=0)
    assert newest_first("eng-a") == [a[4].pk, a[3].pk, a[2].pk]
    assert newest_first("eng-b") == [b[1].pk, b[0].pk]  # another engine is never touched
    assert (result.records, result.summaries) == ({"eng-a": 2}, {"eng-a": 4})
    assert RequestSummary.objects.count() == 2 * (3 + 2)


@pytest.mark.django_db
def test_same_timestamp_ties_break_by_id():
    at = timezone.now()
    records = [save_trace(serving_trace(num_requests=1), engine="eng-a", model="demo", captured_at=at,
                          retention=False) for _ in range(4)]
    apply_retention("eng-a", max_records=2, max_days=0)
    assert newest_first("eng-a") == [records[3].pk, records[2].pk]


@pytest.mark.django_db
def test_age_limit_and_all_engines():
    _save("eng-a", days_ago=40)
    keep_a = _save("eng-a", days_ago=1)
    _save("eng-b", days_ago=31)
    keep_b = _save("eng-b", days_ago=29)
    result = apply_retention(max_records=0, max_days=30)
    assert set(TraceRecord.objects.values_list("pk", flat=True)) == {keep_a.pk, keep_b.pk}
    assert result.records == {"eng-a": 1, "eng-b": 1} and result.total_records == 2


@pytest.mark.django_db
def test_defaults_come_from_settings(settings):
    settings.TRACE_RETENTION_MAX_RECORDS = 1
    settings.TRACE_RETENTION_MAX_DAYS = 0
    _save("eng-a", days_ago=2)
    newest = _save("eng-a", days_ago=1)
    apply_retention("eng-a")
    assert newest_first("eng-a") == [newest.pk]


@pytest.mark.django_db
def test_dry_run_deletes_nothing():
    for d in (3, 2, 1):
        _save("eng-a", days_ago=d)
    result = apply_retention("eng-a", max_records=1, max_days=0, dry_run=True)
    assert result.dry_run and result.records == {"eng-a": 2} and result.summaries == {"eng-a": 4}
    assert TraceRecord.objects.count() == 3


@pytest.mark.django_db
def test_negative_limit_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        apply_retention("eng-a", max_records=-1)


@pytest.mark.django_db
def test_prune_history_command():
    for d in (4, 3, 2, 1):
        _save("eng-a", days_ago=d)
    _save("eng-b", days_ago=50)
    old = save_metrics_snapshot("eng-a", "demo", {"x": 1}, taken_at=timezone.now() - timedelta(days=60),
                                retention=False)
    fresh = save_metrics_snapshot("eng-a", "demo", {"x": 2}, retention=False)

    out = StringIO()
    call_command("prune_history", "--engine", "eng-a", "--max-records", "2", "--max-days", "0", "--dry-run",
                 stdout=out)
    assert "eng-a: would delete 2 trace records (4 request summaries)" in out.getvalue()
    assert "would delete 1 metrics snapshots" in out.getvalue()
    assert TraceRecord.objects.count() == 5 and MetricsSnapshot.objects.count() == 2

    out = StringIO()
    call_command("prune_history", "--engine", "eng-a", "--max-records", "2", "--max-days", "0", stdout=out)
    assert "eng-a: deleted 2 trace records" in out.getvalue()
    assert TraceRecord.objects.filter(engine="eng-a").count() == 2
    assert TraceRecord.objects.filter(engine="eng-b").count() == 1  # --engine limits the scope
    assert list(MetricsSnapshot.objects.values_list("pk", flat=True)) == [fresh.pk]
    assert old.pk not in MetricsSnapshot.objects.values_list("pk", flat=True)

    out = StringIO()
    call_command("prune_history", "--max-days", "30", "--max-records", "0", stdout=out)  # every engine
    assert "eng-b: deleted 1 trace records" in out.getvalue()
    assert not TraceRecord.objects.filter(engine="eng-b").exists()

    with pytest.raises(CommandError, match="--max-records must be >= 0"):
        call_command("prune_history", "--max-records", "-3")


@pytest.mark.django_db
@pytest.mark.parametrize("flag", ["--max-days", "--metrics-max-days"])
def test_prune_history_refuses_nan(flag):
    _save("eng-a", days_ago=1)
    save_metrics_snapshot("eng-a", "demo", {}, retention=False)
    with pytest.raises(CommandError, match=f"{flag} must be >= 0"):
        call_command("prune_history", flag, "nan")
    assert TraceRecord.objects.count() == MetricsSnapshot.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("days", ["inf", "1e6", "1e308"])
def test_an_age_limit_beyond_the_calendar_keeps_everything(days):
    """A limit reaching before year 1 (``timedelta`` and ``datetime`` overflow) means no record is that old."""
    _save("eng-a", days_ago=400)
    save_metrics_snapshot("eng-a", "demo", {}, taken_at=timezone.now() - timedelta(days=400), retention=False)
    out = StringIO()
    call_command("prune_history", "--max-days", days, "--metrics-max-days", days, stdout=out)
    assert "deleted 0 trace records in total" in out.getvalue()
    assert TraceRecord.objects.count() == MetricsSnapshot.objects.count() == 1


@pytest.mark.django_db
def test_metrics_snapshot_retention_on_save(settings):
    settings.METRICS_RETENTION_MAX_DAYS = 1
    save_metrics_snapshot("eng-a", "demo", {}, taken_at=timezone.now() - timedelta(days=2), retention=False)
    other = save_metrics_snapshot("eng-b", "demo", {}, taken_at=timezone.now() - timedelta(days=2),
                                  retention=False)
    save_metrics_snapshot("eng-a", "demo", {})
    assert MetricsSnapshot.objects.filter(engine="eng-a").count() == 1
    assert MetricsSnapshot.objects.filter(pk=other.pk).exists()  # only the saving engine is pruned


@pytest.mark.django_db
def test_byte_limit_keeps_the_newest_records_that_fit_per_engine():
    a = [_save("eng-a", days_ago=d) for d in (5, 4, 3, 2, 1)]
    other = _save("eng-b", days_ago=9)
    sizes = {r.pk: r.compressed_bytes for r in a}
    assert all(sizes.values())
    budget = sizes[a[4].pk] + sizes[a[3].pk] + sizes[a[2].pk]  # exactly the newest three
    result = apply_retention("eng-a", max_records=0, max_days=0, max_bytes=budget)
    assert newest_first("eng-a") == [a[4].pk, a[3].pk, a[2].pk]
    assert result.records == {"eng-a": 2}
    apply_retention("eng-a", max_records=0, max_days=0, max_bytes=budget - 1)
    assert newest_first("eng-a") == [a[4].pk, a[3].pk]
    assert newest_first("eng-b") == [other.pk]


@pytest.mark.django_db
def test_byte_limit_never_removes_an_engines_newest_record():
    old, newest = _save("eng-a", days_ago=2), _save("eng-a", days_ago=1)
    apply_retention("eng-a", max_records=0, max_days=0, max_bytes=1)
    assert newest_first("eng-a") == [newest.pk]
    assert not TraceRecord.objects.filter(pk=old.pk).exists()


@pytest.mark.django_db
def test_byte_limit_is_applied_on_every_save(settings):
    settings.TRACE_RETENTION_MAX_RECORDS = 0
    settings.TRACE_RETENTION_MAX_DAYS = 0
    first = _save("eng-a", days_ago=1)
    settings.TRACE_RETENTION_MAX_BYTES = first.compressed_bytes + 1
    second = save_trace(serving_trace(engine="eng-a", num_requests=2), engine="eng-a", model="demo")
    assert newest_first("eng-a") == [second.pk]


@pytest.mark.django_db
def test_prune_history_takes_a_byte_limit():
    _save("eng-a", days_ago=2)
    newest = _save("eng-a", days_ago=1)
    out = StringIO()
    call_command("prune_history", "--max-records", "0", "--max-days", "0", "--max-bytes", "1", stdout=out)
    assert newest_first("eng-a") == [newest.pk]
    with pytest.raises(CommandError, match="--max-bytes must be >= 0"):
        call_command("prune_history", "--max-bytes", "-1")
