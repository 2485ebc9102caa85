"""The fleet's pages (``/dashboard/fleet/``): every server of the fleet and every engine of
theirs in one grid, live from any member; attaching and detaching a foreign server by URL; jobs
across the fleet and the timeline of the traces a job saved. The socket is ``fleet_socket``, the
JSON for scripts ``/fleet.json`` (``engines.views.fleet``); the parts are ``engines.fleet``."""
from __future__ import annotations

from django.contrib.admin.views.decorators import staff_member_required
import orjson
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.csrf import csrf_protect
from django.views.decorators.http import require_POST

from engines.dashboard.frame import data_error, page_context
from pydantic import ValidationError

from engines.dashboard.consumers import validation_message
from engines.server.server_identity import server_id
from engines.fleet.attach import AttachError, attach_server
from engines.fleet.controls import JobRequest, job_state, submit_job
from engines.fleet.merged_trace import TracePart, merge_traces
from engines.fleet.service import fleet_service
from engines.history.downloads import gzip_json_response, read_payload
from engines.history.payload import PayloadError, compress_json, decompress_json
from engines.views.api import InvalidBody, json_body
from engines.server.db_calls import in_db_thread

__all__ = ["fleet_attach", "fleet_detach", "fleet_job", "fleet_job_submit", "fleet_job_timeline", "fleet_job_trace",
           "fleet_page"]


@staff_member_required
def fleet_page(request: HttpRequest) -> HttpResponse:
    """``/dashboard/fleet/``: the grid; the socket fills it."""
    return render(request, "dashboard/fleet.html", page_context(request, "Fleet"))


@csrf_protect
@require_POST
@staff_member_required
async def fleet_attach(request: HttpRequest) -> HttpResponse:
    """Attach a server: a JSON body ``{"url", "name"?, "api_key"?, "interval"?}``; 201 with what
    was found, or 400 with why not. The API key is stored and never sent back."""
    try:
        body = json_body(request)
        interval = body.get("interval", 2.0)
        if not isinstance(interval, (int, float)) or isinstance(interval, bool):
            raise AttachError("interval: a number of seconds, 1 to 5")
        fields = {key: body.get(key, "") for key in ("url", "name", "api_key")}
        if not all(isinstance(value, str) for value in fields.values()):
            raise AttachError("url, name and api_key are strings")
        user = await request.auser()
        done = await attach_server(fields["url"], fields["name"], fields["api_key"], float(interval),
                                   attached_by=user.get_username())
    except (InvalidBody, AttachError) as exc:
        return data_error(str(exc), 400)
    await fleet_service().refresh_targets()
    return JsonResponse({"id": done.id, "name": done.name, "url": done.url, "kind": done.kind,
                         "version": done.version, "metrics_error": done.metrics_error}, status=201)


@csrf_protect
@require_POST
@staff_member_required
async def fleet_detach(request: HttpRequest, pk: int) -> HttpResponse:
    """Stop watching an attached server."""
    from engines.models import ForeignServer

    deleted, _ = await ForeignServer.objects.filter(pk=pk).adelete()
    if not deleted:
        return data_error(f"no attached server #{pk}", 404)
    await fleet_service().refresh_targets()
    return JsonResponse({"detached": pk})


@csrf_protect
@require_POST
@staff_member_required
async def fleet_job_submit(request: HttpRequest) -> HttpResponse:
    """One action on the selected engines of the fleet (:class:`~engines.fleet.controls.JobRequest`):
    201 with the job's id, whose progress ``fleet/jobs/<id>.json`` gives."""
    try:
        job = JobRequest.model_validate(json_body(request))
    except InvalidBody as exc:
        return data_error(str(exc), 400)
    except ValidationError as exc:
        return data_error(validation_message(exc), 400)
    service = fleet_service()
    service.start()
    try:
        members = await service.store.members()
    except Exception as exc:  # noqa: BLE001 - the store (Redis) is down
        return data_error(f"the fleet's store does not answer: {exc}", 503)
    servers = {m.card.server: (m.card.server, m.state) for m in members} | {server_id(): (server_id(), "up")}
    user = await request.auser()
    pk = await submit_job(service.store, server_id(), job, user.get_username(), service.targets, servers,
                          service.polling.client, service.publisher.clock.best)
    return JsonResponse({"job": pk, "url": f"/dashboard/fleet/jobs/{pk}.json"}, status=201)


@staff_member_required
async def fleet_job(request: HttpRequest, pk: int) -> HttpResponse:
    """A job and each target's state: ``pending``, ``ack``, ``progress``, ``done`` or ``error``."""
    state = await in_db_thread(job_state)(pk)
    if state is None:
        return data_error(f"no fleet job #{pk}", 404)
    return JsonResponse(state)


def _job_parts(pk: int) -> tuple[list[TracePart], list[str]] | None:
    """The traces a fleet job saved, as merge parts with their servers' clock offsets, and what
    could not be read (a record deleted since, a damaged payload); None: no such job."""
    from engines.models import FleetJob, TraceRecord

    job = FleetJob.objects.filter(pk=pk).first()
    if job is None:
        return None
    parts, problems = [], []
    for target in job.targets.all():
        record_id = target.result.get("record_id") if target.state == "done" else None
        if not isinstance(record_id, int):
            continue
        record = TraceRecord.objects.defer("payload", "stats").filter(pk=record_id).first()
        if record is None:
            problems.append(f"trace #{record_id} of {target.engine} on {target.server_name} is gone")
            continue
        try:
            trace = orjson.loads(decompress_json(read_payload(record)))
        except PayloadError as exc:
            problems.append(f"trace #{record_id}: {exc}")
            continue
        parts.append(TracePart(server=target.server_name or target.server, engine=target.engine, trace=trace,
                               offset_us=float(target.result.get("clock_offset_us") or 0.0),
                               uncertainty_us=target.result.get("clock_uncertainty_us")))
    return parts, problems


@staff_member_required
def fleet_job_trace(request: HttpRequest, pk: int) -> HttpResponse:
    """``fleet/jobs/<id>/trace.json``: the traces a "save trace" job took on every server, merged
    onto one clock (``engines.fleet.merged_trace``): opens in Perfetto as well as on our timeline."""
    found = _job_parts(pk)
    if found is None:
        return data_error(f"no fleet job #{pk}", 404)
    parts, problems = found
    if not parts:
        return data_error("this job saved no trace" + (f" ({'; '.join(problems)})" if problems else ""), 404)
    merged = merge_traces(parts)
    merged["metadata"]["problems"] = problems
    return gzip_json_response(compress_json(orjson.dumps(merged)).data)


@staff_member_required
def fleet_job_timeline(request: HttpRequest, pk: int) -> HttpResponse:
    """``fleet/jobs/<id>/timeline/``: that merged trace in the timeline viewer, a lane group per server."""
    found = _job_parts(pk)
    if found is None:
        raise Http404(f"There is no fleet job #{pk}.")
    parts, _ = found
    events = sum(len(part.trace if isinstance(part.trace, list) else part.trace.get("traceEvents", []))
                 for part in parts)
    source = {"mode": "saved", "kind": "fleet", "record": pk, "engine": f"{len(parts)} servers",
              "data_url": reverse("dashboard-fleet-job-trace", args=[pk]), "requests_url": None,
              "download_json": None, "download_gzip": reverse("dashboard-fleet-job-trace", args=[pk]),
              "record_url": reverse("admin:engines_fleetjob_change", args=[pk]), "events": events,
              "job": pk}
    return render(request, "dashboard/timeline.html",
                  page_context(request, f"Timeline of fleet job #{pk} ({len(parts)} traces)", source=source))
