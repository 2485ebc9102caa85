"""Trace and metrics history: saving engine traces into the database, deriving
per-request summaries and statistics, retention, and comparing two traces.

The public API (what the server, the dashboard and the admin call)::

    save_trace(trace, *, engine, model, backend="", source="api", note="", tags=(), server=None, fleet=None)
        -> TraceRecord
    await asave_trace(trace, **same)                      # off the event loop
    save_engine_trace(engine_or_name, *, note="", tags=(), clear=False, source="api") -> TraceRecord
    await asave_engine_trace(engine_or_name, **same)      # the live trace of a served engine
    save_metrics_snapshot(engine, model, metrics, *, server=None, fleet=None) -> MetricsSnapshot
    await asave_metrics_snapshot(engine, model, metrics)
    apply_retention(engine=None, *, max_records=None, max_days=None, dry_run=False) -> RetentionResult
    compare_records(a, b) -> TraceComparison

Every record names the server that wrote it and its fleet: this server (``server_identity``)
unless ``server`` names another (a foreign server's trace, saved here by a fleet job).

Modules: ``analysis`` (trace -> summaries, pure Python), ``columns`` (the request-summary
columns, declared once), ``payload`` (gzip storage with a CRC, for traces and profiles alike),
``downloads`` (reading a stored payload back, checked: the one download), ``capture`` (saving),
``digest`` (a trace's bytes checked, compressed and analysed; under ``manage.py serve`` in a
process of its own), ``profiles`` (saving profiles), ``incidents`` (the watchdog's stall incidents
kept), ``workloads`` (workloads and replay runs kept, a trace's requests made a workload, with
``trace_workload``: the request summaries in the workload format),
``retention``, ``report`` (detail and compare tables), ``metrics_charts`` (the metrics
snapshots as the admin's chart series), ``autosave`` (the periodic trace windows and metrics
snapshots of ``manage.py serve``), ``outage`` (the database going away, said once) with
``middleware`` (the pages' 503 meanwhile).
"""
from engines.history.analysis import TraceAnalysis, TraceFormatError, analyze_trace
from engines.history.capture import (
    EmptyTraceError,
    TraceUnavailableError,
    asave_engine_trace,
    asave_metrics_snapshot,
    asave_trace,
    MAX_NOTE_CHARS,
    MAX_TAGS,
    normalize_tags,
    save_engine_trace,
    save_metrics_snapshot,
    save_trace,
    traced_engine,
    validate_note,
)
from engines.history.outage import HistoryUnavailableError
from engines.history.payload import PayloadError
from engines.history.report import TraceComparison, compare_records, trace_report
from engines.history.retention import RetentionResult, apply_retention, prune_metrics_snapshots

__all__ = [
    "EmptyTraceError",
    "HistoryUnavailableError",
    "PayloadError",
    "RetentionResult",
    "TraceAnalysis",
    "TraceComparison",
    "TraceFormatError",
    "TraceUnavailableError",
    "analyze_trace",
    "apply_retention",
    "asave_engine_trace",
    "asave_metrics_snapshot",
    "asave_trace",
    "compare_records",
    "MAX_NOTE_CHARS",
    "MAX_TAGS",
    "normalize_tags",
    "prune_metrics_snapshots",
    "save_engine_trace",
    "save_metrics_snapshot",
    "save_trace",
    "trace_report",
    "traced_engine",
    "validate_note",
]
