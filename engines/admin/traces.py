"""The trace records' admin: the list (filter, search, compare, retention, verify, delete) and a
record's page (metadata, statistics, the request table, ``.json`` / ``.json.gz`` downloads).

The list never loads payloads and issues no query per row (``payloads``, ``large_tables``): it
stays fast with 100,000 records and 1,000,000 summaries (bench/trace_history.py).
"""
from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.core.validators import MaxLengthValidator
from django.db import models
from django.db.models import F, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, StreamingHttpResponse
from django.template.defaultfilters import filesizeformat
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode

from engines.admin.cells import capture_window_text, engine_dashboard_link, ms_text, note_cell, when_cell
from engines.admin.large_tables import EstimatedCountPaginator, IndexedValuesFilter
from engines.admin.payloads import PayloadRecordAdmin
from engines.admin.servers import ServerColumn, ServerFilter
from engines.history.capture import MAX_NOTE_CHARS, normalize_tags
from engines.history.columns import REQUEST_COLUMNS
from engines.history.downloads import PAYLOAD_ERROR_STATUS, PayloadForm, payload_response
from engines.history.payload import PayloadError
from engines.history.report import PHASE_STATS, REQUEST_STATS, compare_records, trace_report
from engines.history.retention import apply_retention
from engines.history.workloads import EmptyWorkloadError, workload_from_trace
from engines.models import RequestSummary, TraceRecord

__all__ = ["TraceRecordAdmin"]

#: Rows of a trace page's request table (the request list has them all).
REQUEST_TABLE_LIMIT = 200
#: Traces one "make a workload" action converts at most.
MAX_WORKLOADS_AT_ONCE = 20


def _record_id(value: str | None) -> int | None:
    """A trace record id from a query string, or None: ASCII digits only (``str.isdigit`` also
    accepts ``"²"``, which ``int`` refuses) and within a 64-bit column (SQLite overflows past it)."""
    if not value or not (value.isascii() and value.isdigit()):
        return None
    pk = int(value)
    return pk if pk < 2**63 else None


