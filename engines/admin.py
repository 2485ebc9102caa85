"""Django admin for the trace and metrics history.

Pages: the trace list (filter, search, compare, retention, delete), the trace detail
(metadata, statistics, the request table, ``.json`` / ``.json.gz`` downloads), the
request summary list across all history, metrics snapshots (charted per engine above their
list: ``engines.history.metrics_charts``) and profiles. Staff only; what a user may do follows
Django's view / change / delete permissions.

Lists never load the payload column (``defer``), and nothing on a list page issues a
query per row: these pages stay fast with 100,000 records and 1,000,000 summaries
(bench/trace_history.py).
"""
from __future__ import annotations

import re
from datetime import datetime, timezone as dt_timezone
from typing import Any, AsyncIterator, Callable, Iterator

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.core.validators import MaxLengthValidator
from django.core.handlers.asgi import ASGIRequest
from django.core.paginator import Paginator
from django.db import connections, models
from django.db.models import F, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, StreamingHttpResponse
from django.template.defaultfilters import filesizeformat
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.http import content_disposition_header, urlencode
from django.utils.text import Truncator

from engines.history.autosave import METRICS_HEARTBEAT_S
from engines.history.capture import MAX_NOTE_CHARS, normalize_tags
from engines.history.columns import REQUEST_COLUMNS, RequestColumn
from engines.history.metrics_charts import snapshot_charts
from engines.history.payload import iter_json_chunks, payload_problem
from engines.history.report import PHASE_STATS, REQUEST_STATS, compare_records, trace_report
from engines.history.retention import apply_retention
from engines.models import MetricsSnapshot, ProfileRecord, RequestSummary, TraceRecord
from engines.runtime import FinishReason

# The admin is the dashboard's frame: its header names the product, not the framework.
admin.site.site_header = "LLM engine debug server"
admin.site.site_title = "LLM engine debug server"
admin.site.index_title = "History and administration"
admin.site.site_url = "/dashboard/"  # "View site": the live dashboard

# Status of a download whose stored payload cannot be served: the record exists but
# its bytes no longer match what was saved; a conflict to report, not a server fault.
PAYLOAD_ERROR_STATUS = 409
REQUEST_TABLE_LIMIT = 200


class EstimatedCountPaginator(Paginator):
    """Exact counts, except for an unfiltered list of a large PostgreSQL table.

    ``COUNT(*)`` over a million rows costs more than the rest of the page; the
    planner's row estimate (``pg_class.reltuples``, kept fresh by autovacuum) is close
    enough to number the pages, and any filter or search falls back to an exact count.
    """

    ESTIMATE_ABOVE = 100_000

    @cached_property
    def count(self) -> int:
        qs = self.object_list
        if isinstance(qs, QuerySet) and not qs.query.where and not qs.query.distinct:
            connection = connections[qs.db]
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
                                   [qs.model._meta.db_table])
                    row = cursor.fetchone()
                if row and row[0] > self.ESTIMATE_ABOVE:
                    return int(row[0])
        return super().count


def distinct_values(model: type, field_name: str) -> list[str]:
    """The distinct values of an indexed, non-null column, in order.

    On PostgreSQL a recursive query hops through the index one value at a time (a
    "loose index scan"): a few probes for a handful of engine names instead of
    ``SELECT DISTINCT`` reading all 100,000 rows on every list page.
    """
    manager = model._default_manager
    connection = connections[manager.db]
    if connection.vendor != "postgresql":
        return list(manager.order_by(field_name).values_list(field_name, flat=True).distinct())
    quote = connection.ops.quote_name
    table, column = quote(model._meta.db_table), quote(model._meta.get_field(field_name).column)
    sql = (f"WITH RECURSIVE v AS ((SELECT {column} AS value FROM {table} ORDER BY {column} LIMIT 1) "
           f"UNION ALL SELECT (SELECT t.{column} FROM {table} t WHERE t.{column} > v.value "
           f"ORDER BY t.{column} LIMIT 1) FROM v WHERE v.value IS NOT NULL) "
           f"SELECT value FROM v WHERE value IS NOT NULL")
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return [row[0] for row in cursor.fetchall()]


class IndexedValuesFilter(admin.AllValuesFieldListFilter):
    """Django's "all values" filter, listing the values through :func:`distinct_values`."""

    def __init__(self, field, request, params, model, model_admin, field_path):
        super().__init__(field, request, params, model, model_admin, field_path)
        self.lookup_choices = distinct_values(model, field.name)


