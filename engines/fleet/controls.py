"""Controls across the fleet as tracked jobs: one action on many engines of many servers is one
:class:`~engines.models.FleetJob` with a :class:`~engines.models.FleetJobTarget` per engine, kept
in the shared database (the audit: who, what, when, and each server's answer).

How a target runs depends on where its engine is:

* on this server: here, through the action runner the dashboard's socket uses too (``engines.engine_actions``);
* on another server of ours: a :class:`ControlCommand` is pushed on that server's queue in the
  store (``fleet:<name>:control:<server>``), its :class:`ControlListener` runs it and writes
  ack, progress and the outcome into the target's row;
* on a foreign server: its HTTP control (``server_kinds``: vLLM's ``/reset_prefix_cache``, SGLang's
  ``/flush_cache``, MLC's ``/debug/*``, ...) called from here with its API key; an action it has
  no endpoint for is refused with the reason. MLC's ``dump_event_trace`` is saved as a trace
  record, which opens on our timeline.

A record a target saves names the server that ran it: one of ours saves it itself (its own
``server_id()``); a foreign server's trace, saved here, names that server (its URL's ``host:port``).

A target no server acknowledges within :data:`ANSWER_S` ends as an error that says so.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import orjson
from django.utils import timezone
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from engines.server.cancellation import check_cancelled
from engines.server.outage_log import OutageLog
from engines.fleet.server_kinds import KINDS, Action, ServerKind
from engines.fleet.board import ForeignTarget
from engines.fleet.clock import ClockOffset
from engines.fleet.store import FleetStore
from engines.server.db_calls import in_db_thread
from engines.engine_actions import EXPECTED_FAILURES, ActionRequest, run_action
from engines.server.server_identity import url_server_id

logger = logging.getLogger("engines.fleet")

__all__ = ["ANSWER_S", "ROUTER_ENGINE", "ControlCommand", "ControlListener", "JobRequest", "job_state", "submit_job"]

#: Seconds a target may wait for its server's acknowledgement.
ANSWER_S = 15.0
#: Seconds a foreign server's control call may take.
FOREIGN_TIMEOUT_S = 60.0
#: The most targets one job may name.
MAX_TARGETS = 1000
#: The engine name a ``--router disagg`` server lists for its own lane (its trace: save, clear).
ROUTER_ENGINE = "router"


class JobTarget(BaseModel):
    server: StrictStr = Field(max_length=200)
    engine: StrictStr = Field(max_length=200)


class JobRequest(BaseModel):
    """What a fleet page asks: one action on the selected engines."""

    action: Action
    targets: list[JobTarget] = Field(min_length=1, max_length=MAX_TARGETS)
    note: StrictStr = Field(default="", max_length=2000)
    max_steps: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    stack_sampling: StrictBool = False


class ControlCommand(BaseModel):
    """A target of a job, sent to the server that runs it."""

    job: int
    target: int
    action: Action
    engine: str
    note: str = ""
    max_steps: int | None = None
    stack_sampling: bool = False


# --------------------------------------------------------------------------- the job's rows


def _update(target: int, state: str, message: str = "", result: dict[str, Any] | None = None) -> None:
    from engines.models import FleetJob, FleetJobTarget

    FleetJobTarget.objects.filter(pk=target).update(state=state, message=message[:5000], result=result or {},
                                                     updated_at=timezone.now())
    job = FleetJob.objects.filter(targets__pk=target).first()
    if job is not None and job.finished_at is None and not job.targets.exclude(state__in=("done", "error")).exists():
        FleetJob.objects.filter(pk=job.pk, finished_at__isnull=True).update(finished_at=timezone.now())


async def update_target(target: int, state: str, message: str = "", result: dict[str, Any] | None = None) -> None:
    """Write a target's state (and finish its job when it was the last one running)."""
    await in_db_thread(_update)(target, state, message, result)


def _fail_unanswered(targets: Sequence[int]) -> None:
    from engines.models import FleetJobTarget

    for target in FleetJobTarget.objects.filter(pk__in=targets, state="pending"):
        _update(target.pk, "error", f"no answer from {target.server_name or target.server} in {ANSWER_S:g} s")


def job_state(pk: int) -> dict[str, Any] | None:
    """A job and its targets as the page shows them (None: no such job)."""
    from engines.models import FleetJob

    job = FleetJob.objects.filter(pk=pk).first()
    if job is None:
        return None
    return {"id": job.pk, "action": job.action, "requested_by": job.requested_by, "options": job.options,
            "created_at": job.created_at.timestamp(),
            "finished_at": job.finished_at.timestamp() if job.finished_at else None,
            "targets": [{"id": t.pk, "server": t.server, "server_name": t.server_name, "engine": t.engine,
                         "state": t.state, "message": t.message, "result": t.result} for t in job.targets.all()]}