@admin.register(TraceRecord)
class TraceRecordAdmin(ServerColumn, PayloadRecordAdmin[TraceRecord]):
    list_display = ("trace_label", "engine_and_model", "server_column", "captured", "duration_ms", "event_count",
                    "request_count", "size", "note_and_tags", "timeline_link")
    list_display_links = ("trace_label",)
    list_filter = (("engine", IndexedValuesFilter), ServerFilter, ("model", IndexedValuesFilter),
                   ("backend", IndexedValuesFilter), "source", "captured_at")
    search_fields = ("note", "tags")
    search_help_text = "Matches words of the note or tags, or an exact request id."
    ordering = ("-captured_at", "-id")
    list_per_page = 50
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    actions = ("compare_traces", "make_workloads", "verify_payloads", "apply_retention_limits", "delete_selected")
    fieldsets = (
        (None, {"fields": ("engine", "engine_dashboard", "server_column", "model", "backend", "source", "captured_at",
                           "engine_version")}),
        ("Capture window", {"fields": ("window", "duration_ms", "event_count", "request_count",
                                        "dropped_events")}),
        ("Payload", {"fields": ("timeline", "payload_size", "payload_check", "downloads")}),
        ("Notes", {"fields": ("note", "tags")}),
    )
    readonly_fields = ("engine", "engine_dashboard", "server_column", "model", "backend", "source", "captured_at",
                       "engine_version", "window",
                       "duration_ms", "event_count", "request_count", "dropped_events", "payload_size",
                       "payload_check", "downloads", "timeline")

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
        """The list, with the retention limits in force shown above it."""
        retention = {"max_records": settings.TRACE_RETENTION_MAX_RECORDS,
                     "max_bytes": settings.TRACE_RETENTION_MAX_BYTES, "max_days": settings.TRACE_RETENTION_MAX_DAYS}
        return super().changelist_view(request, {**(extra_context or {}), "retention": retention})

    @admin.display(description="dashboard")
    def engine_dashboard(self, obj: TraceRecord) -> str:
        return engine_dashboard_link(obj, obj.engine)

    # --- list columns -------------------------------------------------------------

    @admin.display(description="trace", ordering="id")
    def trace_label(self, obj: TraceRecord) -> str:
        return f"#{obj.pk}"

    @admin.display(description="duration (ms)", ordering="duration_us")
    def duration_ms(self, obj: TraceRecord) -> str:
        return ms_text(obj.duration_us)

    @admin.display(description="size", ordering="compressed_bytes")
    def size(self, obj: TraceRecord) -> str:
        return filesizeformat(obj.compressed_bytes)

    @admin.display(description="engine", ordering="engine")
    def engine_and_model(self, obj: TraceRecord) -> str:
        if obj.model == obj.engine:
            return obj.engine
        return format_html('{}<span class="engines-quiet">{}</span>', obj.engine, obj.model)

    @admin.display(description="captured, source", ordering="captured_at")
    def captured(self, obj: TraceRecord) -> str:
        return when_cell(obj.captured_at, obj.get_source_display())

    @admin.display(description="note and tags")
    def note_and_tags(self, obj: TraceRecord) -> str:
        return note_cell(obj.note, obj.tag_list)

    @admin.display(description="timeline")
    def timeline_link(self, obj: TraceRecord) -> str:
        return format_html('<a href="{}">open</a>', reverse("dashboard-trace-timeline", args=[obj.pk]))

    # --- detail fields ------------------------------------------------------------

    @admin.display(description="window")
    def window(self, obj: TraceRecord) -> str:
        return capture_window_text(obj.first_event_ts, obj.last_event_ts)

    @admin.display(description="download")
    def downloads(self, obj: TraceRecord) -> str:
        return format_html(
            '<a href="{}">.json</a> · <a href="{}">.json.gz</a> (Chrome trace: opens in Perfetto)',
            reverse("admin:engines_tracerecord_download_json", args=[obj.pk]),
            reverse("admin:engines_tracerecord_download_gzip", args=[obj.pk]),
        )

    @admin.display(description="timeline")
    def timeline(self, obj: TraceRecord) -> str:
        return format_html('<a href="{}">Open in the timeline</a>', reverse("dashboard-trace-timeline", args=[obj.pk]))

    # --- searching and editing ------------------------------------------------------

    def get_search_results(self, request: HttpRequest, queryset: QuerySet,
                           search_term: str) -> tuple[QuerySet[TraceRecord], bool]:
        """Note/tags words (Django's search), or an exact request id of any summary.

        The request-id branch is an indexed ``id IN (SELECT trace_id ...)`` rather than
        a join through ``search_fields``, which would scan the summaries per term.
        """
        results, may_have_duplicates = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        if term:
            by_request = queryset.filter(
                pk__in=RequestSummary.objects.filter(request_id=term).values("trace_id"))
            results = results | by_request
        return results, may_have_duplicates

    def formfield_for_dbfield(self, db_field: models.Field, request: HttpRequest, **kwargs: Any) -> Any:
        """The note is bounded here as on every other way in (``MAX_NOTE_CHARS``)."""
        field = super().formfield_for_dbfield(db_field, request, **kwargs)
        if db_field.name == "note" and isinstance(field, forms.CharField):  # a TextField's form field
            field.max_length = MAX_NOTE_CHARS
            field.validators.append(MaxLengthValidator(MAX_NOTE_CHARS))
            field.widget.attrs["maxlength"] = str(MAX_NOTE_CHARS)
        return field

    def save_model(self, request: HttpRequest, obj: TraceRecord, form: Any, change: bool) -> None:
        obj.tags = normalize_tags(obj.tags)
        # Only note and tags are editable; the payload was deferred and must not be rewritten.
        obj.save(update_fields=["note", "tags"])

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[list[str], dict[str, int], set[str], list]:
        """The delete confirmation's list, without loading every request summary.

        Django's default walks all related rows to list them, which for traces with
        thousands of requests each is slow and unreadable. Summaries are derived data:
        deleting a trace needs only the trace's delete permission.
        """
        records = list(objs)
        shown: list[str] = [
            format_html('Trace record: <a href="{}">{}</a> with its {} request summaries',
                        reverse("admin:engines_tracerecord_change", args=[r.pk]), str(r), r.request_count)
            for r in records[:100]
        ]
        if len(records) > 100:
            shown.append(f"… and {len(records) - 100} more trace records")
        model_count = {
            str(TraceRecord._meta.verbose_name_plural): len(records),
            str(RequestSummary._meta.verbose_name_plural): sum(r.request_count for r in records),
        }
        perms_needed = set() if self.has_delete_permission(request) else {str(TraceRecord._meta.verbose_name)}
        return shown, model_count, perms_needed, []

    # --- actions --------------------------------------------------------------------

    @admin.action(description="Compare the two selected traces", permissions=["view"])
    def compare_traces(self, request: HttpRequest, queryset: QuerySet[TraceRecord]) -> HttpResponse | None:
        ids = list(queryset.order_by("captured_at", "id").values_list("pk", flat=True)[:3])
        if len(ids) != 2:
            count = queryset.count() if len(ids) > 2 else len(ids)
            self.message_user(
                request, f"Select exactly two trace records to compare ({count} selected).", messages.WARNING)
            return None
        query = urlencode({"a": ids[0], "b": ids[1]})
        return HttpResponseRedirect(f"{reverse('admin:engines_tracerecord_compare')}?{query}")

    @admin.action(description="Make a workload of each selected trace (to replay)", permissions=["view"])
    def make_workloads(self, request: HttpRequest, queryset: QuerySet[TraceRecord]) -> HttpResponse | None:
        made, refused = [], []
        for trace in queryset.order_by("captured_at", "id")[:MAX_WORKLOADS_AT_ONCE]:
            try:
                made.append(workload_from_trace(trace))
            except EmptyWorkloadError as exc:
                refused.append(str(exc))
        if len(made) == 1 and not refused:
            self.message_user(request, f"Made workload #{made[0].pk} of {made[0].request_count} requests.",
                              messages.SUCCESS)
            return HttpResponseRedirect(reverse("admin:engines_workloadrecord_change", args=[made[0].pk]))
        if made:
            self.message_user(request, f"Made {len(made)} workloads: " + ", ".join(f"#{w.pk}" for w in made) + ".",
                              messages.SUCCESS)
        for problem in refused:
            self.message_user(request, f"No workload: {problem}.", messages.WARNING)
        return None

    @admin.action(description="Apply retention limits to the selected traces' engines", permissions=["delete"])
    def apply_retention_limits(self, request: HttpRequest, queryset: QuerySet[TraceRecord]) -> None:
        engines = sorted(set(queryset.order_by().values_list("engine", flat=True).distinct()))
        results = [(engine, apply_retention(engine)) for engine in engines]
        removed = sum(r.total_records for _, r in results)
        if not removed:
            self.message_user(request, f"Nothing past the retention limits for {', '.join(engines)}.",
                              messages.INFO)
            return
        detail = "; ".join(f"{engine}: {r.total_records} records, {r.total_summaries} request summaries"
                           for engine, r in results if r.total_records)
        self.message_user(request, f"Retention removed {removed} trace records ({detail}).", messages.SUCCESS)

    # --- pages of their own -------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        extra = [
            path("compare/", self.admin_site.admin_view(self.compare_view), name="engines_tracerecord_compare"),
            path("<path:object_id>/download.json", self.admin_site.admin_view(self.download_json_view),
                 name="engines_tracerecord_download_json"),
            path("<path:object_id>/download.json.gz", self.admin_site.admin_view(self.download_gzip_view),
                 name="engines_tracerecord_download_gzip"),
        ]
        return extra + super().get_urls()

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict | None = None) -> HttpResponse:
        """Django's page, with the statistics and the request table; the payload stays unread."""
        record = self.get_object(request, unquote(object_id))
        context = dict(extra_context or {})
        if record is not None and self.has_view_or_change_permission(request, record):
            context.update(
                report=trace_report(record),
                phase_stat_names=PHASE_STATS,
                request_stat_names=REQUEST_STATS,
                **self._request_table(request, record),
            )
        return super().change_view(request, object_id, form_url, context)

    def compare_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        ids = {key: _record_id(request.GET.get(key)) for key in ("a", "b")}
        records = self.get_queryset(request).in_bulk([pk for pk in ids.values() if pk is not None])
        a, b = records.get(ids["a"]), records.get(ids["b"])
        if a is None or b is None or a.pk == b.pk:
            self.message_user(request, "Compare needs two different existing trace records: select two "
                                       "in the list and run the compare action.", messages.WARNING)
            return HttpResponseRedirect(reverse("admin:engines_tracerecord_changelist"))
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Compare {a} with {b}",
            "comparison": compare_records(a, b),
        }
        return TemplateResponse(request, "admin/engines/tracerecord/compare.html", context)

    def download_json_view(self, request: HttpRequest, object_id: str) -> HttpResponse | StreamingHttpResponse:
        return self._download(request, object_id, "json")

    def download_gzip_view(self, request: HttpRequest, object_id: str) -> HttpResponse | StreamingHttpResponse:
        return self._download(request, object_id, "json.gz")

    def _download(self, request: HttpRequest, object_id: str,
                  form: PayloadForm) -> HttpResponse | StreamingHttpResponse:
        """The payload as a file, or the page that says why it cannot be had."""
        record = self.get_object(request, unquote(object_id))
        if record is None:
            # The admin's own answer to a missing object (private, so not in django-stubs).
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)  # type: ignore[attr-defined]
        if not self.has_view_permission(request, record):
            raise PermissionDenied
        try:
            return payload_response(request, record, form)
        except PayloadError as exc:
            context = {**self.admin_site.each_context(request), "opts": self.opts, "original": record,
                       "title": "Trace payload unavailable", "problem": str(exc)}
            return TemplateResponse(request, "admin/engines/tracerecord/payload_error.html", context,
                                    status=PAYLOAD_ERROR_STATUS)

    def _request_table(self, request: HttpRequest, record: TraceRecord) -> dict[str, Any]:
        """The detail page's request table: sortable by any column (one trace's rows, found
        through the trace's index, sort cheaply), the first rows shown."""
        fields = [c.field for c in REQUEST_COLUMNS]
        sort = request.GET.get("requests_sort", "-e2e_us")
        if sort.lstrip("-") not in fields:
            sort = "-e2e_us"
        key = sort.lstrip("-")
        descending = sort.startswith("-")
        order = F(key).desc(nulls_last=True) if descending else F(key).asc(nulls_last=True)
        rows = list(RequestSummary.objects.filter(trace=record).order_by(order, "id")
                    .values_list(*fields)[:REQUEST_TABLE_LIMIT])
        headers = []
        for column in REQUEST_COLUMNS:
            field = column.field
            next_sort = field if field == key and descending else f"-{field}"
            params = request.GET.copy()
            params["requests_sort"] = next_sort
            headers.append({"label": column.header, "url": "?" + params.urlencode(), "sorted": field == key,
                            "descending": descending, "field": field})
        display = [[(c.field, ms_text(v) if c.is_duration else ("—" if v is None else v))
                    for c, v in zip(REQUEST_COLUMNS, row, strict=True)] for row in rows]
        all_url = (reverse("admin:engines_requestsummary_changelist")
                   + "?" + urlencode({"trace__id__exact": record.pk}))
        return {"request_headers": headers, "request_rows": display, "request_rows_limit": REQUEST_TABLE_LIMIT,
                "request_list_url": all_url}