def engine_dashboard_link(engine: str) -> str:
    """A link to the engine's live dashboard page, when this server serves it."""
    from engines.registry import registry

    if registry.get(engine) is None:
        return "not served by this server now"
    return format_html('<a href="{}">{}</a>', reverse("dashboard-engine", args=[engine]), f"{engine}, live")


def _ms(value_us: int | None) -> str:
    return "—" if value_us is None else f"{value_us / 1000:,.1f}"


#: How much of a note a list row shows (the whole note is the cell's tooltip and on the record).
LIST_NOTE_CHARS = 90


def _note_cell(note: str, tags: list[str] | None = None) -> str:
    """A list cell with the start of ``note`` (whole in its tooltip) and ``tags`` as labels."""
    text = format_html('<span class="engines-note" title="{}">{}</span>', note,
                       Truncator(note).chars(LIST_NOTE_CHARS)) if note else ""
    labels = format_html_join("", '<span class="engines-tag">{}</span>', ((tag,) for tag in tags or ()))
    return format_html("{}{}", text, format_html('<span class="engines-tags">{}</span>', labels) if labels else "")


def _when_cell(moment: datetime, below: str = "") -> str:
    """A list cell with a date and time to the second in the site's time zone (the admin's own
    format has no seconds, and snapshots come seconds apart), and ``below`` under it."""
    local = timezone.localtime(moment)
    under = format_html('<span class="engines-quiet">{}</span>', below) if below else ""
    return format_html('<span class="engines-when">{} <span>{}</span></span>{}', f"{local:%Y-%m-%d}",
                       f"{local:%H:%M:%S}", under)


def _local_time(us: int) -> datetime:
    return timezone.localtime(datetime.fromtimestamp(us / 1e6, tz=dt_timezone.utc))


def _seconds_text(us: float) -> str:
    """A duration as a person reads it: 850 µs, 12.3 ms, 7.23 s, 3 min 20 s."""
    if us < 1000:
        return f"{us:.0f} µs"
    if us < 1e6:
        return f"{us / 1000:.3g} ms"
    if us < 60e6:
        return f"{us / 1e6:.3g} s"
    minutes, seconds = divmod(round(us / 1e6), 60)
    return f"{minutes} min {seconds} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def capture_window_text(first_us: int | None, last_us: int | None) -> str:
    """A trace's window (µs since the epoch) in the site's time zone, to the millisecond, and its
    length: ``2026-11-27 08:41:36.398 – 08:41:43.631 UTC (7.23 s)``."""
    if first_us is None or last_us is None:
        return "no events"
    first, last = _local_time(first_us), _local_time(last_us)
    end_format = "%H:%M:%S" if first.date() == last.date() else "%Y-%m-%d %H:%M:%S"
    return (f"{first:%Y-%m-%d %H:%M:%S}.{first.microsecond // 1000:03d} – "
            f"{last.strftime(end_format)}.{last.microsecond // 1000:03d} {first.tzname()} "
            f"({_seconds_text(last_us - first_us)})")


def _record_id(value: str | None) -> int | None:
    """A trace record id from a query string, or None: ASCII digits only (``str.isdigit`` also
    accepts ``"²"``, which ``int`` refuses) and within a 64-bit column (SQLite overflows past it)."""
    if not value or not (value.isascii() and value.isdigit()):
        return None
    pk = int(value)
    return pk if pk < 2**63 else None


def _safe_filename_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "engine"


