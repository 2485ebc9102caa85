"""The request summaries' admin: every request of every saved trace, to find the slowest.

A million rows: filters list their choices through the trace table's index, the list sorts
only by indexed columns, and the count is the planner's estimate (``large_tables``).
"""
from __future__ import annotations

from typing import Any, Callable

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html

from engines.admin.cells import ms_text, one_line_cell
from engines.admin.large_tables import EstimatedCountPaginator, distinct_values, indexed_fields
from engines.admin.servers import ServerColumn, ServerFilter
from engines.dashboard.waterfall import waterfall
from engines.history.columns import REQUEST_COLUMNS, RequestColumn
from engines.models import RequestSummary, TraceRecord
from engines.runtime import FinishReason

__all__ = ["RequestSummaryAdmin"]


class EngineFilter(admin.SimpleListFilter):
    """Engines as listed by the trace table (through its index): a ``DISTINCT`` over a
    million summaries would cost more than the whole request list page."""

    title = "engine"
    parameter_name = "engine"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(name, name) for name in distinct_values(TraceRecord, "engine")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.filter(engine=self.value()) if self.value() else queryset


class TraceServerFilter(ServerFilter):
    """Servers as listed by the trace table (a trace's summaries name its server)."""

    listed_from = TraceRecord


class FinishReasonFilter(admin.SimpleListFilter):
    """The finish reasons the engine emits (its ``FinishReason``), plus requests the trace
    shows unfinished."""

    title = "finish reason"
    parameter_name = "finish_reason"
    UNFINISHED = "-"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(r.value, r.value) for r in FinishReason] + [(self.UNFINISHED, "unfinished in the trace")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if not value:
            return queryset
        return queryset.filter(finish_reason="" if value == self.UNFINISHED else value)


class _OverFilter(admin.SimpleListFilter):
    """Requests whose ``field`` (µs) is over a threshold in seconds: the choices, or any number in
    the URL (``?ttft_over=1.5``). With the list sorted by that field, the slow requests first."""

    field = ""
    CHOICES: tuple[float, ...] = ()

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        choices = [(f"{s:g}", f"over {s:g} s") for s in self.CHOICES]
        given = self.value()
        if given and given not in dict(choices):  # a threshold from the URL shows as the one chosen
            choices.append((given, f"over {given} s"))
        return choices

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if not value:
            return queryset
        try:
            seconds = float(value)
        except ValueError as exc:
            raise IncorrectLookupParameters(f"{self.parameter_name} must be seconds, not {value!r}") from exc
        if not 0 <= seconds < 1e9:
            raise IncorrectLookupParameters(f"{self.parameter_name} must be seconds from 0, not {value!r}")
        return queryset.filter(**{f"{self.field}__gt": int(seconds * 1e6)})


class SlowTTFTFilter(_OverFilter):
    """The slow requests by time to first token."""

    title = "TTFT"
    parameter_name = "ttft_over"
    field = "ttft_us"
    CHOICES = (0.5, 1, 2, 5, 10)


class SlowE2EFilter(_OverFilter):
    """The slow requests by end-to-end latency."""

    title = "end to end"
    parameter_name = "e2e_over"
    field = "e2e_us"
    CHOICES = (1, 5, 10, 30, 60)


def _summary_column(column: RequestColumn, sortable: bool) -> Callable[[RequestSummary], Any]:
    """``column`` in the request-summary admin: its header, a duration in ms, and sortable if asked."""
    def value(summary: RequestSummary) -> Any:
        raw = getattr(summary, column.field)
        if column.field == "request_id":
            return one_line_cell(raw)
        return ms_text(raw) if column.is_duration else raw

    value.__name__ = column.field  # the list's CSS class, column-<field>
    return admin.display(description=column.header, ordering=column.field if sortable else None)(value)


# Sorting a million summaries without an index would cost more than the whole list page, so
# the list across all history sorts only by indexed columns (one trace's table sorts by any).
_SUMMARY_COLUMNS = tuple(_summary_column(c, c.field in indexed_fields(RequestSummary)) for c in REQUEST_COLUMNS)


@admin.register(RequestSummary)
class RequestSummaryAdmin(ServerColumn, admin.ModelAdmin):
    """All requests of all saved traces: sort by TTFT or e2e to find the slowest."""

    # The trace, its engine and server right after the request id; bench/trace_history.py sorts
    # by column index (o=-8: TTFT, o=-11: e2e).
    list_display = (_SUMMARY_COLUMNS[0], "trace_link", "engine", "server_column", *_SUMMARY_COLUMNS[1:],
                    "diagnosis_cell")
    # The slow requests, per engine or across the fleet's shared history: a threshold, then sort.
    list_filter = (EngineFilter, TraceServerFilter, SlowTTFTFilter, SlowE2EFilter, FinishReasonFilter)
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
    # the whole trace row, payload included, to print its name. (Both lists hold the columns'
    # callables, as Django allows for read-only fields; django-stubs types them as names only.)
    # The anatomy is drawn below the form (its waterfall), not printed as JSON in it.
    fields = (*list_display[:-1], "added_ts")  # type: ignore[arg-type]
    readonly_fields = fields  # type: ignore[assignment]

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """The read-only figures, then where the request's time went (its waterfall and diagnosis)."""
        summary = self.get_object(request, object_id)
        context = dict(extra_context or {})
        if summary is not None:
            breakdown = summary.time_breakdown or {}
            context.update(bars=waterfall(breakdown), total_s=sum(breakdown.values()) if breakdown else None,
                           diagnosis=summary.diagnosis or [],
                           missing_text="Its trace came from a server that does not record where a request's "
                                        "time went." if not breakdown else "")
        return super().change_view(request, object_id, form_url, context)

    @admin.display(description="diagnosis")
    def diagnosis_cell(self, obj: RequestSummary) -> str:
        """The first sentence, the others counted; all of them in the tooltip."""
        sentences = obj.diagnosis or []
        if not sentences:
            return "—"
        more = f" (+{len(sentences) - 1})" if len(sentences) > 1 else ""
        return format_html('<span class="engines-one-line engines-diagnosis" title="{}">{}{}</span>',
                           "\n".join(sentences), sentences[0], more)

    def get_search_results(self, request: HttpRequest, queryset: QuerySet,
                           search_term: str) -> tuple[QuerySet[RequestSummary], bool]:
        """Exact, case-sensitive request id: Django's ``=`` search means ``iexact``
        (``UPPER(...)``), which no index serves on a million rows."""
        term = search_term.strip()
        return (queryset.filter(request_id=term) if term else queryset), False

    @admin.display(description="trace", ordering="trace_id")
    def trace_link(self, obj: RequestSummary) -> str:
        # trace_id only: linking back needs no join and no query per row.
        return format_html('<a href="{}">{}</a>', reverse("admin:engines_tracerecord_change", args=[obj.trace_id]),
                           one_line_cell(f"{obj.engine} #{obj.trace_id}"))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: RequestSummary | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: RequestSummary | None = None) -> bool:
        return False
