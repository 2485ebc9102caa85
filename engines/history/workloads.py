"""Workloads and replay runs kept in the history (``models.WorkloadRecord``, ``models.ReplayRunRecord``).

A workload is saved from an engine's flight recorder (``POST /debug/dump_workload`` with ``save``,
the dashboard's "Save workload", a fleet job) or converted from a saved trace's request summaries
(``engines.history.trace_workload``); a run is written by the replay job (``engines.workloads.run_job``)
when it starts (state ``running``) and again when it ends. Both store their JSON as every payload
record does: gzip with a CRC (``history.payload``), read back checked (``history.downloads``).
"""
from __future__ import annotations

import datetime as dt
import gzip
from typing import TYPE_CHECKING, Any

import orjson

from engines.server.db_calls import in_db_thread
from engines.history.capture import acheck_database, validate_note
from engines.history.downloads import read_payload
from engines.history.payload import compress_json
from engines.models import ReplayRunRecord, RequestSummary, TraceRecord, WorkloadRecord
from engines.server.server_identity import fleet_name, server_id
from engines.history.trace_workload import workload_from_summaries

if TYPE_CHECKING:
    from engines.runtime import AsyncEngine

__all__ = ["EmptyWorkloadError", "asave_engine_workload", "read_json_payload", "save_workload", "workload_from_trace"]

#: The request-summary columns a trace's workload is made of.
_SUMMARY_FIELDS = ("request_id", "added_ts", "prompt_tokens", "completion_tokens", "finish_reason", "queue_us",
                   "ttft_us", "e2e_us")


class EmptyWorkloadError(ValueError):
    """There is no request to make a workload of; the message says why and what to do."""


def save_workload(workload: dict[str, Any], *, engine: str, model: str = "", source: str = WorkloadRecord.Source.API,
                  note: str = "", trace: TraceRecord | None = None, server: str | None = None,
                  fleet: str | None = None) -> WorkloadRecord:
    """Store ``workload`` (the flight recorder's format) as a record of ``engine`` on ``server``
    (default: this one). Raises :class:`EmptyWorkloadError` for a workload without requests."""
    requests = workload.get("requests") or []
    if not requests:
        raise EmptyWorkloadError(f"engine {engine} has no request that ended since its start or reset: "
                                 "nothing to save (send it requests first)")
    first = workload.get("first_arrival_unix")
    stored = compress_json(orjson.dumps(workload))
    return WorkloadRecord.objects.create(
        server=server_id() if server is None else server, fleet=fleet_name() if fleet is None else fleet,
        engine=engine, model=model, source=source, note=validate_note(note), trace=trace,
        request_count=len(requests), span_s=max(r["offset_s"] for r in requests),
        first_arrival_at=dt.datetime.fromtimestamp(first, dt.timezone.utc) if first is not None else None,
        dropped=workload.get("dropped") or 0, text_captured=bool(workload.get("text_captured")),
        **stored.record_fields())


async def asave_engine_workload(engine: "AsyncEngine", *, source: str = WorkloadRecord.Source.API, note: str = "",
                                with_text: bool = False) -> WorkloadRecord:
    """``engine``'s flight recorder saved as a workload; ``with_text`` keeps the prompts' token ids
    and the outputs (``serve --capture-text`` only)."""
    validate_note(note)
    await acheck_database()  # asked first: the dump is cheap, but an error should say "database"
    workload = (await engine.dump_workload(with_text=with_text)).as_dict()
    return await in_db_thread(save_workload)(workload, engine=engine.name, model=engine.checkpoint.name,
                                             source=source, note=note)


def workload_from_trace(trace: TraceRecord, note: str = "") -> WorkloadRecord:
    """``trace``'s request summaries saved as a workload (``engines.history.trace_workload``), naming
    the trace's server and engine."""
    rows = list(RequestSummary.objects.filter(trace=trace).order_by("added_ts", "id").values(*_SUMMARY_FIELDS))
    workload = workload_from_summaries(trace.engine, rows)
    if not workload["requests"]:
        raise EmptyWorkloadError(f"trace #{trace.pk} holds no request with an arrival time: nothing to replay")
    return save_workload(workload, engine=trace.engine, model=trace.model, source=WorkloadRecord.Source.TRACE,
                         note=note or f"from trace #{trace.pk}", trace=trace, server=trace.server, fleet=trace.fleet)


def read_json_payload(record: WorkloadRecord | ReplayRunRecord) -> Any:
    """A workload's or a run's JSON, its stored bytes checked (``PayloadError`` when damaged)."""
    return orjson.loads(gzip.decompress(read_payload(record)))