@admin.register(TraceRecord)
class TraceRecordAdmin(admin.ModelAdmin):
    list_display = ("trace_label", "engine_and_model", "captured", "duration_ms", "event_count",
                    "request_count", "size", "note_and_tags", "timeline_link")
    list_display_links = ("trace_label",)
    list_filter = (("engine", IndexedValuesFilter), ("model", IndexedValuesFilter),
                   ("backend", IndexedValuesFilter), "source", "captured_at")
    search_fields = ("note", "tags")
    search_help_text = "Matches words of the note or tags, or an exact request id."
    ordering = ("-captured_at", "-id")
    list_per_page = 50
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    actions = ("compare_traces", "apply_retention_limits", "delete_selected")
    fieldsets = (
        (None, {"fields": ("engine", "engine_dashboard", "model", "backend", "source", "captured_at",
                           "engine_version")}),
        ("Capture window", {"fields": ("window", "duration_ms", "event_count", "request_count",
                                        "dropped_events")}),
        ("Payload", {"fields": ("timeline", "payload_size", "downloads")}),
        ("Notes", {"fields": ("note", "tags")}),
    )
    readonly_fields = ("engine", "engine_dashboard", "model", "backend", "source", "captured_at", "engine_version",
                       "window",
                       "duration_ms", "event_count", "request_count", "dropped_events", "payload_size",
                       "downloads", "timeline")

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
        """The list, with the retention limits in force shown above it."""
        retention = {"max_records": settings.TRACE_RETENTION_MAX_RECORDS, "max_bytes": settings.TRACE_RETENTION_MAX_BYTES,
                     "max_days": settings.TRACE_RETENTION_MAX_DAYS}
        return super().changelist_view(request, {**(extra_context or {}), "retention": retention})

    @admin.display(description="dashboard")
    def engine_dashboard(self, obj: TraceRecord) -> str:
        return engine_dashboard_link(obj.engine)

    # --- list columns -------------------------------------------------------------

    @admin.display(description="trace", ordering="id")
    def trace_label(self, obj: TraceRecord) -> str:
        return f"#{obj.pk}"

    @admin.display(description="duration (ms)", ordering="duration_us")
    def duration_ms(self, obj: TraceRecord) -> str:
        return _ms(obj.duration_us)

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
        return _when_cell(obj.captured_at, obj.get_source_display())

    @admin.display(description="note and tags")
    def note_and_tags(self, obj: TraceRecord) -> str:
        return _note_cell(obj.note, obj.tag_list)

    @admin.display(description="timeline")
    def timeline_link(self, obj: TraceRecord) -> str:
        return format_html('<a href="{}">open</a>', reverse("dashboard-trace-timeline", args=[obj.pk]))

    # --- detail fields ------------------------------------------------------------

    @admin.display(description="window")
    def window(self, obj: TraceRecord) -> str:
        return capture_window_text(obj.first_event_ts, obj.last_event_ts)

    @admin.display(description="payload size")
    def payload_size(self, obj: TraceRecord) -> str:
        return f"{filesizeformat(obj.payload_bytes)} JSON, {filesizeformat(obj.compressed_bytes)} stored (gzip)"

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

    # --- permissions and querysets --------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # records come from saving a trace, never from a form

    def get_queryset(self, request: HttpRequest) -> QuerySet[TraceRecord]:
        # Never read payloads for lists, the detail page, actions or deletes.
        return super().get_queryset(request).defer("payload")

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str):
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
        if db_field.name == "note" and field is not None:
            field.max_length = MAX_NOTE_CHARS
            field.validators.append(MaxLengthValidator(MAX_NOTE_CHARS))
            field.widget.attrs["maxlength"] = str(MAX_NOTE_CHARS)
        return field

    def save_model(self, request: HttpRequest, obj: TraceRecord, form: Any, change: bool) -> None:
        obj.tags = normalize_tags(obj.tags)
        # Only note and tags are editable; the payload was deferred and must not be rewritten.
        obj.save(update_fields=["note", "tags"])

    def get_deleted_objects(self, objs: Any, request: HttpRequest):
        """The delete confirmation's list, without loading every request summary.

        Django's default walks all related rows to list them, which for traces with
        thousands of requests each is slow and unreadable. Summaries are derived data:
        deleting a trace needs only the trace's delete permission.
        """
        records = list(objs)
        shown = [
            format_html('Trace record: <a href="{}">{}</a> with its {} request summaries',
                        reverse("admin:engines_tracerecord_change", args=[r.pk]), str(r), r.request_count)
            for r in records[:100]
        ]
        if len(records) > 100:
            shown.append(f"… and {len(records) - 100} more trace records")
        model_count = {
            TraceRecord._meta.verbose_name_plural: len(records),
            RequestSummary._meta.verbose_name_plural: sum(r.request_count for r in records),
        }
        perms_needed = set() if self.has_delete_permission(request) else {TraceRecord._meta.verbose_name}
        return shown, model_count, perms_needed, []

    # --- actions --------------------------------------------------------------------

    @admin.action(description="Compare the two selected traces", permissions=["view"])
    def compare_traces(self, request: HttpRequest, queryset: QuerySet[TraceRecord]):
        ids = list(queryset.order_by("captured_at", "id").values_list("pk", flat=True)[:3])
        if len(ids) != 2:
            count = queryset.count() if len(ids) > 2 else len(ids)
            self.message_user(
                request, f"Select exactly two trace records to compare ({count} selected).", messages.WARNING)
            return None
        query = urlencode({"a": ids[0], "b": ids[1]})
        return HttpResponseRedirect(f"{reverse('admin:engines_tracerecord_compare')}?{query}")

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

    # --- extra views ------------------------------------------------------------------

    def get_urls(self):
        extra = [
            path("compare/", self.admin_site.admin_view(self.compare_view), name="engines_tracerecord_compare"),
            path("<path:object_id>/download.json", self.admin_site.admin_view(self.download_json_view),
                 name="engines_tracerecord_download_json"),
            path("<path:object_id>/download.json.gz", self.admin_site.admin_view(self.download_gzip_view),
                 name="engines_tracerecord_download_gzip"),
            path("<path:object_id>/timeline-data.json", self.admin_site.admin_view(self.timeline_data_view),
                 name="engines_tracerecord_timeline_data"),
            path("<path:object_id>/requests.json", self.admin_site.admin_view(self.requests_json_view),
                 name="engines_tracerecord_requests_json"),
        ]
        return extra + super().get_urls()

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict | None = None):
        record = self.get_object(request, unquote(object_id))
        context = dict(extra_context or {})
        if record is not None and self.has_view_or_change_permission(request, record):
            context.update(
                payload_problem=self._payload_problem(record),
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

    def download_json_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._download(request, object_id, compressed=False)

    def download_gzip_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._download(request, object_id, compressed=True)

    # --- helpers ------------------------------------------------------------------------

    def timeline_data_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The stored trace for the timeline viewer: the gzip bytes as they are, sent with
        ``Content-Encoding: gzip`` so the browser inflates them natively (a million-event trace
        travels as ~15 MB, not 160 MB of JSON, and costs the server no work). A record's payload
        never changes, so the browser may keep it."""
        checked = self._checked_payload(request, object_id)
        if isinstance(checked, HttpResponse):
            return checked
        record, data = checked
        response = HttpResponse(data, content_type="application/json")
        response["Content-Encoding"] = "gzip"
        response["Cache-Control"] = "private, max-age=86400"
        response["X-Trace-Events"] = str(record.event_count)
        return response

    def requests_json_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The record's request summaries, for the timeline's lane panel and filters: one row per
        request id with its admin URL."""
        record = self.get_object(request, unquote(object_id))
        if record is None:
            return HttpResponse(orjson.dumps({"error": f"no trace record {object_id!r}"}),
                                content_type="application/json", status=404)
        if not self.has_view_permission(request, record):
            raise PermissionDenied
        fields = ["id", "request_id"] + [c.field for c in REQUEST_COLUMNS if c.field != "request_id"]
        rows = RequestSummary.objects.filter(trace=record).order_by("id").values_list(*fields)
        change_url = reverse("admin:engines_requestsummary_change", args=["ID"])  # the browser puts each row's id in
        return HttpResponse(orjson.dumps({"fields": fields, "rows": list(rows), "change_url": change_url}),
                            content_type="application/json")

    def _checked_payload(self, request: HttpRequest, object_id: str) -> HttpResponse | tuple[TraceRecord, bytes]:
        """The record and its intact stored bytes, or the response that says why not."""
        record = self.get_object(request, unquote(object_id))
        if record is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_view_permission(request, record):
            raise PermissionDenied
        data = self._stored_payload(record)
        problem = payload_problem(data, expected_size=record.compressed_bytes,
                                  expected_crc32=record.payload_crc32)
        if problem is not None:
            context = {**self.admin_site.each_context(request), "opts": self.opts, "original": record,
                       "title": "Trace payload unavailable", "problem": problem}
            return TemplateResponse(request, "admin/engines/tracerecord/payload_error.html", context,
                                    status=PAYLOAD_ERROR_STATUS)
        return record, data

    def _download(self, request: HttpRequest, object_id: str, *, compressed: bool) -> HttpResponse:
        checked = self._checked_payload(request, object_id)
        if isinstance(checked, HttpResponse):
            return checked
        record, data = checked
        stamp = record.captured_at.strftime("%Y%m%dT%H%M%S")
        filename = f"trace-{_safe_filename_part(record.engine)}-{record.pk}-{stamp}.json"
        if compressed:
            response: HttpResponse | StreamingHttpResponse = HttpResponse(bytes(data),
                                                                          content_type="application/gzip")
            filename += ".gz"
        else:
            response = StreamingHttpResponse(_json_stream(request, bytes(data)), content_type="application/json")
            if record.payload_crc32 is not None:
                response["Content-Length"] = str(record.payload_bytes)
        response["Content-Disposition"] = content_disposition_header(as_attachment=True, filename=filename)
        return response

    @staticmethod
    def _stored_payload(record: TraceRecord) -> bytes | None:
        data = TraceRecord.objects.filter(pk=record.pk).values_list("payload", flat=True).first()
        return None if data is None else bytes(data)

    def _payload_problem(self, record: TraceRecord) -> str | None:
        return payload_problem(self._stored_payload(record), expected_size=record.compressed_bytes,
                               expected_crc32=record.payload_crc32)

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
        display = [[(c.field, _ms(v) if c.is_duration else ("—" if v is None else v))
                    for c, v in zip(REQUEST_COLUMNS, row, strict=True)] for row in rows]
        all_url = (reverse("admin:engines_requestsummary_changelist")
                   + "?" + urlencode({"trace__id__exact": record.pk}))
        return {"request_headers": headers, "request_rows": display, "request_rows_limit": REQUEST_TABLE_LIMIT,
                "request_list_url": all_url}


def _json_stream(request: HttpRequest, data: bytes) -> Iterator[bytes] | AsyncIterator[bytes]:
    """Inflate piece by piece; under ASGI asynchronously (Django would otherwise buffer
    the whole sync iterator in memory), with each piece inflated on a worker thread."""
    chunks = iter_json_chunks(data)
    if not isinstance(request, ASGIRequest):
        return chunks

    async def pieces() -> AsyncIterator[bytes]:
        step = sync_to_async(next, thread_sensitive=False)
        while (piece := await step(chunks, None)) is not None:
            yield piece
    return pieces()


class EngineFilter(admin.SimpleListFilter):
    """Engines as listed by the trace table (through its index): a ``DISTINCT`` over a
    million summaries would cost more than the whole request list page."""

    title = "engine"
    parameter_name = "engine"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin):
        return [(name, name) for name in distinct_values(TraceRecord, "engine")]

    def queryset(self, request: HttpRequest, queryset: QuerySet):
        return queryset.filter(engine=self.value()) if self.value() else queryset


