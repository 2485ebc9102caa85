"""Recorder models: saved event traces, their per-request summaries, and metrics snapshots.

A :class:`TraceRecord` row holds the metadata the admin lists and filters on, derived
statistics (so detail and compare pages never open the payload), and the Chrome trace
itself as gzip bytes: the ``.json.gz`` download is a straight copy of the column.
Rows are written by :mod:`engines.history`, never edited by hand except note and tags.
"""
from __future__ import annotations

from django.db import models
from django.utils import timezone


class TraceRecord(models.Model):
    """One saved event trace of one engine."""

    class Source(models.TextChoices):
        API = "api", "API"
        DASHBOARD = "dashboard", "Dashboard"
        AUTOMATIC = "automatic", "Automatic"

    engine = models.CharField(max_length=200, db_index=True, help_text="Engine (served model) name.")
    model = models.CharField(max_length=200, db_index=True, help_text="Model the engine served.")
    backend = models.CharField(max_length=32, blank=True, db_index=True, help_text="cuda or cpu.")
    source = models.CharField(max_length=16, choices=Source.choices, default=Source.API, db_index=True,
                              help_text="How the trace was captured.")
    captured_at = models.DateTimeField(default=timezone.now)
    engine_version = models.CharField(max_length=64, blank=True)

    first_event_ts = models.BigIntegerField(null=True, blank=True, help_text="µs since the Unix epoch.")
    last_event_ts = models.BigIntegerField(null=True, blank=True, help_text="µs since the Unix epoch.")
    duration_us = models.BigIntegerField(null=True, blank=True)
    event_count = models.PositiveIntegerField("events", default=0)
    request_count = models.PositiveIntegerField("requests", default=0)
    dropped_events = models.PositiveIntegerField("dropped events", default=0,
                                                 help_text="Events the recorder dropped past its limit.")

    payload_bytes = models.BigIntegerField(default=0, help_text="Size of the trace JSON.")
    compressed_bytes = models.BigIntegerField(default=0, help_text="Size of the stored gzip payload.")
    # CRC32 of the stored (compressed) bytes: lets the detail page tell a damaged
    # payload apart in milliseconds, without inflating hundreds of megabytes.
    payload_crc32 = models.BigIntegerField(null=True, blank=True)
    payload = models.BinaryField(help_text="The Chrome trace JSON, gzip-compressed.")

    # {"phases": [{lane, phase, count, total, mean, min, p50, p90, p99, max}],
    #  "requests": {"ttft_us": {...}, ...}}: see engines.history.analysis.
    stats = models.JSONField(default=dict, blank=True)

    note = models.TextField(blank=True)
    # Comma-separated, normalised by engines.history: a string column keeps
    # `icontains` search working on SQLite, where JSON containment is unavailable.
    tags = models.CharField(max_length=255, blank=True)

    class Meta:
        ordering = ("-captured_at", "-id")
        indexes = [
            # The admin's default order (newest first) and the date filter.
            models.Index(fields=["captured_at", "id"], name="trace_captured_idx"),
            # Retention walks one engine's records newest first.
            models.Index(fields=["engine", "captured_at", "id"], name="trace_engine_captured_idx"),
        ]
        verbose_name = "trace record"

    def __str__(self) -> str:
        return f"{self.engine} trace #{self.pk} ({self.captured_at:%Y-%m-%d %H:%M:%S})"

    @property
    def tag_list(self) -> list[str]:
        return [t for t in self.tags.split(",") if t]


