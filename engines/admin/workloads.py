"""The workloads' and replay runs' admin (issue 62): saved workloads, each with a form that replays
it onto a server by URL (``engines.workloads.run_job``), the runs with their figures, and the
regression report of two runs (``engines.workloads.run_report``): a page with the distributions
drawn, as JSON, and as Markdown for a pull request."""
from __future__ import annotations

from typing import Any

import orjson
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, StreamingHttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from pydantic import ValidationError

from engines.admin.cells import note_cell, when_cell
from engines.admin.large_tables import IndexedValuesFilter
from engines.admin.payloads import PayloadRecordAdmin, RecordT
from engines.admin.servers import ServerColumn, ServerFilter
from engines.fleet.attach import AttachError
from engines.history.downloads import PAYLOAD_ERROR_STATUS, attachment, payload_response
from engines.history.payload import PayloadError
from engines.models import ForeignServer, ReplayRunRecord, WorkloadRecord
from engines.workloads.run_compare import flatten, markdown
from engines.workloads.run_job import ReplayJob, start_replay
from engines.workloads.run_report import RunNotReadyError, run_records_report

__all__ = ["ReplayRunAdmin", "WorkloadAdmin"]

#: The replay form's fields that are numbers, and the checkbox.
_NUMBERS = ("speed", "max_requests", "max_seconds")


def _seconds_text(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.0f} ms" if value < 10 else f"{value:,.1f} s"


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1000:,.1f}"


class _JsonPayloadAdmin(PayloadRecordAdmin[RecordT]):
    """A record whose payload downloads as ``<id>/download.json`` (its ``<model>_download`` URL)."""

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_download"
        download = path("<path:object_id>/download.json", self.admin_site.admin_view(self.download_view), name=name)
        return [download, *super().get_urls()]

    def download_view(self, request: HttpRequest, object_id: str) -> HttpResponse | StreamingHttpResponse:
        record = self.get_object(request, unquote(object_id))
        if record is None or not self.has_view_permission(request, record):
            raise PermissionDenied
        try:
            return payload_response(request, record, "json")
        except PayloadError as exc:
            return HttpResponse(str(exc), status=PAYLOAD_ERROR_STATUS, content_type="text/plain")


