"""The metrics snapshots' admin: filtered to one engine, one server's snapshots of it charted
above the list (``engines.history.metrics_charts``); unfiltered, a link to chart each server's
engine. The same engine name on two servers is two engines: a chart never mixes their snapshots
(their counters and latencies are each server's own), and picks the server (the server filter,
or a select above the charts; by default the server with the newest snapshot of the engine)."""
from __future__ import annotations

from typing import Any, Callable

import orjson
from django.conf import settings
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils.html import format_html
from django.utils.http import urlencode

from engines.admin.cells import engine_dashboard_link, one_line_cell, when_cell
from engines.admin.large_tables import EstimatedCountPaginator, IndexedValuesFilter, distinct_rows
from engines.admin.servers import UNRECORDED_PARAMETER, ServerColumn, ServerFilter, server_choice
from engines.history.autosave import METRICS_HEARTBEAT_S
from engines.history.metrics_charts import snapshot_charts
from engines.models import UNRECORDED, UNRECORDED_SERVER_TEXT, MetricsSnapshot

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
class MetricsSnapshotAdmin(ServerColumn, admin.ModelAdmin):
    """Snapshots of the engines' metrics; filtered to one engine, one server's charted above the list."""

    list_display = ("taken", "engine_name", "server_column", "model_name", *_SNAPSHOT_COLUMNS)
    list_display_links = ("taken",)
    list_filter = (("engine", IndexedValuesFilter), ServerFilter, "taken_at")
    ordering = ("-taken_at", "-id")
    show_facets = admin.ShowFacets.NEVER
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    fields = ("engine", "engine_dashboard", "server_column", "model", "taken_at", "metrics_json")
    readonly_fields = fields
    # The engine filter's parameter, and the one the dashboard's links use (a plain lookup).
    ENGINE_PARAMETERS = ("engine", "engine__exact")

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
        """The list, with one server's snapshots of one engine charted above it (the engine filter
        picks the engine, the server filter or the select the server; the date filter narrows it)
        or, unfiltered, links to chart each server's engine."""
        response = super().changelist_view(request, extra_context)
        context = getattr(response, "context_data", None)
        if context is None or "cl" not in context:  # a redirect, or an action's answer
            return response
        engine = next((request.GET[p] for p in self.ENGINE_PARAMETERS if request.GET.get(p)), None)
        # Every (server, engine) that has snapshots: one probe a pair through the (server, engine) index.
        pairs = sorted(distinct_rows(MetricsSnapshot, "server", "engine"), key=lambda pair: (pair[1], pair[0]))
        picked = request.GET.get(ServerFilter.parameter_name) or None
        if engine:
            context.update(self._charts(request, context["cl"].queryset, engine, picked,
                                        [s for s, e in pairs if e == engine]))
        else:
            context["snapshot_chart_links"] = [
                (f"{name} on {charted or UNRECORDED_SERVER_TEXT}",
                 "?" + urlencode({self.ENGINE_PARAMETERS[0]: name,
                                  ServerFilter.parameter_name: server_choice(charted)}))
                for charted, name in pairs if picked is None or server_choice(charted) == picked]
        return response

    def _charts(self, request: HttpRequest, snapshots: QuerySet[MetricsSnapshot], engine: str, picked: str | None,
                servers: list[str]) -> dict[str, Any]:
        """The charts' context: ``engine``'s snapshots on the server picked (the list is filtered to
        it already) or, none picked, on the server with the newest snapshot in the selection."""
        if picked is None:
            charted = snapshots.order_by("-taken_at", "-id").values_list("server", flat=True).first()
            snapshots = snapshots.filter(server=charted) if charted is not None else snapshots.none()
        else:
            charted = UNRECORDED if picked == UNRECORDED_PARAMETER else picked
            servers = servers if charted in servers else [*servers, charted]
        # The select keeps the list's other filters; a new server starts at its first page.
        kept = [(key, value) for key, values in request.GET.lists()
                if key not in (ServerFilter.parameter_name, "p") for value in values]
        return {"snapshot_charts": snapshot_charts(snapshots), "snapshot_charts_engine": engine,
                "snapshot_charts_server": charted, "snapshot_charts_server_picked": picked is not None,
                "snapshot_chart_servers": [(server_choice(s), s or UNRECORDED_SERVER_TEXT, s == charted)
                                           for s in servers],
                "snapshot_chart_kept_parameters": kept, "snapshot_charts_time_zone": settings.TIME_ZONE,
                "snapshot_heartbeat_minutes": round(METRICS_HEARTBEAT_S / 60)}

    @admin.display(description="taken at", ordering="taken_at")
    def taken(self, obj: MetricsSnapshot) -> str:
        return when_cell(obj.taken_at)

    @admin.display(description="engine", ordering="engine")
    def engine_name(self, obj: MetricsSnapshot) -> str:
        return one_line_cell(obj.engine)

    @admin.display(description="model", ordering="model")
    def model_name(self, obj: MetricsSnapshot) -> str:
        return one_line_cell(obj.model)

    @admin.display(description="dashboard")
    def engine_dashboard(self, obj: MetricsSnapshot) -> str:
        return engine_dashboard_link(obj, obj.engine)

    @admin.display(description="metrics")
    def metrics_json(self, obj: MetricsSnapshot) -> str:
        text = orjson.dumps(obj.metrics, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
        return format_html("<pre>{}</pre>", text)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: MetricsSnapshot | None = None) -> bool:
        return False
