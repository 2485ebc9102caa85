"""What the engine actions mean (reset, save or clear the trace, start or stop a profile, abort
one request, save the flight recorder as a workload): one definition for the dashboard's engine
socket (``engines.dashboard.consumers``) and the fleet's control jobs (``engines.fleet.controls``).

Below both the dashboard and the fleet, as the server's identity is (``engines.server.server_identity``):
each carries an action out the same way and neither imports the other for it.

:func:`run_action` carries one out on an engine of this server and returns what the page shows;
a refusal the user can act on is :data:`EXPECTED_FAILURES` (said as is), anything else a bug.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from django.urls import reverse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from engines.history import (MAX_NOTE_CHARS, MAX_TAGS, EmptyTraceError, HistoryUnavailableError, TraceUnavailableError,
                             asave_engine_trace)
from engines.history.workloads import EmptyWorkloadError, asave_engine_workload
from engines.profiling import start_profile, stop_profile
from engines.registry import registry
from engines.request_abort import RequestNotLiveError, abort_live_request
from engines.runtime import REQUEST_LIMITS, AsyncEngine, EngineDeadError, ProfilerStateError

__all__ = ["EXPECTED_FAILURES", "ActionRequest", "Progress", "run_action"]


class ActionRequest(BaseModel):
    """What a browser asks of an engine. ``engine`` may be left out on an engine's own socket."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["reset", "save_trace", "clear_trace", "profile_start", "profile_stop", "abort_request",
                    "save_workload"]
    id: StrictStr | StrictInt
    engine: StrictStr | None = None
    note: StrictStr = Field(default="", max_length=MAX_NOTE_CHARS)
    tags: list[StrictStr] = Field(default=[], max_length=MAX_TAGS)
    # profile_start only: stop by itself after this many steps; sample the engine's Python stacks.
    max_steps: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    stack_sampling: StrictBool = False
    # abort_request only: the request to end (an id of the live table).
    request_id: StrictStr | None = Field(default=None, min_length=1, max_length=REQUEST_LIMITS.max_request_id_chars)


#: What an action may fail with for a reason the user can act on (the engine is down, it records
#: no trace, a profile is already running, ...).
EXPECTED_FAILURES = (EngineDeadError, TraceUnavailableError, EmptyTraceError, HistoryUnavailableError,
                     ProfilerStateError, RequestNotLiveError, EmptyWorkloadError, ValueError)

Progress = Callable[[str], Awaitable[None]]


async def run_action(request: ActionRequest, engine: AsyncEngine, progress: Progress,
                     source: str = "dashboard", user: str = "") -> dict[str, Any]:
    """Carry out ``request`` on ``engine`` for ``user`` (who the history names for an abort);
    ``progress(message)`` hears of a long step."""
    match request.action:
        case "reset":
            await engine.reset()
            return {"message": f"engine {engine.name} was reset"}
        case "clear_trace":
            if not engine.tracing_enabled:
                raise ValueError(f"engine {engine.name} records no trace: serve it with --enable-tracing")
            await engine.dump_trace(clear=True, skip_empty=True)
            return {"message": "the trace was cleared"}
        case "save_trace":
            await progress("taking and saving the trace")
            record = await asave_engine_trace(engine, note=request.note, tags=request.tags, source=source)
            return {"record_id": record.pk, "event_count": record.event_count,
                    "url": reverse("admin:engines_tracerecord_change", args=[record.pk]),
                    "message": f"saved {record.event_count} events"}
        case "profile_start":
            await start_profile(engine, max_steps=request.max_steps, stack_sampling=request.stack_sampling,
                                source=source)
            steps = f" for {request.max_steps} steps" if request.max_steps else ""
            return {"profiling": True, "message": f"profiling{steps}"}
        case "profile_stop":
            await progress("stopping and saving the profile")
            saved = await stop_profile(engine, note=request.note, source=source)
            return {"profiling": False, "record_id": saved.id, "url": saved.url,
                    "message": f"profile #{saved.id} saved ({saved.steps} steps)"}
        case "abort_request":
            if request.request_id is None:
                raise ValueError("name the request: add \"request_id\" to the message")
            outcome = await abort_live_request(engine, request.request_id, user or source, source)
            return {**outcome.as_dict(), "message": f"request {request.request_id} was aborted"}
        case "save_workload":
            workload = await asave_engine_workload(engine, source=source, note=request.note,
                                                   with_text=registry.options.capture_text)
            return {"record_id": workload.pk, "requests": workload.request_count,
                    "url": reverse("admin:engines_workloadrecord_change", args=[workload.pk]),
                    "message": f"saved a workload of {workload.request_count} requests"}
    raise AssertionError(request.action)  # ActionRequest admits no other action