class FinishReasonFilter(admin.SimpleListFilter):
    """The finish reasons the engine emits (its ``FinishReason``), plus requests the trace
    shows unfinished."""

    title = "finish reason"
    parameter_name = "finish_reason"
    UNFINISHED = "-"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin):
        return [(r.value, r.value) for r in FinishReason] + [(self.UNFINISHED, "unfinished in the trace")]

    def queryset(self, request: HttpRequest, queryset: QuerySet):
        value = self.value()
        if not value:
            return queryset
        return queryset.filter(finish_reason="" if value == self.UNFINISHED else value)


def _indexed_fields(model: type[models.Model]) -> frozenset[str]:
    """The fields an index can sort the whole table by: ``db_index`` ones, and the first
    field of each of ``Meta.indexes``."""
    opts = model._meta
    return frozenset({f.name for f in opts.concrete_fields if f.db_index}
                     | {index.fields[0].lstrip("-") for index in opts.indexes})


def _summary_column(column: RequestColumn, sortable: bool) -> Callable[[RequestSummary], Any]:
    """``column`` in the request-summary admin: its header, a duration in ms, and sortable if asked."""
    def value(summary: RequestSummary) -> Any:
        raw = getattr(summary, column.field)
        return _ms(raw) if column.is_duration else raw

    value.__name__ = column.field  # the list's CSS class, column-<field>
    return admin.display(description=column.header, ordering=column.field if sortable else None)(value)


