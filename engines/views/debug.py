"""MLC's ``/debug/*`` endpoints: event trace, engine metrics, reset, CUDA profiler start/stop;
and ours: ``save_event_trace`` (the event trace into the trace history),
``profile_start`` / ``profile_stop`` (the built-in profiler, on every backend, which the CUDA
profiler routes start and stop too), ``list_requests`` and ``abort_request`` (every request in
the engine now, and cancelling one by id) and ``dump_kv_cache`` (the KV cache opened). vLLM's
control routes are served here too, gated and guarded the same: ``/reset_prefix_cache``
(:func:`reset_prefix_cache`), and ``/start_profile`` and ``/stop_profile``, aliases of
``profile_start`` and ``profile_stop`` (the URLconf maps them).

They exist only with ``--enable-debug``; otherwise every route answers 404 as if
it were not mounted (the gate is checked per request so tests and ``serve`` can
configure it after URLs are loaded). Bodies are parsed as MLC does (raw UTF-8
JSON, extra keys ignored) and refused with MLC's exact texts, with the fixes
listed in the reference's "where we differ": errors are a JSON object, not a
string; unknown models are always "not served"; every route takes an empty body
(or one without ``model``) as the first engine, as MLC's ``dump_engine_metrics``
does (benchmark tools post nothing: aiperf's ``--reset-kv-cache``); reset answers
after it completed; the profiler routes accept ``model`` and answer a status.
"""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from pydantic import BaseModel, ValidationError

from engines.history import (
    EmptyTraceError,
    HistoryUnavailableError,
    TraceUnavailableError,
    asave_engine_trace,
    normalize_tags,
    traced_engine,
    validate_note,
)
from engines.history.workloads import EmptyWorkloadError, asave_engine_workload
from engines.models import TraceRecord, WorkloadRecord
from engines.profiling import ProfileSaved, start_profile, stop_profile
from engines.protocol.debug_routes import (
    PROFILE_HINT,
    AbortOptions,
    DebugRequest,
    DumpWorkloadOptions,
    KVDumpOptions,
    ListRequestsOptions,
    ProfileOptions,
    ProfileStopOptions,
    SaveTraceOptions,
)
from engines.protocol.errors import ProtocolError
from engines.registry import registry
from engines.request_abort import RequestNotLiveError, abort_live_request
from engines.runtime import AsyncEngine, ProfilerStateError
from engines.views.api import InvalidBody, debug_gated, json_body, json_response

NOT_MOUNTED = ("Not found: the /debug endpoints (and vLLM's /reset_prefix_cache, /start_profile and /stop_profile) "
               "exist only when the server runs with --enable-debug.")


Options = TypeVar("Options", bound=BaseModel)

debug_view = debug_gated(NOT_MOUNTED)


def parse_body(request: HttpRequest) -> DebugRequest:
    """Parse a debug body (empty: ``{}``); anything unusable is MLC's ``Invalid request {raw_body}``,
    with the body cut to a short prefix and the reason added."""
    raw = request.body.decode("utf-8", errors="replace")  # to repeat it in the message
    try:
        return DebugRequest.model_validate(json_body(request, empty_ok=True))
    except InvalidBody as exc:
        raise ProtocolError(400, invalid_request(raw, exc.message)) from None
    except ValidationError:
        raise ProtocolError(400, invalid_request(raw, 'send a JSON object such as {"model": "<name>"}')) from None


#: How much of a rejected body an error message repeats: enough to recognise it, never a
#: megabyte echoed back.
ECHO_CHARS = 200


def invalid_request(raw: str, reason: str) -> str:
    """MLC's ``Invalid request {raw_body}`` text, the body cut to :data:`ECHO_CHARS`, and why."""
    shown = raw if len(raw) <= ECHO_CHARS else f"{raw[:ECHO_CHARS]}... ({len(raw)} characters)"
    return f"Invalid request {shown}: {reason}"


def lookup(model: str | None) -> AsyncEngine:
    """The engine named ``model``; with no name, the first engine (MLC's process-wide routes do that)."""
    engine = registry.get(model) if model is not None else registry.first()
    if engine is None:
        raise ProtocolError(400, f'The requested model "{model}" is not served.' if model is not None
                            else "This server serves no model.")
    return engine


