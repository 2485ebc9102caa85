"""Saving traces and metrics snapshots into the history.

``save_trace`` stores a Chrome trace given as a dict or bytes. It is synchronous and
takes about a second for a million events: async callers use :func:`asave_trace`,
which runs it on a worker thread so neither the event loop nor the engine thread
waits on it. ``asave_engine_trace`` (and its sync twin ``save_engine_trace``) takes the
trace of a live engine, optionally emptying it, and saves that: it is what
``POST /debug/save_event_trace`` and the ``--trace-autosave`` loop call.

The steps, and why in this order: the trace is digested (:mod:`engines.history.digest`:
serialised once with orjson, gzip on a worker thread overlapping the walk over the events for
summaries and statistics; in a server, in a process of its own); then one transaction inserts
the record and bulk-inserts its request summaries; then retention for that engine runs.

Every record names the server that wrote it and its fleet (``engines.server.server_identity``: this
server, unless the caller names the one the trace came from), and a trace's summaries name its.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, ParamSpec, TypeVar, overload

from django.db import connections, transaction
from django.db.models import CharField, Model
from django.utils import timezone

from engines.server.db_calls import in_db_thread
from engines.history.analysis import RequestStats
from engines.history.digest import DigestProcess, digest_trace
from engines.history.outage import HistoryUnavailableError, database_reason
from engines.history.retention import apply_retention, prune_metrics_snapshots
from engines.server.malloc_tuning import trim_malloc
from engines.models import MetricsSnapshot, RequestSummary, TraceRecord
from engines.protocol.limits import MAX_NOTE_CHARS, MAX_TAGS
from engines.registry import registry
from engines.server.server_identity import fleet_name, server_id

if TYPE_CHECKING:  # the runtime (numba and all) loads only where engines are built
    from engines.runtime import AsyncEngine

SUMMARY_BATCH_SIZE = 2000
#: Where trace bytes are digested: here, or in a process of the server's (start_digest_process).
_digest_process: DigestProcess | None = None


def start_digest_process() -> None:
    """Digest saved trace bytes in a process of their own from now on (``manage.py serve``:
    engines.history.digest says why); started at once."""
    global _digest_process
    if _digest_process is None:
        _digest_process = DigestProcess()
        _digest_process.warm()


def stop_digest_process() -> None:
    """Digest in this process again; the digest process ends."""
    global _digest_process
    if _digest_process is not None:
        _digest_process.close()
        _digest_process = None


def _max_chars(model: type[Model], name: str) -> int:
    """The length limit of ``model``'s text column ``name`` (a ``CharField``: it has one)."""
    field = model._meta.get_field(name)
    assert isinstance(field, CharField) and field.max_length is not None, (model, name)
    return field.max_length


_MAX_ENGINE = _max_chars(TraceRecord, "engine")
_MAX_MODEL = _max_chars(TraceRecord, "model")
_MAX_BACKEND = _max_chars(TraceRecord, "backend")
_MAX_TAGS = _max_chars(TraceRecord, "tags")
_MAX_SERVER = _max_chars(TraceRecord, "server")
_MAX_FLEET = _max_chars(TraceRecord, "fleet")
_MAX_REQUEST_ID = _max_chars(RequestSummary, "request_id")
_MAX_FINISH_REASON = _max_chars(RequestSummary, "finish_reason")