# --------------------------------------------------------------------------- running a target


async def run_here(command: ControlCommand, here: str = "", clock: ClockOffset | None = None) -> None:
    """Run a target on an engine of this server, reporting into its row; a saved trace's result
    carries this server and its clock offset, for the fleet's merged timeline."""
    from engines.registry import registry

    engine = registry.get(command.engine)
    if engine is None and command.engine == ROUTER_ENGINE and registry.router is not None:
        await run_on_router(command, registry.router.trace, here, clock)
        return
    if engine is None:
        await update_target(command.target, "error", f"no engine {command.engine!r} on this server")
        return
    await update_target(command.target, "ack")
    request = ActionRequest(action=command.action, id=command.target, engine=command.engine, note=command.note,
                            max_steps=command.max_steps, stack_sampling=command.stack_sampling)

    async def progress(message: str) -> None:
        await update_target(command.target, "progress", message)

    try:
        result = await run_action(request, engine, progress)
    except EXPECTED_FAILURES as exc:
        await update_target(command.target, "error", str(exc))
    except Exception as exc:  # noqa: BLE001 - said in the job, logged for the operator
        logger.exception("fleet job %s: %s on %s failed", command.job, command.action, command.engine)
        await update_target(command.target, "error", f"{type(exc).__name__}: {exc}")
    else:
        if clock is not None:
            result |= {"server": here, "clock_offset_us": clock.offset_s * 1e6,
                       "clock_uncertainty_us": clock.uncertainty_s * 1e6}
        await update_target(command.target, "done", str(result.get("message", "")), result)


async def run_on_router(command: ControlCommand, trace: Any, here: str, clock: ClockOffset | None) -> None:
    """A target on the router's own lane: its trace saved (as a record, for the merged timeline)
    or cleared; it has nothing to reset or profile."""
    await update_target(command.target, "ack")
    if command.action == "clear_trace":
        await update_target(command.target, "done", f"cleared {trace.clear()} spans")
        return
    if command.action != "save_trace":
        await update_target(command.target, "error", f"the router has no {command.action}: act on its engines' servers")
        return
    if not len(trace):
        await update_target(command.target, "error", "the router routed no request since its trace was cleared")
        return
    from engines.history import asave_trace

    record = await asave_trace(trace.export(), engine=ROUTER_ENGINE, model=ROUTER_ENGINE, backend="router",
                               source="dashboard", note=command.note)
    result: dict[str, Any] = {"record_id": record.pk, "event_count": record.event_count, "server": here}
    if clock is not None:
        result |= {"clock_offset_us": clock.offset_s * 1e6, "clock_uncertainty_us": clock.uncertainty_s * 1e6}
    await update_target(command.target, "done", f"saved {record.event_count} events", result)


async def run_foreign(command: ControlCommand, server: ForeignTarget, client: httpx.AsyncClient) -> None:
    """Run a target on a foreign server through its HTTP control, if it has one."""
    kind = ServerKind.parse(server.kind)
    kind_record = KINDS[kind]
    control = kind_record.controls.get(command.action)
    if control is None:
        reason = kind_record.missing_controls.get(command.action)
        await update_target(command.target, "error", reason or f"a {kind.value} server has no {command.action}")
        return
    await update_target(command.target, "ack", f"{control.method} {control.path}")
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    body = {"model": command.engine} if kind_record.body_names_engine else None
    try:
        response = await client.request(control.method, server.url.rstrip("/") + control.path, headers=headers,
                                        json=body, timeout=FOREIGN_TIMEOUT_S, follow_redirects=False)
    except httpx.HTTPError as exc:
        await update_target(command.target, "error", f"{control.method} {control.path}: {type(exc).__name__}")
        return
    if response.status_code >= 300:
        await update_target(command.target, "error", f"{control.method} {control.path} answered "
                            f"{response.status_code}: {response.text[:300]}")
        return
    result: dict[str, Any] = {"status": response.status_code}
    message = f"{control.method} {control.path}: {response.status_code}"
    if command.action == "save_trace":  # MLC's dump_event_trace: kept as a record, opened on our timeline
        from engines.history import asave_trace

        record = await asave_trace(response.content, engine=f"{server.name}/{command.engine}",
                                   model=command.engine, source="dashboard", note=command.note,
                                   server=url_server_id(server.url))
        result |= {"record_id": record.pk, "event_count": record.event_count}
        message = f"saved {record.event_count} events from {server.name}"
    elif command.action == "save_workload":  # one of ours outside the fleet: its recorder kept here
        from engines.history.workloads import EmptyWorkloadError

        try:
            workload = await _keep_workload(response.content, command, server)
        except EmptyWorkloadError as exc:
            await update_target(command.target, "error", str(exc))
            return
        result |= {"record_id": workload.pk, "requests": workload.request_count}
        message = f"saved a workload of {workload.request_count} requests from {server.name}"
    await update_target(command.target, "done", message, result)