@admin.register(WorkloadRecord)
class WorkloadAdmin(ServerColumn, _JsonPayloadAdmin[WorkloadRecord]):
    """Saved workloads, newest first; one's page downloads it and replays it onto a server."""

    list_display = ("workload_label", "engine", "server_column", "captured", "request_count", "span", "text",
                    "runs", "note_start")
    list_display_links = ("workload_label",)
    list_filter = (("engine", IndexedValuesFilter), ServerFilter, "source", "captured_at")
    search_fields = ("engine", "model", "note")
    ordering = ("-captured_at", "-id")
    show_facets = admin.ShowFacets.NEVER
    fields = ("engine", "server_column", "model", "source", "captured_at", "first_arrival_at", "request_count",
              "span", "dropped", "text_captured", "trace", "payload_size", "download", "note")
    readonly_fields = tuple(f for f in fields if f != "note")

    @admin.display(description="workload", ordering="id")
    def workload_label(self, obj: WorkloadRecord) -> str:
        return f"#{obj.pk}"

    @admin.display(description="saved, source", ordering="captured_at")
    def captured(self, obj: WorkloadRecord) -> str:
        return when_cell(obj.captured_at, obj.get_source_display())

    @admin.display(description="span", ordering="span_s")
    def span(self, obj: WorkloadRecord) -> str:
        return f"{obj.span_s:,.1f} s"

    @admin.display(description="text", boolean=True, ordering="text_captured")
    def text(self, obj: WorkloadRecord) -> bool:
        return obj.text_captured

    @admin.display(description="runs")
    def runs(self, obj: WorkloadRecord) -> str:
        url = reverse("admin:engines_replayrunrecord_changelist") + "?" + urlencode({"workload__id__exact": obj.pk})
        return format_html('<a href="{}">runs</a>', url)

    @admin.display(description="note")
    def note_start(self, obj: WorkloadRecord) -> str:
        return note_cell(obj.note)

    @admin.display(description="download")
    def download(self, obj: WorkloadRecord) -> str:
        return format_html('<a href="{}">workload .json</a> (docs/interfaces.md, "Workload"; '
                           '<code>manage.py replay</code> takes it)',
                           reverse("admin:engines_workloadrecord_download", args=[obj.pk]))

    def get_urls(self) -> list[URLPattern]:
        replay = path("<path:object_id>/replay/", self.admin_site.admin_view(self.replay_view),
                      name="engines_workloadrecord_replay")
        return [replay, *super().get_urls()]

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """Django's page, with the replay form and the workload's runs."""
        record = self.get_object(request, unquote(object_id))
        context = dict(extra_context or {})
        if record is not None:
            targets = [(request.build_absolute_uri("/").rstrip("/"), "this server")]
            targets += [(s.url, f"{s.name} ({s.kind or 'unknown'})") for s in ForeignServer.objects.order_by("name")]
            context.update(
                replay_targets=targets, may_replay=request.user.has_perm("engines.add_replayrunrecord"),
                workload_runs=ReplayRunRecord.objects.filter(workload=record).defer("payload").order_by("-id")[:20])
        return super().change_view(request, object_id, form_url, context)

    def replay_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST: start a replay of this workload (the form on its page); to the run's page."""
        record = self.get_object(request, unquote(object_id))
        if record is None or request.method != "POST":
            return HttpResponseRedirect(reverse("admin:engines_workloadrecord_changelist"))
        if not request.user.has_perm("engines.add_replayrunrecord"):
            raise PermissionDenied
        form: dict[str, Any] = {key: request.POST.get(key, "").strip()
                                for key in ("target", "model", "api_key", "note")}
        if request.POST.get("prompt_form"):
            form["prompt_form"] = request.POST["prompt_form"]
        form["request_ids"] = request.POST.get("no_request_ids") != "on"
        if request.POST.get("extra_body", "").strip():
            try:
                form["extra_body"] = orjson.loads(request.POST["extra_body"])
            except orjson.JSONDecodeError as exc:
                self.message_user(request, f"The replay was not started: extra body: {exc}.", messages.ERROR)
                return HttpResponseRedirect(reverse("admin:engines_workloadrecord_change", args=[record.pk]))
        for key in _NUMBERS:
            if request.POST.get(key, "").strip():
                form[key] = request.POST[key].strip()
        form["profile"] = request.POST.get("profile") == "on"
        page = reverse("admin:engines_workloadrecord_change", args=[record.pk])
        try:
            job = ReplayJob.model_validate({**form, "workload_id": record.pk})
            run = start_replay(job, requested_by=request.user.get_username())
        except ValidationError as exc:
            error = exc.errors()[0]
            self.message_user(request, f"The replay was not started: {error['loc'][0]}: {error['msg']}.",
                              messages.ERROR)
            return HttpResponseRedirect(page)
        except AttachError as exc:
            self.message_user(request, f"The replay was not started: {exc}.", messages.ERROR)
            return HttpResponseRedirect(page)
        self.message_user(request, f"Replaying {record.request_count} requests onto {run.target}: run #{run.pk}.",
                          messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:engines_replayrunrecord_change", args=[run.pk]))


@admin.register(ReplayRunRecord)
class ReplayRunAdmin(_JsonPayloadAdmin[ReplayRunRecord]):
    """Replay runs, newest first: what each client saw; select two to compare (the regression report)."""

    list_display = ("run_label", "workload", "target", "target_kind", "state", "started", "requests", "ttft_p50",
                    "ttft_p90", "e2e_p50", "throughput")
    list_display_links = ("run_label",)
    list_filter = ("state", "target_kind", "captured_at", ("engine", IndexedValuesFilter))
    search_fields = ("target", "engine", "note")
    ordering = ("-captured_at", "-id")
    show_facets = admin.ShowFacets.NEVER
    actions = ("compare_two", "verify_payloads")
    fields = ("workload", "engine", "target", "target_kind", "speed", "state", "message", "requested_by",
              "captured_at", "duration", "requests", "ttft_p50", "ttft_p90", "e2e_p50", "throughput", "trace",
              "profile", "payload_size", "download", "note")
    readonly_fields = tuple(f for f in fields if f != "note")

    @admin.display(description="run", ordering="id")
    def run_label(self, obj: ReplayRunRecord) -> str:
        return f"#{obj.pk}"

    @admin.display(description="started", ordering="captured_at")
    def started(self, obj: ReplayRunRecord) -> str:
        return when_cell(obj.captured_at, obj.requested_by)

    @admin.display(description="requests (ok)", ordering="request_count")
    def requests(self, obj: ReplayRunRecord) -> str:
        return "—" if obj.state == ReplayRunRecord.State.RUNNING else f"{obj.request_count} ({obj.succeeded})"

    @admin.display(description="TTFT p50", ordering="ttft_p50_s")
    def ttft_p50(self, obj: ReplayRunRecord) -> str:
        return _seconds_text(obj.ttft_p50_s)

    @admin.display(description="TTFT p90", ordering="ttft_p90_s")
    def ttft_p90(self, obj: ReplayRunRecord) -> str:
        return _seconds_text(obj.ttft_p90_s)

    @admin.display(description="E2E p50", ordering="e2e_p50_s")
    def e2e_p50(self, obj: ReplayRunRecord) -> str:
        return _seconds_text(obj.e2e_p50_s)

    @admin.display(description="tokens/s", ordering="tokens_per_s")
    def throughput(self, obj: ReplayRunRecord) -> str:
        return "—" if obj.tokens_per_s is None else f"{obj.tokens_per_s:,.1f}"

    @admin.display(description="duration", ordering="duration_s")
    def duration(self, obj: ReplayRunRecord) -> str:
        return "—" if obj.duration_s is None else f"{obj.duration_s:,.1f} s"

    @admin.display(description="download")
    def download(self, obj: ReplayRunRecord) -> str:
        if obj.state != ReplayRunRecord.State.DONE:
            return "—"
        return format_html('<a href="{}">run .json</a> (<code>manage.py compare_runs</code> takes it)',
                           reverse("admin:engines_replayrunrecord_download", args=[obj.pk]))

    @admin.action(description="Compare the two selected runs", permissions=["view"])
    def compare_two(self, request: HttpRequest, queryset: QuerySet[ReplayRunRecord]) -> HttpResponse | None:
        ids = list(queryset.order_by("captured_at", "id").values_list("pk", flat=True)[:3])
        if len(ids) != 2:
            self.message_user(request, f"Select exactly two runs to compare ({len(ids)} selected).", messages.WARNING)
            return None
        return HttpResponseRedirect(f"{reverse('admin:engines_replayrunrecord_compare')}?"
                                    f"{urlencode({'a': ids[0], 'b': ids[1]})}")

    def get_urls(self) -> list[URLPattern]:
        compare = path("compare/", self.admin_site.admin_view(self.compare_view),
                       name="engines_replayrunrecord_compare")
        return [compare, *super().get_urls()]

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """Django's page, with the target's configuration and the runs it compares with."""
        record = self.get_object(request, unquote(object_id))
        context = dict(extra_context or {})
        if record is not None:
            others = ReplayRunRecord.objects.filter(state=ReplayRunRecord.State.DONE).exclude(pk=record.pk)
            if record.workload_id is not None:
                others = others.filter(workload_id=record.workload_id)
            context.update(run_config=sorted(flatten(record.target_config).items()),
                           compare_with=others.defer("payload").order_by("-id")[:20],
                           compare_url=reverse("admin:engines_replayrunrecord_compare"))
        return super().change_view(request, object_id, form_url, context)

    def compare_view(self, request: HttpRequest) -> HttpResponse:
        """The regression report of run ``b`` against run ``a``: a page, ``?format=json`` or ``?format=md``."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        ids = [request.GET.get(key, "") for key in ("a", "b")]
        runs = self.get_queryset(request).in_bulk([int(i) for i in ids if i.isdigit()])
        a, b = (runs.get(int(i)) if i.isdigit() else None for i in ids)
        if a is None or b is None or a.pk == b.pk:
            self.message_user(request, "The report needs two different runs: select two in the list and run the "
                                       "compare action.", messages.WARNING)
            return HttpResponseRedirect(reverse("admin:engines_replayrunrecord_changelist"))
        try:
            report = run_records_report(a, b)
        except (RunNotReadyError, PayloadError) as exc:
            self.message_user(request, f"No report: {exc}.", messages.WARNING)
            return HttpResponseRedirect(reverse("admin:engines_replayrunrecord_changelist"))
        form = request.GET.get("format")
        if form == "json":
            response = HttpResponse(orjson.dumps(report, option=orjson.OPT_INDENT_2), content_type="application/json")
            response["Content-Disposition"] = attachment(f"report-run{a.pk}-run{b.pk}.json")
            return response
        if form == "md":
            response = HttpResponse(markdown(report), content_type="text/markdown; charset=utf-8")
            response["Content-Disposition"] = attachment(f"report-run{a.pk}-run{b.pk}.md")
            return response
        query = urlencode({"a": a.pk, "b": b.pk})
        figures = [{**row, **{f"{key}_ms": _ms(row[key]) for key in ("a", "b", "delta", "ci_low", "ci_high")}}
                   for row in report["figures"]]
        context = {**self.admin_site.each_context(request), "opts": self.opts, "a": a, "b": b, "report": report,
                   "title": f"Run #{b.pk} against run #{a.pk}", "query": query, "figures": figures,
                   "chart_data": {"cdfs": report["cdfs"]}}
        return TemplateResponse(request, "admin/engines/replayrunrecord/compare.html", context)

