"""Recorder models: saved event traces, their per-request summaries, metrics snapshots and profiles.

Traces and profiles are stored the same way (:class:`PayloadRecord`): the metadata the admin
lists and filters on, derived figures (so list, detail and compare pages never open the
payload), and the JSON itself as gzip bytes with their CRC, so that a ``.json.gz`` download is
a straight copy of the column. Rows are written by :mod:`engines.history`, never edited by
hand except notes and tags. Every history row names the server that wrote it and its fleet
(:class:`ServerRecord`): servers sharing a database keep their histories apart.
"""
from __future__ import annotations

import re
from datetime import datetime

from django.db import models
from django.utils import timezone


#: The ``server`` and ``fleet`` of a row saved before rows named their server: the columns'
#: database default, so that a server of an older version, which does not name them, writes it too.
UNRECORDED = ""
#: How a page names that server.
UNRECORDED_SERVER_TEXT = "unknown (saved before servers were recorded)"


def fleet_field() -> models.CharField:
    """The column of a row's fleet (``FLEET_NAME``): one database may hold several fleets."""
    return models.CharField(max_length=100, blank=True, default=UNRECORDED, db_default=UNRECORDED,
                            help_text="The fleet of the server that wrote it (FLEET_NAME).")


class ServerRecord(models.Model):
    """A history row that names the server that wrote it (``engines.server.server_identity``): ``host:port``
    and its fleet. The same engine name on three servers is three engines: a list filters by
    server, a chart draws one server's engine."""

    server = models.CharField(max_length=200, blank=True, default=UNRECORDED, db_default=UNRECORDED,
                              help_text="The server that wrote it: host:port (empty: saved before servers "
                                        "were recorded).")
    fleet = fleet_field()

    class Meta:
        abstract = True

    @property
    def server_text(self) -> str:
        """The server as a page names it: ``host:port (fleet NAME)``, or that it is not known."""
        if self.server == UNRECORDED:
            return UNRECORDED_SERVER_TEXT
        return f"{self.server} (fleet {self.fleet})" if self.fleet else self.server


class PayloadRecord(ServerRecord):
    """A row that stores one JSON document gzip-compressed, with what reading it back needs.

    The CRC covers the stored (compressed) bytes: whoever reads the payload (a download, the
    timeline's or a profile page's data, the admin's "verify" action) checks it in one pass over
    those bytes, without inflating hundreds of megabytes. Pages that only show the record never
    read the payload, so they never check it either. Rows saved before the checksum existed
    have none; they are checked by inflating them instead.
    """

    #: What the payload is, in file names and messages ("trace", "profile").
    payload_kind = "payload"
    # Declared by each record: the download's name carries them.
    engine: str
    captured_at: datetime

    payload_bytes = models.BigIntegerField(default=0, help_text="Size of the JSON.")
    compressed_bytes = models.BigIntegerField(default=0, help_text="Size of the stored gzip payload.")
    payload_crc32 = models.BigIntegerField(null=True, blank=True, help_text="CRC32 of the stored gzip bytes.")
    payload = models.BinaryField(help_text="The JSON, gzip-compressed.")

    class Meta:
        abstract = True

    def download_name(self) -> str:
        """The payload's file name: ``<kind>-<engine>-<id>-<captured>.json``, the engine name
        reduced to characters every file system takes."""
        engine = re.sub(r"[^A-Za-z0-9._-]+", "_", self.engine).strip("._") or "engine"
        return f"{self.payload_kind}-{engine}-{self.pk}-{self.captured_at:%Y%m%dT%H%M%S}.json"


class TraceRecord(PayloadRecord):
    """One saved event trace of one engine (its payload: the Chrome trace JSON)."""

    payload_kind = "trace"

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
            # One server's (engine's) records, newest first; the server filter's choices.
            models.Index(fields=["server", "engine", "captured_at", "id"], name="trace_server_engine_idx"),
        ]
        verbose_name = "trace record"

    def __str__(self) -> str:
        return f"{self.engine} trace #{self.pk} ({self.captured_at:%Y-%m-%d %H:%M:%S})"

    @property
    def tag_list(self) -> list[str]:
        return [t for t in self.tags.split(",") if t]


