"""The metrics snapshots' admin: filtered to one engine, its snapshots charted above the list
(``engines.history.metrics_charts``); unfiltered, a link to chart each engine."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import orjson
from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.utils.html import format_html
from django.utils.http import urlencode

from engines.admin.cells import engine_dashboard_link, when_cell
from engines.admin.large_tables import EstimatedCountPaginator, IndexedValuesFilter
from engines.history.autosave import METRICS_HEARTBEAT_S
from engines.history.metrics_charts import snapshot_charts
from engines.models import MetricsSnapshot

__all__ = ["MetricsSnapshotAdmin"]


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
            engines: Iterable[str] = next((spec.lookup_choices for spec in context["cl"].filter_specs
                            if isinstance(spec, IndexedValuesFilter)), [])
            context["snapshot_chart_links"] = [(name, "?" + urlencode({self.ENGINE_PARAMETERS[0]: name}))
                                               for name in engines]
        return response

    @admin.display(description="taken at", ordering="taken_at")
    def taken(self, obj: MetricsSnapshot) -> str:
        return when_cell(obj.taken_at)

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
