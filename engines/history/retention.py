"""Retention: how much trace, profile and metrics history each engine keeps.

Limits are per engine, so one busy engine never pushes out another's history:
at most ``TRACE_RETENTION_MAX_RECORDS`` records, together at most
``TRACE_RETENTION_MAX_BYTES`` of stored (gzip) payload, and none older than
``TRACE_RETENTION_MAX_DAYS`` days (0 turns a limit off). The byte limit never removes an
engine's newest record: a single trace larger than the budget is kept until a newer one comes.
Profile records follow the same three limits, counted apart from the traces. Metrics
snapshots older than ``METRICS_RETENTION_MAX_DAYS`` go the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F, Q, QuerySet, Sum, Window
from django.utils import timezone

from engines.models import MetricsSnapshot, ProfileRecord, RequestSummary, TraceRecord


@dataclass
class RetentionResult:
    """What retention removed (or, on a dry run, would remove), per engine."""

    dry_run: bool
    records: dict[str, int] = field(default_factory=dict)
    summaries: dict[str, int] = field(default_factory=dict)

    @property
    def total_records(self) -> int:
        return sum(self.records.values())

    @property
    def total_summaries(self) -> int:
        return sum(self.summaries.values())


def expired_records(engine: str, *, max_records: int | None = None, max_days: float | None = None,
                    max_bytes: int | None = None, now: datetime | None = None,
                    kind: type[TraceRecord] | type[ProfileRecord] = TraceRecord) -> QuerySet:
    """The records of ``engine`` that fall outside its limits (``None``: from settings; 0: no limit);
    ``kind`` is the record model (trace records, or profile records under the same rules)."""
    max_records = settings.TRACE_RETENTION_MAX_RECORDS if max_records is None else max_records
    max_days = settings.TRACE_RETENTION_MAX_DAYS if max_days is None else max_days
    max_bytes = settings.TRACE_RETENTION_MAX_BYTES if max_bytes is None else max_bytes
    if not (max_records >= 0 and max_days >= 0 and max_bytes >= 0):  # NaN included
        raise ValueError("retention limits must be >= 0 (0 means no limit)")
    records = kind.objects.filter(engine=engine)
    expired = Q(pk__in=[])
    cutoff = _cutoff(max_days, now)
    if cutoff is not None:
        expired |= Q(captured_at__lt=cutoff)
    if max_records:
        # The newest record past the limit marks the boundary; the same (captured_at, id)
        # order as the admin's, so "the newest N" means the same rows everywhere.
        boundary = list(records.order_by("-captured_at", "-id")
                        .values_list("captured_at", "id")[max_records:max_records + 1])
        if boundary:
            at, pk = boundary[0]
            expired |= Q(captured_at__lt=at) | Q(captured_at=at, id__lte=pk)
    if max_bytes:
        # Newest first, the running total of payload bytes; the newest record past the budget
        # and everything older go, except the engine's newest record itself.
        newest_first = [F("captured_at").desc(), F("id").desc()]
        over = list(records.annotate(total=Window(Sum("compressed_bytes"), order_by=newest_first))
                    .filter(total__gt=max_bytes).order_by(*newest_first).values_list("captured_at", "id")[:2])
        newest = records.order_by(*newest_first).values_list("id", flat=True).first()
        if over and over[0][1] == newest:
            over = over[1:]
        if over:
            at, pk = over[0]
            expired |= Q(captured_at__lt=at) | Q(captured_at=at, id__lte=pk)
    return records.filter(expired)


def apply_retention(engine: str | None = None, *, max_records: int | None = None,
                    max_days: float | None = None, max_bytes: int | None = None, now: datetime | None = None,
                    dry_run: bool = False) -> RetentionResult:
    """Delete the records past the limits of ``engine`` (or of every engine, each on its own)."""
    engines = [engine] if engine is not None else list(
        TraceRecord.objects.order_by().values_list("engine", flat=True).distinct())
    result = RetentionResult(dry_run=dry_run)
    for name in engines:
        doomed = expired_records(name, max_records=max_records, max_days=max_days, max_bytes=max_bytes, now=now)
        if dry_run:
            records = doomed.count()
            summaries = RequestSummary.objects.filter(trace__in=doomed.values("pk")).count() if records else 0
        else:
            records, summaries = delete_records(doomed)
        if records:
            result.records[name] = records
            result.summaries[name] = summaries
    return result


def delete_records(records: QuerySet[TraceRecord]) -> tuple[int, int]:
    """Delete trace records with their summaries; returns (records, summaries) deleted.

    The payload is deferred: Django's delete collector loads the rows it deletes, and
    would otherwise read every payload just to discard it. Summaries go in one
    ``DELETE ... WHERE trace_id IN`` (Django's fast path: no signals on them).
    """
    _, per_model = records.defer("payload", "stats").delete()
    return (per_model.get(TraceRecord._meta.label, 0), per_model.get(RequestSummary._meta.label, 0))


def apply_profile_retention(engine: str) -> int:
    """Delete the profile records of ``engine`` past the trace limits (settings); returns how many."""
    deleted, _ = expired_records(engine, kind=ProfileRecord).defer("payload").delete()
    return deleted


def prune_metrics_snapshots(engine: str | None = None, *, max_days: float | None = None,
                            now: datetime | None = None, dry_run: bool = False) -> int:
    """Delete (or count) metrics snapshots older than the limit; returns how many."""
    max_days = settings.METRICS_RETENTION_MAX_DAYS if max_days is None else max_days
    if not max_days >= 0:  # NaN included
        raise ValueError("retention limits must be >= 0 (0 means no limit)")
    cutoff = _cutoff(max_days, now)
    if cutoff is None:
        return 0
    old = MetricsSnapshot.objects.filter(taken_at__lt=cutoff)
    if engine is not None:
        old = old.filter(engine=engine)
    if dry_run:
        return old.count()
    deleted, _ = old.delete()
    return deleted


def _cutoff(max_days: float, now: datetime | None) -> datetime | None:
    """The moment before which history is past ``max_days``; None for no age limit: 0, or a
    limit reaching before year 1 (``inf``, 1e6 days), which nothing saved can be older than."""
    if not max_days:
        return None
    try:
        return (now or timezone.now()) - timedelta(days=max_days)
    except OverflowError:
        return None