class RequestSummary(ServerRecord):
    """One request as its lane in a saved trace shows it; times in microseconds."""

    trace = models.ForeignKey(TraceRecord, on_delete=models.CASCADE, related_name="summaries")
    # Copied from the trace (as its server and fleet are) so "slowest requests of engine X" needs no join.
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
    # Where its time went (docs/metrics.md, "Anatomy of a request"): seconds by phase, and the
    # diagnosis' sentences. Null / empty for a trace of a server that did not record them.
    time_breakdown = models.JSONField(null=True, blank=True, help_text="Seconds by phase; they sum to E2E.")
    diagnosis = models.JSONField(default=list, blank=True, help_text="Why it took that long, in sentences.")

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
            # One server's (engine's) requests, newest first.
            models.Index(fields=["server", "engine", "id"], name="summary_server_engine_idx"),
        ]
        verbose_name = "request summary"
        verbose_name_plural = "request summaries"

    def __str__(self) -> str:
        return f"{self.request_id} (trace #{self.trace_id})"


class MetricsSnapshot(ServerRecord):
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
            # One server's engine charted (newest first); the (server, engine) pairs to chart.
            models.Index(fields=["server", "engine", "taken_at"], name="metrics_server_engine_idx"),
        ]
        verbose_name = "metrics snapshot"

    def __str__(self) -> str:
        return f"{self.engine} metrics at {self.taken_at:%Y-%m-%d %H:%M:%S}"


class ProfileRecord(PayloadRecord):
    """One saved profile of one engine (``engines.runtime`` 's built-in profiler).

    The row holds what the admin lists, filters and compares on (``kernels`` is the per-kernel
    table); the whole profile (steps, kernel spans as a Chrome trace, stacks, configuration) is
    the payload, read only by its page's data, its timeline, its download and the compare page.
    """

    payload_kind = "profile"

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
    note = models.TextField(blank=True)
    trigger = models.TextField(blank=True, help_text="A profile that started itself: its trigger, and what fired it.")

    class Meta:
        ordering = ("-captured_at", "-id")
        indexes = [
            models.Index(fields=["captured_at", "id"], name="profile_captured_idx"),
            models.Index(fields=["engine", "captured_at", "id"], name="profile_engine_captured_idx"),
            models.Index(fields=["server", "engine", "captured_at", "id"], name="profile_server_engine_idx"),
        ]
        verbose_name = "profile record"

    def __str__(self) -> str:
        return f"{self.engine} profile #{self.pk} ({self.captured_at:%Y-%m-%d %H:%M:%S})"


class StallIncidentRecord(ServerRecord):
    """One stall the watchdog saw (``engines.watchdog.stall_watch``): an engine up but not progressing,
    from the poll that saw it to the one that saw progress again, with the evidence taken when it
    opened (stacks, requests in flight, KV pool, metrics, trace events; ``missing`` says what
    could not be taken, and why). Kept as it happens: open rows are stalls that last, or whose
    server ended first."""

    class Reason(models.TextChoices):
        NO_PROGRESS = "no_progress", "no progress"
        LONG_STEP = "long_step", "long step"
        LOOP_LAG = "loop_lag", "event loop lag"

    engine = models.CharField(max_length=200, help_text="Engine (served model) name.")
    reason = models.CharField(max_length=16, choices=Reason.choices)
    detail = models.TextField(help_text="The rule's words: what it saw, and the limit.")
    opened_at = models.DateTimeField(default=timezone.now)
    closed_at = models.DateTimeField(null=True, blank=True, help_text="When progress resumed (empty: not seen).")
    duration_s = models.FloatField(null=True, blank=True)
    evidence = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ("-opened_at", "-id")
        indexes = [
            models.Index(fields=["opened_at", "id"], name="incident_opened_idx"),
            models.Index(fields=["server", "engine", "opened_at", "id"], name="incident_server_engine_idx"),
        ]
        verbose_name = "stall incident"

    def __str__(self) -> str:
        return f"{self.engine} stall #{self.pk} ({self.get_reason_display()})"

    @property
    def is_open(self) -> bool:
        return self.closed_at is None