# Sorting a million summaries without an index would cost more than the whole list page, so
# the list across all history sorts only by indexed columns (one trace's table sorts by any).
_SUMMARY_COLUMNS = tuple(_summary_column(c, c.field in _indexed_fields(RequestSummary)) for c in REQUEST_COLUMNS)


@admin.register(RequestSummary)
class RequestSummaryAdmin(admin.ModelAdmin):
    """All requests of all saved traces: sort by TTFT or e2e to find the slowest."""

    # The trace and its engine right after the request id; bench/trace_history.py sorts by
    # column index (o=-7: TTFT, o=-10: e2e).
    list_display = (_SUMMARY_COLUMNS[0], "trace_link", "engine", *_SUMMARY_COLUMNS[1:])
    list_filter = (EngineFilter, FinishReasonFilter)
    search_fields = ("=request_id",)
    search_help_text = "Exact request id."
    ordering = ("-id",)
    list_per_page = 100
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    # Summaries are derived from their trace: they go with it, never one by one.
    actions = None
    # Facet counts would scan the whole table on every page view.
    show_facets = admin.ShowFacets.NEVER
    # The detail page links the trace by id: showing the foreign key itself would load
    # the whole trace row, payload included, to print its name.
    fields = (*list_display, "added_ts")
    readonly_fields = fields

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str):
        """Exact, case-sensitive request id: Django's ``=`` search means ``iexact``
        (``UPPER(...)``), which no index serves on a million rows."""
        term = search_term.strip()
        return (queryset.filter(request_id=term) if term else queryset), False

    @admin.display(description="trace", ordering="trace_id")
    def trace_link(self, obj: RequestSummary) -> str:
        # trace_id only: linking back needs no join and no query per row.
        return format_html('<a href="{}">{} #{}</a>',
                           reverse("admin:engines_tracerecord_change", args=[obj.trace_id]), obj.engine,
                           obj.trace_id)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: RequestSummary | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: RequestSummary | None = None) -> bool:
        return False