@debug_view
async def dump_event_trace(request: HttpRequest) -> HttpResponse:
    """The engine's event trace as Chrome Trace JSON (object form, loadable in Perfetto)."""
    engine = lookup(parse_body(request).model)
    if not engine.tracing_enabled:
        raise ProtocolError(400, f'The requested model "{engine.name}" does not enable tracing')
    # The engine exports between two steps; this event loop (and every stream) keeps moving meanwhile.
    return HttpResponse(await engine.dump_trace(), content_type="application/json")


@debug_view
async def save_event_trace(request: HttpRequest) -> HttpResponse:
    """Save the engine's event trace as a trace record; answers its id and admin page.

    The trace is the one ``dump_event_trace`` would return at that moment, stored byte for
    byte. Dumping and saving run on worker threads, so a large trace holds up neither this
    event loop nor the engine; with ``clear`` the trace is emptied in the same step that
    takes it, so no event falls between two saves.
    """
    try:
        engine = traced_engine(lookup(parse_body(request).model))
    except TraceUnavailableError as exc:
        raise ProtocolError(400, str(exc)) from None
    options = parse_save_options(request)
    try:
        record = await asave_engine_trace(engine, note=options.note, tags=options.tags, clear=options.clear,
                                          source=TraceRecord.Source.API)
    except EmptyTraceError as exc:
        raise ProtocolError(409, f"{exc}.") from None
    except HistoryUnavailableError as exc:
        raise ProtocolError(503, f"{exc}.") from None
    return json_response({
        "id": record.pk,
        "admin_url": reverse("admin:engines_tracerecord_change", args=[record.pk]),
        "events": record.event_count,
        "requests": record.request_count,
        "dropped_events": record.dropped_events,
    })


def parse_options(request: HttpRequest, schema: type[Options], hint: str) -> Options:
    """A body ``parse_body`` accepted, read again as ``schema``; a 400 naming the bad field, then ``hint``."""
    try:
        return schema.model_validate(json_body(request, empty_ok=True))
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        raise ProtocolError(400, f'Invalid "{field}": {error["msg"]}. {hint}', param=field or None) from None


def parse_save_options(request: HttpRequest) -> SaveTraceOptions:
    """The note, tags and clear flag of a body ``parse_body`` accepted; a 400 naming the bad field.

    Checked before the trace is taken, so a refused request never clears it.
    """
    options = parse_options(request, SaveTraceOptions, 'Send "note" as a string, "tags" as a list of strings '
                                                       'and "clear" as true or false.')
    for field, check in (("note", validate_note), ("tags", normalize_tags)):
        try:
            check(getattr(options, field))
        except ValueError as exc:
            raise ProtocolError(400, f"Invalid \"{field}\": {exc}.") from None
    return options


@debug_view
async def dump_engine_metrics(request: HttpRequest) -> HttpResponse:
    """``{"metrics": {...}}``: the engine's MLC metrics (``model`` optional, empty body allowed)."""
    body = parse_body(request)
    engine = lookup(body.model)
    return json_response({"metrics": await engine.metrics()})


@debug_view
async def reset_engine(request: HttpRequest) -> HttpResponse:
    """Abort everything in flight and zero the metrics; answers once the reset has completed."""
    body = parse_body(request)
    engine = lookup(body.model)
    await engine.reset(clear_trace=body.clear_trace)
    return json_response({"status": "reset", "model": engine.name, "trace_cleared": body.clear_trace})


@debug_view
async def list_requests(request: HttpRequest) -> HttpResponse:
    """Every request in the engine now, oldest first (``LiveRequest`` fields), at most ``limit``
    of ``total``; ``model`` optional (the first engine), an empty body allowed."""
    body = parse_body(request)
    engine = lookup(body.model)
    options = parse_options(request, ListRequestsOptions, 'Send "limit" as a whole number from 1 to 4096.')
    live = await engine.live_requests(options.limit, with_text=registry.options.capture_text)
    return json_response({"model": engine.name, "total": live.total, "truncated": live.truncated,
                          "requests": [dataclasses.asdict(row) for row in live.requests]})