class WorkloadRecord(PayloadRecord):
    """One saved workload (``engines.runtime.telemetry.flight_recorder``'s format): what an engine's
    flight recorder held when it was saved, or a saved trace's requests converted. The payload is
    the workload JSON; the row what the list shows."""

    payload_kind = "workload"

    class Source(models.TextChoices):
        API = "api", "API"
        DASHBOARD = "dashboard", "Dashboard"
        TRACE = "trace", "From a trace"

    engine = models.CharField(max_length=200, help_text="Engine (served model) name.")
    model = models.CharField(max_length=200, blank=True, help_text="Model the engine served.")
    source = models.CharField(max_length=16, choices=Source.choices, default=Source.API)
    captured_at = models.DateTimeField(default=timezone.now)
    request_count = models.PositiveIntegerField("requests", default=0)
    span_s = models.FloatField(default=0.0, help_text="Seconds from the first arrival to the last.")
    first_arrival_at = models.DateTimeField(null=True, blank=True)
    dropped = models.PositiveIntegerField(default=0, help_text="Requests that fell out of the recorder's window.")
    text_captured = models.BooleanField(default=False, help_text="Prompts and outputs kept (--capture-text).")
    trace = models.ForeignKey(TraceRecord, null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
                              help_text="The trace it was converted from.")
    note = models.TextField(blank=True)

    class Meta:
        ordering = ("-captured_at", "-id")
        indexes = [models.Index(fields=["server", "engine", "captured_at", "id"], name="workload_server_engine_idx")]
        verbose_name = "workload"

    def __str__(self) -> str:
        return f"{self.engine} workload #{self.pk} ({self.request_count} requests)"


class ReplayRunRecord(PayloadRecord):
    """One replay of a workload onto a server (``engines.workloads.replay``): the payload is the run
    (each request as its client saw it); the row its summary, the target's configuration as it
    said it was (ours: flags, model, weights, commit) and, for our servers, the trace and profile
    of the run. A run in progress is a row in state ``running``."""

    payload_kind = "run"

    class State(models.TextChoices):
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    workload = models.ForeignKey(WorkloadRecord, null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="runs")
    engine = models.CharField(max_length=200, help_text="The model named in each request.")
    target = models.CharField(max_length=500, help_text="The server's base URL.")
    target_kind = models.CharField(max_length=32, blank=True, help_text="ours, vllm, sglang, llama.cpp, ...")
    speed = models.FloatField(default=1.0)
    captured_at = models.DateTimeField(default=timezone.now, help_text="When the replay started.")
    state = models.CharField(max_length=16, choices=State.choices, default=State.RUNNING)
    message = models.TextField(blank=True)
    requested_by = models.CharField(max_length=150, blank=True)
    duration_s = models.FloatField(null=True, blank=True)
    request_count = models.PositiveIntegerField("requests", default=0)
    succeeded = models.PositiveIntegerField(default=0)
    ttft_p50_s = models.FloatField(null=True, blank=True)
    ttft_p90_s = models.FloatField(null=True, blank=True)
    e2e_p50_s = models.FloatField(null=True, blank=True)
    tokens_per_s = models.FloatField(null=True, blank=True)
    target_config = models.JSONField(default=dict, blank=True)
    trace = models.ForeignKey(TraceRecord, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    profile = models.ForeignKey(ProfileRecord, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    note = models.TextField(blank=True)

    class Meta:
        ordering = ("-captured_at", "-id")
        indexes = [models.Index(fields=["captured_at", "id"], name="run_captured_idx")]
        verbose_name = "replay run"

    def __str__(self) -> str:
        return f"run #{self.pk} of {self.engine} on {self.target}"


class ForeignServer(models.Model):
    """A server that is not one of ours (vLLM, SGLang, MLC LLM, llama.cpp), or one of ours outside
    the fleet's Redis, attached by URL: the fleet polls its ``/metrics`` (``engines.fleet``).
    Its API key stays here, on the server side: no page or JSON shows it."""

    name = models.CharField(max_length=100, unique=True, help_text="How the dashboard names it.")
    url = models.URLField(max_length=500, unique=True, help_text="Its base URL (the one /metrics is under).")
    api_key = models.CharField(max_length=500, blank=True, help_text="Sent as a bearer token; never shown.")
    kind = models.CharField(max_length=32, blank=True, help_text="As detected when attached.")
    version = models.CharField(max_length=64, blank=True)
    poll_interval_s = models.FloatField(default=2.0, help_text="Seconds between polls (1-5).")
    attached_by = models.CharField(max_length=150, blank=True)
    attached_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.kind or 'unknown'}, {self.url})"