class RequestSummary(models.Model):
    """One request as its lane in a saved trace shows it; times in microseconds."""

    trace = models.ForeignKey(TraceRecord, on_delete=models.CASCADE, related_name="summaries")
    # Copied from the trace so "slowest requests of engine X" needs no join.
    engine = models.CharField(max_length=200, db_index=True)
    request_id = models.CharField(max_length=255, db_index=True)
    added_ts = models.BigIntegerField(null=True, blank=True, help_text="µs since the Unix epoch.")
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    queue_us = models.BigIntegerField(null=True, blank=True)
    ttft_us = models.BigIntegerField(null=True, blank=True)
    prefill_us = models.BigIntegerField(null=True, blank=True)
    decode_us = models.BigIntegerField(null=True, blank=True)
    e2e_us = models.BigIntegerField(null=True, blank=True)
    finish_reason = models.CharField(max_length=32, blank=True, db_index=True)
    preemptions = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ("-id",)
        constraints = [
            models.UniqueConstraint(fields=["trace", "request_id"], name="summary_trace_request_uniq"),
        ]
        indexes = [
            # Sorting all history by latency; id completes the admin's deterministic order.
            models.Index(fields=["ttft_us", "id"], name="summary_ttft_idx"),
            models.Index(fields=["e2e_us", "id"], name="summary_e2e_idx"),
            models.Index(fields=["queue_us", "id"], name="summary_queue_idx"),
        ]
        verbose_name = "request summary"
        verbose_name_plural = "request summaries"

    def __str__(self) -> str:
        return f"{self.request_id} (trace #{self.trace_id})"


class MetricsSnapshot(models.Model):
    """One sample of an engine's metrics (``AsyncEngine.metrics()``), kept across restarts."""

    engine = models.CharField(max_length=200)
    model = models.CharField(max_length=200)
    taken_at = models.DateTimeField(default=timezone.now)
    metrics = models.JSONField(default=dict)

    class Meta:
        ordering = ("-taken_at", "-id")
        indexes = [
            models.Index(fields=["engine", "taken_at"], name="metrics_engine_taken_idx"),
            models.Index(fields=["taken_at"], name="metrics_taken_idx"),
        ]
        verbose_name = "metrics snapshot"

    def __str__(self) -> str:
        return f"{self.engine} metrics at {self.taken_at:%Y-%m-%d %H:%M:%S}"


class ProfileRecord(models.Model):
    """One saved profile of one engine (``engines.runtime`` 's built-in profiler).

    The row holds what the admin lists, filters and compares on (``kernels`` is the per-kernel
    table); the whole profile (steps, kernel spans as a Chrome trace, stacks, configuration) is
    gzip JSON in ``payload``, read only by its page and its download.
    """

    class Source(models.TextChoices):
        API = "api", "API"
        DASHBOARD = "dashboard", "Dashboard"

    engine = models.CharField(max_length=200, help_text="Engine (served model) name.")
    model = models.CharField(max_length=200, help_text="Model the engine served.")
    backend = models.CharField(max_length=32, blank=True, help_text="cuda or cpu.")
    device = models.CharField(max_length=200, blank=True)
    source = models.CharField(max_length=16, choices=Source.choices, default=Source.API)
    captured_at = models.DateTimeField(default=timezone.now, help_text="When the profile started.")
    duration_us = models.BigIntegerField(default=0)
    steps = models.PositiveIntegerField(default=0)
    kernel_calls = models.PositiveIntegerField(default=0)
    stopped_by = models.CharField(max_length=16, blank=True, help_text="request, max_steps or time_limit.")
    stack_samples = models.PositiveIntegerField(default=0, help_text="Python stack samples (0: not sampled).")
    kernels = models.JSONField(default=list, blank=True)
    payload_bytes = models.BigIntegerField(default=0, help_text="Size of the profile JSON.")
    compressed_bytes = models.BigIntegerField(default=0, help_text="Size of the stored gzip payload.")
    payload = models.BinaryField(help_text="The profile JSON, gzip-compressed.")
    note = models.TextField(blank=True)

    class Meta:
        ordering = ("-captured_at", "-id")
        indexes = [
            models.Index(fields=["captured_at", "id"], name="profile_captured_idx"),
            models.Index(fields=["engine", "captured_at", "id"], name="profile_engine_captured_idx"),
        ]
        verbose_name = "profile record"

    def __str__(self) -> str:
        return f"{self.engine} profile #{self.pk} ({self.captured_at:%Y-%m-%d %H:%M:%S})"