@debug_view
async def dump_workload(request: HttpRequest) -> HttpResponse:
    """The engine's flight recorder: its last requests that ended, as a workload (docs/interfaces.md,
    "Workload"; ids, parameters, token counts and times; token ids and outputs only with ``serve
    --capture-text``); ``model`` optional (the first engine). With ``save``, it is kept in the
    history instead, and the answer is its record's id and admin page."""
    body = parse_body(request)
    engine = lookup(body.model)
    options = parse_options(request, DumpWorkloadOptions, 'Send "save" as true or false and "note" as a string.')
    with_text = registry.options.capture_text
    if not options.save:
        return json_response((await engine.dump_workload(with_text=with_text)).as_dict())
    try:
        record = await asave_engine_workload(engine, source=WorkloadRecord.Source.API, note=options.note,
                                             with_text=with_text)
    except EmptyWorkloadError as exc:
        raise ProtocolError(409, f"{exc}.") from None
    except HistoryUnavailableError as exc:
        raise ProtocolError(503, f"{exc}.") from None
    return json_response({"id": record.pk, "requests": record.request_count, "text_captured": record.text_captured,
                          "admin_url": reverse("admin:engines_workloadrecord_change", args=[record.pk])})


@debug_view
async def list_incidents(request: HttpRequest) -> HttpResponse:
    """The engine's stalls this server saw (``StallIncident`` fields, evidence included), newest
    first, the open one among them; ``model`` optional (the first engine). Read from the
    watchdog (``engines.watchdog.stall_watch``), never from the engine: it answers while the engine cannot."""
    from engines.watchdog.stall_watch import stall_watch

    body = parse_body(request)
    engine = lookup(body.model)
    incidents = stall_watch.incidents(engine.name)
    return json_response({"model": engine.name, "stalls_total": stall_watch.stalls_total(engine.name),
                          "open": any(i.open for i in incidents), "incidents": [i.as_dict() for i in incidents]})


@debug_view
async def abort_request(request: HttpRequest) -> HttpResponse:
    """End one request by id as a client's disconnect would (its stream ends with ``abort``);
    a 404 when the engine holds no such request. Kept in the history (``engines.request_abort``)."""
    body = parse_body(request)
    engine = lookup(body.model)
    options = parse_options(request, AbortOptions, 'Send "request_id" as the id the live table or '
                                                   '/debug/list_requests shows.')
    who = f"api from {request.META.get('REMOTE_ADDR') or 'unknown address'}"
    try:
        outcome = await abort_live_request(engine, options.request_id, who, "api")
    except RequestNotLiveError as exc:
        raise ProtocolError(404, f"Not found: {exc}.", param="request_id") from None
    return json_response(outcome.as_dict())


@debug_view
async def dump_kv_cache(request: HttpRequest) -> HttpResponse:
    """The KV cache opened (``KVCacheDump`` fields): pages used, cached and free, the pages each
    request holds, the most recently used prefix-cache entries and the cache's counters."""
    body = parse_body(request)
    engine = lookup(body.model)
    options = parse_options(request, KVDumpOptions, 'Send "max_entries" as a whole number from 0 to 4096.')
    dump = await engine.dump_kv_cache(options.max_entries, with_text=registry.options.capture_text)
    return json_response({"model": engine.name, **dataclasses.asdict(dump)})


@debug_view
async def reset_prefix_cache(request: HttpRequest) -> HttpResponse:
    """vLLM's ``/reset_prefix_cache``: empty the prefix cache, and nothing else (requests run on;
    pinned system prompts stay, as only ``reset_engine`` unpins them). ``model`` names one engine;
    without it, every engine: vLLM's server has one cache, and a tool that empties it before a run
    (aiperf's ``--reset-kv-cache``) means all of it."""
    body = parse_body(request)
    targets = [lookup(body.model)] if body.model is not None else list(registry)
    reset = {engine.name: await engine.reset_prefix_cache() for engine in targets}
    return json_response({"status": "reset", "engines": reset})