class FleetJob(models.Model):
    """One control action on one or more engines of the fleet (``engines.fleet.controls``): who
    asked for what, when, and (in its targets) what each server answered. The audit trail."""

    action = models.CharField(max_length=32)
    requested_by = models.CharField(max_length=150)
    requested_on = models.CharField(max_length=200, help_text="The server whose page asked.")
    options = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")
        verbose_name = "fleet job"

    def __str__(self) -> str:
        return f"{self.action} by {self.requested_by} ({self.created_at:%Y-%m-%d %H:%M:%S})"


class FleetJobTarget(models.Model):
    """One engine a :class:`FleetJob` acts on, and how it went there."""

    class State(models.TextChoices):
        PENDING = "pending"
        ACK = "ack"
        PROGRESS = "progress"
        DONE = "done"
        ERROR = "error"

    job = models.ForeignKey(FleetJob, on_delete=models.CASCADE, related_name="targets")
    server = models.CharField(max_length=200, help_text="Server id, or foreign-<pk>.")
    server_name = models.CharField(max_length=200, blank=True)
    engine = models.CharField(max_length=200)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    message = models.TextField(blank=True)
    result = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ("id",)

    def __str__(self) -> str:
        return f"{self.engine} on {self.server_name or self.server}: {self.state}"


class FleetRollup(models.Model):
    """One engine of the fleet over one minute or one hour (``engines.fleet.rollups``): its mean
    load, its tokens, and its TTFT and ITL histograms in its own server's bounds, for the fleet's
    history charts and SLO views. Minutes are kept a day, hours a month (settings). ``server`` is
    named as history records name it (``host:port``: one of ours by its ``server_id()``, a foreign
    one by its URL's), ``server_name`` as the fleet page does."""

    class Period(models.TextChoices):
        MINUTE = "minute"
        HOUR = "hour"

    period = models.CharField(max_length=8, choices=Period.choices)
    start = models.DateTimeField()
    server = models.CharField(max_length=200)
    server_name = models.CharField(max_length=200, blank=True)
    fleet = fleet_field()
    engine = models.CharField(max_length=200)
    model = models.CharField(max_length=200, blank=True)
    kind = models.CharField(max_length=32, blank=True)
    samples = models.PositiveIntegerField(default=0)
    running = models.FloatField(null=True, blank=True, help_text="Mean requests running.")
    waiting = models.FloatField(null=True, blank=True, help_text="Mean requests waiting.")
    kv_usage = models.FloatField(null=True, blank=True, help_text="Mean KV-cache use (0-1).")
    prompt_tokens = models.FloatField(null=True, blank=True, help_text="Prefill tokens in the period.")
    generation_tokens = models.FloatField(null=True, blank=True, help_text="Decode tokens in the period.")
    ttft = models.JSONField(null=True, blank=True, help_text="TTFT histogram: {bounds, cumulative}.")
    itl = models.JSONField(null=True, blank=True, help_text="ITL histogram: {bounds, cumulative}.")

    class Meta:
        ordering = ("-start", "server", "engine")
        indexes = [models.Index(fields=["period", "start"], name="fleet_rollup_period_start_idx")]
        # Per fleet: two fleets sharing a database may poll one foreign server.
        constraints = [models.UniqueConstraint(fields=["period", "start", "fleet", "server", "engine"],
                                               name="fleet_rollup_one_per_engine_period")]

    def __str__(self) -> str:
        return f"{self.engine} on {self.server_name or self.server}, {self.period} of {self.start:%Y-%m-%d %H:%M}"