def _metric_column(path: str, description: str, shown: Callable[[Any], str]) -> Callable[[MetricsSnapshot], str]:
    """A snapshot list column: one metric (``path``: keys into the metrics, ``__``-separated) as
    ``shown`` prints it, or a dash where the snapshot has none."""
    def value(snapshot: MetricsSnapshot) -> str:
        found: Any = snapshot.metrics
        for key in path.split("__"):
            found = found.get(key) if isinstance(found, dict) else None
        return "—" if not isinstance(found, (int, float)) or isinstance(found, bool) else shown(found)

    # The list's CSS class is column-<name>; a name with "__" would read as a sortable lookup.
    value.__name__ = path.replace("__", "_")
    return admin.display(description=description)(value)


_SNAPSHOT_COLUMNS = (
    _metric_column("num_running_requests", "running", lambda v: f"{v:,}"),
    _metric_column("num_waiting_requests", "waiting", lambda v: f"{v:,}"),
    _metric_column("kv_cache_usage", "KV cache", lambda v: f"{100 * v:.1f} %"),
    _metric_column("ttft_s__p99", "TTFT p99 (ms)", lambda v: f"{1000 * v:,.1f}"),
    _metric_column("num_finished_requests", "finished", lambda v: f"{v:,}"),
)


@admin.register(MetricsSnapshot)
class MetricsSnapshotAdmin(admin.ModelAdmin):
    """Snapshots of the engines' metrics; filtered to one engine, charted above the list."""

    list_display = ("taken", "engine", "model", *_SNAPSHOT_COLUMNS)
    list_display_links = ("taken",)
    list_filter = (("engine", IndexedValuesFilter), "taken_at")
    ordering = ("-taken_at", "-id")
    show_facets = admin.ShowFacets.NEVER
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    fields = ("engine", "engine_dashboard", "model", "taken_at", "metrics_json")
    readonly_fields = fields
    # The engine filter's parameter, and the one the dashboard's links use (a plain lookup).
    ENGINE_PARAMETERS = ("engine", "engine__exact")

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
        """The list, with one engine's snapshots charted above it (the engine filter picks it;
        the date filter narrows it) or, unfiltered, links to chart each engine."""
        response = super().changelist_view(request, extra_context)
        context = getattr(response, "context_data", None)
        if context is None or "cl" not in context:  # a redirect, or an action's answer
            return response
        engine = next((request.GET[p] for p in self.ENGINE_PARAMETERS if request.GET.get(p)), None)
        if engine:
            context.update(snapshot_charts=snapshot_charts(context["cl"].queryset), snapshot_charts_engine=engine,
                           snapshot_charts_time_zone=settings.TIME_ZONE,
                           snapshot_heartbeat_minutes=round(METRICS_HEARTBEAT_S / 60))
        else:
            engines = next((spec.lookup_choices for spec in context["cl"].filter_specs
                            if isinstance(spec, IndexedValuesFilter)), [])
            context["snapshot_chart_links"] = [(name, "?" + urlencode({self.ENGINE_PARAMETERS[0]: name}))
                                               for name in engines]
        return response

    @admin.display(description="taken at", ordering="taken_at")
    def taken(self, obj: MetricsSnapshot) -> str:
        return _when_cell(obj.taken_at)

    @admin.display(description="dashboard")
    def engine_dashboard(self, obj: MetricsSnapshot) -> str:
        return engine_dashboard_link(obj.engine)

    @admin.display(description="metrics")
    def metrics_json(self, obj: MetricsSnapshot) -> str:
        text = orjson.dumps(obj.metrics, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
        return format_html("<pre>{}</pre>", text)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: MetricsSnapshot | None = None) -> bool:
        return False