def save_trace(
    trace: Mapping[str, Any] | list[Any] | bytes,
    *,
    engine: str,
    model: str,
    backend: str = "",
    source: str = TraceRecord.Source.API,
    note: str = "",
    tags: Iterable[str] | str = (),
    captured_at: datetime | None = None,
    retention: bool = True,
    server: str | None = None,
    fleet: str | None = None,
) -> TraceRecord:
    """Store ``trace`` (a Chrome trace dict, or its JSON bytes) as a new record of ``engine``.

    Bytes are stored exactly as given (after checking they parse), so a download
    returns them byte for byte: from a live engine pass ``tracer.dump_json()``, which
    is also the cheaper path end to end (one serialisation instead of two). ``backend`` defaults to the trace's
    ``otherData.backend``. With ``retention`` the engine's retention limits
    (``TRACE_RETENTION_MAX_RECORDS`` / ``_MAX_DAYS``) are applied afterwards. ``server`` and
    ``fleet`` name where the trace was recorded (:func:`server_fields`: this server by default).

    Raises :class:`TraceFormatError` (a ``ValueError``) for something that is not a
    Chrome trace and ``ValueError`` for bad metadata; the message says which.
    """
    engine = _required_text("engine", engine, _MAX_ENGINE)
    model = _required_text("model", model, _MAX_MODEL)
    _check_source(source)
    note = validate_note(note)
    tag_text = normalize_tags(tags)
    where = server_fields(server, fleet)

    if isinstance(trace, (bytes, bytearray, memoryview)) and _digest_process is not None:
        analysis, stored = _digest_process.digest(bytes(trace))
    else:
        analysis, stored = digest_trace(trace)
    other = analysis.other_data
    backend = (backend or str(other.get("backend") or ""))[:_MAX_BACKEND]

    record = TraceRecord(
        engine=engine,
        model=model,
        backend=backend,
        source=source,
        captured_at=captured_at or timezone.now(),
        engine_version=str(other.get("version") or "")[:64],
        first_event_ts=_int_or_none(analysis.first_ts),
        last_event_ts=_int_or_none(analysis.last_ts),
        duration_us=_int_or_none(analysis.duration_us),
        event_count=analysis.event_count,
        request_count=len(analysis.requests),
        dropped_events=analysis.dropped_events,
        **stored.record_fields(),
        stats=analysis.stats_json(),
        note=note,
        tags=tag_text,
        **where,
    )
    with transaction.atomic():
        record.save(force_insert=True)
        RequestSummary.objects.bulk_create(
            _summary_rows(record, analysis.requests), batch_size=SUMMARY_BATCH_SIZE)
    if retention:
        apply_retention(engine)
    return record


async def asave_trace(
    trace: Mapping[str, Any] | list[Any] | bytes,
    *,
    engine: str,
    model: str,
    backend: str = "",
    source: str = TraceRecord.Source.API,
    note: str = "",
    tags: Iterable[str] | str = (),
    captured_at: datetime | None = None,
    retention: bool = True,
    server: str | None = None,
    fleet: str | None = None,
) -> TraceRecord:
    """:func:`save_trace` on a worker thread with its own database connection, so the
    event loop keeps serving while a large trace is parsed, compressed and inserted; the freed
    parse is handed back to the OS there too (:func:`~engines.server.malloc_tuning.trim_malloc`)."""
    save = in_db_thread(_trimming(save_trace))
    return await save(trace, engine=engine, model=model, backend=backend, source=source, note=note, tags=tags,
                      captured_at=captured_at, retention=retention, server=server, fleet=fleet)


class TraceUnavailableError(Exception):
    """The engine asked for has no trace to give: it is not served, or it records none.

    The message is MLC's text for ``dump_event_trace`` (the views answer it as a 400).
    """


async def acheck_database() -> None:
    """Raise :class:`HistoryUnavailableError` unless the history's database answers a query:
    asked before a trace or a profile is taken from an engine, so none is taken to be lost."""
    await in_db_thread(_check_database)()


def _check_database() -> None:
    """Raise :class:`HistoryUnavailableError` unless the default database answers a query."""
    from django.db import DatabaseError

    try:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        connections["default"].close()  # a broken connection is not reused after the outage
        raise HistoryUnavailableError(f"the history's database does not answer ({database_reason(exc)}): "
                                      "nothing was saved or taken from the engine; try again when it is back"
                                      ) from None


class EmptyTraceError(Exception):
    """The engine recorded no event since its trace was last cleared or saved: a record of it
    would be empty (the views answer a 409)."""


def traced_engine(engine: "AsyncEngine | str") -> "AsyncEngine":
    """``engine`` itself, or the served engine of that name, provided it records a trace.

    A name is looked up in the process-wide registry, which never guesses: an unknown
    name is "not served" even when one engine is served. Raises :class:`TraceUnavailableError`.
    """
    if isinstance(engine, str):
        found = registry.get(engine)
        if found is None:
            raise TraceUnavailableError(f'The requested model "{engine}" is not served.')
        engine = found
    if not engine.tracing_enabled:
        raise TraceUnavailableError(f'The requested model "{engine.name}" does not enable tracing')
    return engine


