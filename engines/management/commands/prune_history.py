"""``manage.py prune_history``: apply the trace and metrics retention limits now.

The same limits run after every save; this command is for a cron job, for a limit
just lowered, or to see (``--dry-run``) what a limit would remove.
"""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from engines.history.retention import apply_retention, prune_metrics_snapshots


class Command(BaseCommand):
    help = ("Delete trace records past the per-engine retention limits (count, bytes and age) and old "
            "metrics snapshots. Limits default to TRACE_RETENTION_MAX_RECORDS, TRACE_RETENTION_MAX_BYTES, "
            "TRACE_RETENTION_MAX_DAYS and METRICS_RETENTION_MAX_DAYS; 0 means no limit.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--engine", help="Only this engine's history (default: every engine, each on its own).")
        parser.add_argument("--max-records", type=int, default=None,
                            help=f"Records kept per engine (default {settings.TRACE_RETENTION_MAX_RECORDS}).")
        parser.add_argument("--max-bytes", type=int, default=None,
                            help=f"Stored trace bytes kept per engine (default {settings.TRACE_RETENTION_MAX_BYTES}); "
                                 "an engine's newest record is always kept.")
        parser.add_argument("--max-days", type=float, default=None,
                            help=f"Days of traces kept (default {settings.TRACE_RETENTION_MAX_DAYS}).")
        parser.add_argument("--metrics-max-days", type=float, default=None,
                            help=f"Days of metrics snapshots kept (default {settings.METRICS_RETENTION_MAX_DAYS}).")
        parser.add_argument("--dry-run", action="store_true", help="Report what would be deleted; delete nothing.")

    def handle(self, *args: Any, engine: str | None, max_records: int | None, max_bytes: int | None,
               max_days: float | None, metrics_max_days: float | None, dry_run: bool, **options: Any) -> None:
        for name, value in (("--max-records", max_records), ("--max-bytes", max_bytes), ("--max-days", max_days),
                            ("--metrics-max-days", metrics_max_days)):
            if value is not None and not value >= 0:  # NaN included
                raise CommandError(f"{name} must be >= 0 (0 means no limit), not {value}")
        result = apply_retention(engine, max_records=max_records, max_days=max_days, max_bytes=max_bytes,
                                 dry_run=dry_run)
        snapshots = prune_metrics_snapshots(engine, max_days=metrics_max_days, dry_run=dry_run)

        verb = "would delete" if dry_run else "deleted"
        for name in sorted(result.records):
            self.stdout.write(f"{name}: {verb} {result.records[name]} trace records "
                              f"({result.summaries[name]} request summaries)")
        self.stdout.write(f"{verb} {snapshots} metrics snapshots")
        summary = f"{'Dry run: ' if dry_run else ''}{verb} {result.total_records} trace records in total"
        self.stdout.write(self.style.SUCCESS(summary))