@admin.register(ProfileRecord)
class ProfileRecordAdmin(admin.ModelAdmin):
    """Saved profiles: filter by engine, backend and date; open one's page, download it, compare two."""

    list_display = ("profile_label", "engine_and_backend", "captured", "duration", "steps", "kernel_calls",
                    "stopped_by", "note_start", "links")
    list_display_links = ("profile_label",)
    list_filter = (("engine", IndexedValuesFilter), "backend", "captured_at", "source")
    search_fields = ("engine", "model", "note")
    ordering = ("-captured_at", "-id")
    show_facets = admin.ShowFacets.NEVER
    actions = ("compare_two",)
    fields = ("engine", "engine_dashboard", "model", "backend", "device", "source", "captured_at", "duration",
              "steps", "kernel_calls", "stopped_by", "stack_samples", "size", "page", "download", "note")
    readonly_fields = tuple(f for f in fields if f != "note")

    def get_queryset(self, request: HttpRequest) -> QuerySet[ProfileRecord]:
        # Lists and the detail page never read the profile, nor its kernel table.
        return super().get_queryset(request).defer("payload", "kernels")

    @admin.display(description="duration", ordering="duration_us")
    def duration(self, obj: ProfileRecord) -> str:
        return f"{obj.duration_us / 1e6:.2f} s"

    @admin.display(description="profile", ordering="id")
    def profile_label(self, obj: ProfileRecord) -> str:
        return f"#{obj.pk}"

    @admin.display(description="engine", ordering="engine")
    def engine_and_backend(self, obj: ProfileRecord) -> str:
        return format_html('{}<span class="engines-quiet">{}</span>', obj.engine, obj.backend) if obj.backend \
            else obj.engine

    @admin.display(description="started, source", ordering="captured_at")
    def captured(self, obj: ProfileRecord) -> str:
        return _when_cell(obj.captured_at, obj.get_source_display())

    @admin.display(description="note")
    def note_start(self, obj: ProfileRecord) -> str:
        return _note_cell(obj.note)

    @admin.display(description="open")
    def links(self, obj: ProfileRecord) -> str:
        return format_html('<a href="{}">profile</a> <a href="{}">.json.gz</a>',
                           reverse("dashboard-profile", args=[obj.pk]),
                           reverse("dashboard-profile-download", args=[obj.pk]))

    @admin.display(description="stored")
    def size(self, obj: ProfileRecord) -> str:
        return f"{filesizeformat(obj.compressed_bytes)} gzip ({filesizeformat(obj.payload_bytes)} JSON)"

    @admin.display(description="dashboard")
    def engine_dashboard(self, obj: ProfileRecord) -> str:
        return engine_dashboard_link(obj.engine)

    @admin.display(description="profile")
    def page(self, obj: ProfileRecord) -> str:
        return format_html('<a href="{}">Open the profile</a>', reverse("dashboard-profile", args=[obj.pk]))

    @admin.display(description="download")
    def download(self, obj: ProfileRecord) -> str:
        return format_html('<a href="{}">.json.gz</a>', reverse("dashboard-profile-download", args=[obj.pk]))

    @admin.action(description="Compare the two selected profiles")
    def compare_two(self, request: HttpRequest, queryset: QuerySet[ProfileRecord]) -> HttpResponse | None:
        ids = sorted(queryset.values_list("pk", flat=True))
        if len(ids) != 2:
            self.message_user(request, "Select exactly two profiles to compare.", messages.WARNING)
            return None
        return HttpResponseRedirect(f"{reverse('dashboard-profile-compare')}?{urlencode({'a': ids[0], 'b': ids[1]})}")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # profiles come from the profiler, never from a form