async def _start_builtin(request: HttpRequest, engine: AsyncEngine) -> dict[str, Any]:
    options = parse_options(request, ProfileOptions, PROFILE_HINT)
    trigger = options.profile_trigger()
    try:
        await start_profile(engine, max_steps=options.max_steps, max_seconds=options.max_seconds,
                            stack_sampling=options.stack_sampling, trigger=trigger)
    except ProfilerStateError as exc:
        raise ProtocolError(409, f"Engine {engine.name}: {exc} (POST /debug/profile_stop).") from None
    return {"status": "armed" if trigger is not None else "profiling", "model": engine.name,
            "max_steps": options.max_steps, "max_seconds": options.max_seconds,
            "stack_sampling": options.stack_sampling, "trigger": trigger.describe() if trigger is not None else None}


async def _stop_builtin(request: HttpRequest, engine: AsyncEngine) -> ProfileSaved:
    note = parse_options(request, ProfileStopOptions, 'Send "note" as a string.').note
    try:
        validate_note(note)
        return await stop_profile(engine, note=note)
    except HistoryUnavailableError as exc:  # asked first: the profile runs on, to be stopped again
        raise ProtocolError(503, f"{exc}; the profile is still running.") from None
    except ValueError as exc:  # ProfilerStateError is not one
        raise ProtocolError(400, f'Invalid "note": {exc}.') from None
    except ProfilerStateError as exc:
        raise ProtocolError(409, f"Engine {engine.name}: {exc} (POST /debug/profile_start).") from None


def _saved_reply(engine: AsyncEngine, saved: ProfileSaved, **extra: Any) -> dict[str, Any]:
    return {"status": "stopped", "model": engine.name, "profile_id": saved.id, "url": saved.url,
            "admin_url": reverse("admin:engines_profilerecord_change", args=[saved.id]), "steps": saved.steps,
            "kernel_calls": saved.kernel_calls, "kernels": saved.kernels, **extra}


@debug_view
async def profile_start(request: HttpRequest) -> HttpResponse:
    """Start the built-in profiler (every backend): each kernel launch and engine step timed until
    ``profile_stop``, ``max_steps`` steps or ``max_seconds``; a second start is a 409."""
    body = parse_body(request)
    return json_response(await _start_builtin(request, lookup(body.model)))


@debug_view
async def profile_stop(request: HttpRequest) -> HttpResponse:
    """Stop the built-in profiler and save the profile; answers its id and pages (409 with none running)."""
    body = parse_body(request)
    engine = lookup(body.model)
    return json_response(_saved_reply(engine, await _stop_builtin(request, engine)))


def _no_cuda(engine: AsyncEngine, then: str) -> ProtocolError:
    return ProtocolError(
        400,
        f'The CUDA profiler is unavailable: model "{engine.name}" runs on the {engine.backend_name} backend. '
        f"Serve it with --backend cuda on a machine with an NVIDIA GPU. {then}",
    )


@debug_view
async def cuda_profiler_start(request: HttpRequest) -> HttpResponse:
    """Begin a CUDA profiler capture range (for Nsight Systems' ``--capture-range=cudaProfilerApi``)
    in the engine's process, and the built-in profiler with it.

    The CUDA profiler API acts on a whole process, so it is applied once, in the process of the
    named engine or the first one. On a CPU backend there is nothing to capture: the answer is
    a 400 saying so, and the built-in profiler starts all the same.
    """
    body = parse_body(request)
    engine = lookup(body.model)
    started = await _start_builtin(request, engine)
    if engine.backend_name != "cuda":
        raise _no_cuda(engine, "The built-in profiler started instead: POST /debug/profile_stop saves it.")
    await engine.cuda_profiler(True)
    return json_response({**started, "status": "started", "backend": "cuda"})


@debug_view
async def cuda_profiler_stop(request: HttpRequest) -> HttpResponse:
    """End the CUDA profiler capture range and save the built-in profile that ran with it."""
    body = parse_body(request)
    engine = lookup(body.model)
    if engine.backend_name == "cuda":
        await engine.cuda_profiler(False)
        return json_response(_saved_reply(engine, await _stop_builtin(request, engine), backend="cuda"))
    try:
        saved = await _stop_builtin(request, engine)
    except ProtocolError as exc:
        if exc.status != 409:
            raise
        raise _no_cuda(engine, "No built-in profile was running either.") from None
    raise _no_cuda(engine, f"The built-in profile that ran meanwhile was saved as #{saved.id}: {saved.url}")