async def _keep_workload(body: bytes, command: ControlCommand, server: ForeignTarget) -> Any:
    from engines.history.workloads import save_workload

    return await in_db_thread(save_workload)(orjson.loads(body), engine=command.engine, source="dashboard",
                                             note=command.note, server=url_server_id(server.url), fleet="")


async def submit_job(store: FleetStore, here: str, request: JobRequest, user: str,
                     foreign: Sequence[ForeignTarget], servers: Mapping[str, tuple[str, str]],
                     client: httpx.AsyncClient, clock: ClockOffset | None = None) -> int:
    """Record the job and start each target where its engine is; the job's id. ``servers``: each
    server of ours in the fleet -> (its name, its state)."""
    names = {key: name for key, (name, _) in servers.items()} | {s.id: s.name for s in foreign}
    from engines.models import FleetJob, FleetJobTarget

    def create() -> tuple[int, list[int]]:
        job = FleetJob.objects.create(action=request.action, requested_by=user, requested_on=here,
                                      options={"note": request.note, "max_steps": request.max_steps,
                                               "stack_sampling": request.stack_sampling})
        rows = FleetJobTarget.objects.bulk_create(
            FleetJobTarget(job=job, server=t.server, engine=t.engine, server_name=names.get(t.server, t.server))
            for t in request.targets)
        return job.pk, [row.pk for row in rows]

    job, target_ids = await in_db_thread(create)()
    by_id = {server.id: server for server in foreign}
    remote: list[int] = []
    for target, pk in zip(request.targets, target_ids, strict=True):
        command = ControlCommand(job=job, target=pk, action=request.action, engine=target.engine, note=request.note,
                                 max_steps=request.max_steps, stack_sampling=request.stack_sampling)
        if target.server == here:
            _spawn(run_here(command, here, clock))
        elif target.server in by_id:
            _spawn(run_foreign(command, by_id[target.server], client))
        elif target.server.startswith("foreign-"):
            await update_target(pk, "error", f"{target.server} is not attached any more")
        elif target.server not in servers:
            await update_target(pk, "error", f"no server {target.server!r} in this fleet")
        elif servers[target.server][1] != "up":
            await update_target(pk, "error", f"{names[target.server]} is {servers[target.server][1]}")
        else:
            await store.push_control(target.server, command.model_dump_json())
            remote.append(pk)
    if remote:
        _spawn(_watch(remote))
    return job


async def _watch(targets: list[int]) -> None:
    await asyncio.sleep(ANSWER_S)
    await in_db_thread(_fail_unanswered)(targets)


_running: set[asyncio.Task[None]] = set()


def _spawn(coroutine: Any) -> None:
    """Run a target on its own task (kept referenced until it ends)."""
    task = asyncio.get_running_loop().create_task(coroutine)
    _running.add(task)
    task.add_done_callback(_running.discard)


class ControlListener:
    """Runs the commands other members send to this server, until cancelled."""

    def __init__(self, store: FleetStore, server: str,
                 clock: Callable[[], ClockOffset | None] = lambda: None) -> None:
        self.store, self.server, self.clock = store, server, clock
        self._outage = OutageLog(logger, "fleet: reading this server's control queue")

    async def run(self) -> None:
        while True:
            check_cancelled()  # a callee may have swallowed our cancel (engines.server.cancellation)
            try:
                raw = await self.store.pop_control(self.server, timeout_s=1.0)
                self._outage.worked()
            except Exception as exc:  # noqa: BLE001 - the store is down: wait and try again
                self._outage.failed(exc)
                await asyncio.sleep(1.0)
                continue
            if raw is None:
                continue
            try:
                command = ControlCommand.model_validate_json(raw)
            except ValueError:
                logger.warning("fleet: a control command this version cannot read was dropped")
                continue
            _spawn(run_here(command, self.server, self.clock()))
