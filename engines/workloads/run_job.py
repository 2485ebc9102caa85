"""The replay job: a saved workload sent to a server by URL, its run kept in the history.

Started from the workload's admin page (and by ``start_replay`` from code): a
:class:`~engines.models.ReplayRunRecord` is made at once in state ``running``, with its line in
the fleet's job audit (action ``replay``: who replayed what onto which server), and the replay goes
on in a thread of its own, with its own event loop (the admin's views are synchronous, and a
replay must not share the serving loop's time: its client measures), while the page links the
run, which reads "running" until it ends. The job

1. asks the target what it is (``fleet.attach.detect``: ours, vLLM, SGLang, MLC, llama.cpp) and
   what it runs: ``/version`` and ``/v1/models`` of any server, and of ours ``/stats`` (its
   backend, weights format, engine flags and commit): the report's configuration diff;
2. on one of ours with ``/debug/*`` mounted, starts its profiler for the run;
3. replays the workload (``engines.workloads.replay``);
4. on ours, stops the profile (saved by that server, into its history: linked here when the
   history is shared, as in a fleet; its kernel table is kept in the run either way) and takes
   its trace, saved here naming that server; the
   report reads the replayed requests' anatomy from it (their lanes are ``replay-<tag>-<index>``).

What could not be taken (no ``/debug/*``, tracing off) is said in the run's ``notes``; only a
replay that cannot run at all fails the run.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import orjson
from django.db import transaction
from django.urls import reverse
from django.utils import timezone
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from engines.server.db_calls import closing_connections, in_db_thread
from engines.fleet.attach import AttachError, check_url, detect
from engines.history.capture import asave_trace
from engines.history.payload import compress_json
from engines.history.workloads import read_json_payload
from engines.models import FleetJob, FleetJobTarget, ProfileRecord, ReplayRunRecord, WorkloadRecord
from engines.server.server_identity import server_id, url_server_id
from engines.workloads.replay import Run, WorkloadError, replay

__all__ = ["ReplayJob", "run_replay", "start_replay", "wait_for_run"]

logger = logging.getLogger(__name__)

#: Seconds each of the job's own calls to the target (config, profile, trace) may take.
CALL_TIMEOUT_S = 30.0
#: The replays of this process in flight, by run id.
_threads: dict[int, threading.Thread] = {}


class ReplayJob(BaseModel):
    """What a replay is asked to do (the workload page's form, validated)."""

    model_config = ConfigDict(extra="forbid")

    workload_id: int = Field(ge=1)
    target: StrictStr = Field(min_length=1, max_length=500)
    model: StrictStr = Field(default="", max_length=200)
    speed: float = Field(default=1.0, gt=0, le=1000)
    api_key: StrictStr = Field(default="", max_length=500)
    max_requests: int | None = Field(default=None, ge=1, le=100_000)
    max_seconds: float = Field(default=600.0, gt=0, le=24 * 3600)
    profile: bool = True
    prompt_form: Literal["ids", "text"] = "ids"
    #: False for a server that refuses our X-Request-Id (llama-cpp-python's takes UUIDs only).
    request_ids: bool = True
    #: A server's own settings in every body (llama-cpp-python's: {"repeat_penalty": 1.0}).
    extra_body: dict[str, Any] = Field(default_factory=dict)
    note: StrictStr = Field(default="", max_length=2000)


def start_replay(job: ReplayJob, requested_by: str = "") -> ReplayRunRecord:
    """The run's record, made now (``running``), and its line in the fleet's job audit (a
    ``FleetJob`` of action ``replay``, its one target the server replayed onto); the replay goes
    on in a thread. Raises :class:`AttachError` (a bad URL) or ``WorkloadRecord.DoesNotExist``."""
    target = check_url(job.target)
    workload = WorkloadRecord.objects.get(pk=job.workload_id)
    model = job.model or workload.engine
    with transaction.atomic():
        record = ReplayRunRecord.objects.create(
            workload=workload, engine=model, target=target, speed=job.speed, requested_by=requested_by,
            note=job.note)
        audit = FleetJob.objects.create(action="replay", requested_by=requested_by, requested_on=server_id(),
                                        options={"workload_id": workload.pk, "run_id": record.pk, "target": target,
                                                 "speed": job.speed, "max_requests": job.max_requests})
        line = FleetJobTarget.objects.create(
            job=audit, server=url_server_id(target), server_name=target, engine=model,
            state=FleetJobTarget.State.PROGRESS, message=f"replaying {workload.request_count} requests",
            result={"run_id": record.pk, "url": reverse("admin:engines_replayrunrecord_change", args=[record.pk])})
    job = job.model_copy(update={"target": target})
    thread = threading.Thread(target=_run_in_thread, args=(record.pk, job, line.pk), name=f"replay-{record.pk}",
                              daemon=True)
    _threads[record.pk] = thread
    thread.start()
    return record


@closing_connections
def _close_audit(pk: int, line: int) -> None:
    """The run's outcome into its line of the fleet's job audit."""
    run = ReplayRunRecord.objects.only("state", "message", "succeeded", "request_count").get(pk=pk)
    done = run.state == ReplayRunRecord.State.DONE
    message = f"{run.succeeded} of {run.request_count} requests succeeded" if done else run.message
    FleetJobTarget.objects.filter(pk=line).update(
        state=FleetJobTarget.State.DONE if done else FleetJobTarget.State.ERROR, message=message[:2000],
        updated_at=timezone.now())
    FleetJob.objects.filter(targets__pk=line).update(finished_at=timezone.now())


def _run_in_thread(pk: int, job: ReplayJob, line: int) -> None:
    try:
        asyncio.run(run_replay(pk, job))
        _close_audit(pk, line)
    finally:
        _threads.pop(pk, None)


def wait_for_run(pk: int, timeout: float | None = None) -> bool:
    """Wait for this process's replay of run ``pk`` to end; whether it has (tests, commands)."""
    thread = _threads.get(pk)
    if thread is not None:
        thread.join(timeout)
        return not thread.is_alive()
    return True


async def _json(client: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    try:
        response = await client.request(method, path, timeout=CALL_TIMEOUT_S, **kwargs)
    except httpx.HTTPError as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text[:300]


async def target_config(client: httpx.AsyncClient, url: str, api_key: str, model: str) -> dict[str, Any]:
    """What the target says it is and runs (for the configuration diff)."""
    config: dict[str, Any] = {"url": url}
    try:
        config["kind"], config["version"], _ = await detect(url, api_key, client)
    except AttachError as exc:
        config["kind"], config["detect_error"] = "unknown", str(exc)
    status, models = await _json(client, "GET", "/v1/models")
    if status == 200 and isinstance(models, dict):
        listed = {m.get("id"): m for m in models.get("data") or () if isinstance(m, dict)}
        entry = dict(listed.get(model) or {"id": model, "listed": sorted(str(k) for k in listed)})
        entry.pop("created", None)  # when the server started, not what it runs
        config["model"] = entry
    if config.get("kind") == "ours":
        status, stats = await _json(client, "GET", "/stats")
        if status == 200 and isinstance(stats, dict):
            config["server"] = stats.get("server") or {}
            config["engine"] = (stats.get("engines") or {}).get(model) or {}
            for key in ("num_running_requests", "num_waiting_requests", "kv_cache_usage", "prefix_cache_hit_rate",
                        "num_finished_requests", "ttft_p50_s", "ttft_p99_s", "prefill_tokens_per_s",
                        "decode_tokens_per_s", "alive", "state", "restarts"):
                config["engine"].pop(key, None)  # the moment's readings, not its configuration
    return config


async def _profile(client: httpx.AsyncClient, model: str, start: bool,
                   max_seconds: float) -> tuple[dict[str, Any] | None, str]:
    path = "/debug/profile_start" if start else "/debug/profile_stop"
    body: dict[str, Any] = {"model": model}
    if start:
        body["max_seconds"] = min(3600.0, max_seconds + 60)
    else:
        body["note"] = "a replay's run"
    status, reply = await _json(client, "POST", path, json=body)
    if status == 200 and isinstance(reply, dict):
        return reply, ""
    return None, f"profile {'start' if start else 'stop'}: {status or ''} {str(reply)[:200]}".strip()


async def _trace(client: httpx.AsyncClient, url: str, model: str, config: dict[str, Any],
                 run: int) -> tuple[int | None, str]:
    try:
        response = await client.post("/debug/dump_event_trace", json={"model": model}, timeout=CALL_TIMEOUT_S * 4)
    except httpx.HTTPError as exc:
        return None, f"trace: {type(exc).__name__}"
    if response.status_code != 200:
        return None, f"trace: {response.status_code} {response.text[:200]}"
    engine = config.get("engine") or {}
    record = await asave_trace(response.content, engine=model, model=str(engine.get("model", model)),
                               backend=str(engine.get("backend", "")),
                               note=f"replay run #{run}", server=url_server_id(url), retention=False)
    return record.pk, ""


async def run_replay(pk: int, job: ReplayJob) -> None:
    """Carry out ``job`` for the run record ``pk``, writing its outcome into it; never raises."""
    notes: list[str] = []
    try:
        workload_record = await WorkloadRecord.objects.aget(pk=job.workload_id)
        workload = await in_db_thread(read_json_payload)(workload_record)
        model = job.model or workload_record.engine
        headers = {"Authorization": f"Bearer {job.api_key}"} if job.api_key else {}
        async with httpx.AsyncClient(base_url=job.target, headers=headers) as client:
            config = await target_config(client, job.target, job.api_key, model)
            ours = config.get("kind") == "ours"
            profiling = False
            if ours and job.profile:
                reply, problem = await _profile(client, model, True, job.max_seconds)
                profiling = reply is not None
                if problem:
                    notes.append(problem)
            run: Run = await replay(workload, client, model, job.target, job.speed, job.max_requests,
                                    job.max_seconds, tag=f"r{pk}", prompt_form=job.prompt_form,
                                    request_ids=job.request_ids, extra_body=job.extra_body or None)
            profile_id = trace_id = None
            profile_kernels: list[dict[str, Any]] = []
            if profiling:
                reply, problem = await _profile(client, model, False, job.max_seconds)
                if reply is not None:
                    profile_id = reply.get("profile_id")
                    profile_kernels = reply.get("kernels") or []
                if problem:
                    notes.append(problem)
            if ours:
                trace_id, problem = await _trace(client, job.target, model, config, pk)
                if problem:
                    notes.append(problem)
        await in_db_thread(_finish)(pk, run, config, notes, profile_id, trace_id, profile_kernels)
    except (WorkloadError, ValueError, httpx.HTTPError, WorkloadRecord.DoesNotExist) as exc:
        await in_db_thread(_fail)(pk, f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a bug: said in the run and in the log, never lost in a task
        logger.exception("replay run #%s failed", pk)
        await in_db_thread(_fail)(pk, f"{type(exc).__name__}: {exc}")


def _finish(pk: int, run: Run, config: dict[str, Any], notes: list[str], profile_id: int | None,
            trace_id: int | None, profile_kernels: list[dict[str, Any]]) -> None:
    result = run.as_dict()
    result["target_config"], result["notes"], result["profile_kernels"] = config, notes, profile_kernels
    summary = result["summary"]
    stored = compress_json(orjson.dumps(result))
    profile = profile_id if profile_id and _is_its_profile(profile_id, run, config) else None
    ReplayRunRecord.objects.filter(pk=pk).update(
        state=ReplayRunRecord.State.DONE, message="; ".join(notes), target_kind=str(config.get("kind", "")),
        duration_s=run.duration_s, request_count=summary["requests"], succeeded=summary["succeeded"],
        ttft_p50_s=summary["ttft_p50_s"], ttft_p90_s=summary["ttft_p90_s"], e2e_p50_s=summary["e2e_p50_s"],
        tokens_per_s=summary["tokens_per_s"], target_config=config, trace_id=trace_id, profile_id=profile,
        **stored.record_fields())


def _is_its_profile(pk: int, run: Run, config: dict[str, Any]) -> bool:
    """Whether profile ``pk`` of this history is the one the target saved: the history is shared
    (a fleet) when a profile of that id, engine and port began within the run; another
    database's ids mean nothing here."""
    record = ProfileRecord.objects.filter(pk=pk, engine=run.model).only("server", "captured_at").first()
    if record is None:
        return False
    port = str(urlsplit(run.target).port or "")
    began = record.captured_at.timestamp()
    within = run.started_unix - 5 <= began <= run.started_unix + run.duration_s
    return record.server.rpartition(":")[2] == port and within


def _fail(pk: int, message: str) -> None:
    ReplayRunRecord.objects.filter(pk=pk).update(state=ReplayRunRecord.State.FAILED, message=message[:2000],
                                                 duration_s=None)