def save_engine_trace(
    engine: "AsyncEngine | str",
    *,
    note: str = "",
    tags: Iterable[str] | str = (),
    clear: bool = False,
    source: str = TraceRecord.Source.API,
) -> TraceRecord:
    """Save the live event trace of ``engine`` (a served name, or the engine) as a new record.

    For synchronous code that runs engines in-process (scripts, notebooks); in async code
    use :func:`asave_engine_trace`. ``clear=True`` empties the engine's trace in the same
    step that takes it (``TraceRecorder.dump_json(clear=True)``), so successive saves tile
    the run: no event is lost or saved twice. Bad ``note``, ``tags`` or ``source`` are
    refused (``ValueError``) before the trace is touched, so a refused call never clears it;
    a database failure after a clearing dump loses that window (the error is raised).

    Raises :class:`TraceUnavailableError` for an engine that is not served or not tracing.
    """
    engine, metadata = _engine_trace_metadata(engine, note=note, tags=tags, source=source)
    raw = engine.dump_trace_blocking(clear)
    assert raw is not None  # None only for an empty trace with skip_empty, not asked for here
    return save_trace(raw, **metadata)


@overload
async def asave_engine_trace(
    engine: "AsyncEngine | str", *, note: str = ..., tags: Iterable[str] | str = ..., clear: bool = ...,
    source: str = ..., skip_empty: Literal[False] = ...,
) -> TraceRecord: ...
@overload
async def asave_engine_trace(
    engine: "AsyncEngine | str", *, note: str = ..., tags: Iterable[str] | str = ..., clear: bool = ...,
    source: str = ..., skip_empty: bool,
) -> TraceRecord | None: ...
async def asave_engine_trace(
    engine: "AsyncEngine | str",
    *,
    note: str = "",
    tags: Iterable[str] | str = (),
    clear: bool = False,
    source: str = TraceRecord.Source.API,
    skip_empty: bool = False,
) -> TraceRecord | None:
    """:func:`save_engine_trace` for async callers: ``POST /debug/save_event_trace``, the
    dashboard's "Save trace" and the autosave loop.

    The engine exports the trace between two steps (``AsyncEngine.dump_trace``) and the save
    runs on a worker thread (:func:`asave_trace`), so the event loop keeps serving meanwhile.
    When the engine recorded nothing, no record is made: with ``skip_empty`` None is returned
    (the autosave's quiet windows), else :class:`EmptyTraceError` says so.
    """
    engine, metadata = _engine_trace_metadata(engine, note=note, tags=tags, source=source)
    # Asked first, so that a trace is not taken (and, with ``clear``, lost) when it cannot be stored.
    await acheck_database()
    raw = await engine.dump_trace(clear, skip_empty=True)
    if raw is None:
        if skip_empty:
            return None
        raise EmptyTraceError(f"engine {engine.name} has recorded no event since its trace was last cleared or "
                              "saved: nothing to save (send it a request first)")
    return await asave_trace(raw, **metadata)


def _engine_trace_metadata(engine: "AsyncEngine | str", *, note: str, tags: Iterable[str] | str,
                           source: str) -> tuple["AsyncEngine", dict[str, Any]]:
    """The traced engine and the ``save_trace`` keywords for it, every check done up front."""
    engine = traced_engine(engine)
    _check_source(source)
    return engine, {
        "engine": engine.name,
        "model": engine.checkpoint.name,
        "backend": engine.backend_name,
        "source": source,
        "note": validate_note(note),
        "tags": normalize_tags(tags),
    }


def save_metrics_snapshot(engine: str, model: str, metrics: Mapping[str, Any], *,
                          taken_at: datetime | None = None, retention: bool = True, server: str | None = None,
                          fleet: str | None = None) -> MetricsSnapshot:
    """Store one sample of ``engine``'s metrics, taken on ``server`` (default: this one); prunes
    that engine's snapshots past ``METRICS_RETENTION_MAX_DAYS`` (an indexed delete, cheap at the
    sampling interval)."""
    if not isinstance(metrics, Mapping):
        raise ValueError(f"metrics must be a mapping, not {type(metrics).__name__}")
    snapshot = MetricsSnapshot.objects.create(
        engine=_required_text("engine", engine, _MAX_ENGINE),
        model=_required_text("model", model, _MAX_MODEL),
        taken_at=taken_at or timezone.now(),
        metrics=_finite_json(metrics),
        **server_fields(server, fleet),
    )
    if retention:
        prune_metrics_snapshots(engine)
    return snapshot


async def asave_metrics_snapshot(engine: str, model: str, metrics: Mapping[str, Any],
                                 **kwargs: Any) -> MetricsSnapshot:
    """:func:`save_metrics_snapshot` on a worker thread."""
    return await in_db_thread(save_metrics_snapshot)(
        engine, model, metrics, **kwargs)


def server_fields(server: str | None = None, fleet: str | None = None) -> dict[str, str]:
    """A record's ``server`` and ``fleet``: as given, or this server's (``server_id()``,
    ``fleet_name()``); ``ValueError`` for a value the columns cannot hold."""
    server = _required_text("server", server_id() if server is None else server, _MAX_SERVER)
    fleet = fleet_name() if fleet is None else fleet
    if not isinstance(fleet, str) or len(fleet) > _MAX_FLEET:
        raise ValueError(f"fleet must be a string of at most {_MAX_FLEET} characters")
    _check_no_nul("fleet", fleet)
    return {"server": server, "fleet": fleet}


def validate_note(note: Any) -> str:
    """``note`` itself, if a record can store it; ``ValueError`` saying why not otherwise."""
    if not isinstance(note, str):
        raise ValueError(f"note must be a string, not {type(note).__name__}")
    _check_no_nul("note", note)
    if len(note) > MAX_NOTE_CHARS:
        raise ValueError(f"note is {len(note)} characters long; at most {MAX_NOTE_CHARS} fit")
    return note


def normalize_tags(tags: Iterable[str] | str) -> str:
    """``"a, b"`` or ``["a", "b"]`` -> ``"a,b"``: stripped, de-duplicated, order kept."""
    items = tags.split(",") if isinstance(tags, str) else list(tags)
    if len(items) > MAX_TAGS:
        raise ValueError(f"{len(items)} tags given; at most {MAX_TAGS}")
    seen: dict[str, None] = {}
    for tag in items:
        tag = str(tag).strip()
        _check_no_nul("tags", tag)
        if tag:
            seen.setdefault(tag, None)
    text = ",".join(seen)
    if len(text) > _MAX_TAGS:
        raise ValueError(f"tags are {len(text)} characters joined; at most {_MAX_TAGS} fit")
    return text


def _summary_rows(record: TraceRecord, requests: list[RequestStats]) -> list[RequestSummary]:
    rows = []
    seen: set[str] = set()
    for r in requests:
        request_id = _storable(r.request_id)[:_MAX_REQUEST_ID]
        if request_id in seen:  # two lanes with one id (hand-made traces): keep the first
            continue
        seen.add(request_id)
        rows.append(RequestSummary(
            trace=record,
            engine=record.engine,
            server=record.server,
            fleet=record.fleet,
            request_id=request_id,
            added_ts=_int_or_none(r.added_ts),
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            queue_us=_int_or_none(r.queue_us),
            ttft_us=_int_or_none(r.ttft_us),
            prefill_us=_int_or_none(r.prefill_us),
            decode_us=_int_or_none(r.decode_us),
            e2e_us=_int_or_none(r.e2e_us),
            finish_reason=_storable(r.finish_reason)[:_MAX_FINISH_REASON],
            preemptions=r.preemptions,
            time_breakdown=r.time_breakdown,
            diagnosis=[_storable(sentence) for sentence in r.diagnosis],
        ))
    return rows


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _trimming(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``func``, then give the allocator's free pages back: a save frees a parse of tens of MB."""
    @functools.wraps(func)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return func(*args, **kwargs)
        finally:
            trim_malloc()
    return run


def _check_source(source: str) -> None:
    if source not in TraceRecord.Source.values:
        raise ValueError(f"source must be one of {', '.join(TraceRecord.Source.values)}, not {source!r}")


def _check_no_nul(name: str, value: str) -> None:
    # PostgreSQL text cannot hold NUL; refusing it everywhere keeps both databases alike.
    if "\x00" in value:
        raise ValueError(f"{name} must not contain NUL characters (\\u0000)")


def _storable(text: str) -> str:
    """Text from inside a trace (a request id is the client's ``user`` field) with NUL replaced:
    refusing it would make the whole trace unsavable, and an autosaved window is already cleared."""
    return text.replace("\x00", "\ufffd")


def _required_text(name: str, value: Any, max_length: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string")
    _check_no_nul(name, value)
    if len(value) > max_length:
        raise ValueError(f"{name} is {len(value)} characters long; at most {max_length} fit")
    return value


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def _finite_json(value: Any) -> Any:
    """Replace NaN and infinities by ``None``: PostgreSQL's jsonb rejects them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value

