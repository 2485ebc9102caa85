"""The stall incidents' admin (``models.StallIncidentRecord``): the list, one incident's page with
its evidence laid out (the rule's words, what could not be taken and why, the requests in flight,
the stacks), and the whole evidence as one JSON download (the bundle an operator attaches to a bug).
Written by the watchdog only: nothing here adds or changes one; deleting follows permissions."""
from __future__ import annotations

from typing import Any

import orjson
from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html

from engines.admin.cells import engine_dashboard_link, when_cell
from engines.admin.large_tables import IndexedValuesFilter
from engines.admin.servers import ServerColumn, ServerFilter
from engines.history.downloads import attachment
from engines.models import StallIncidentRecord

__all__ = ["StallIncidentAdmin"]

#: Evidence parts shown as text blocks on the page, in this order, with their headings.
TEXT_PARTS = (("engine_stacks", "Every thread of the engine process (py-spy, from outside)"),
              ("server_stacks", "Every thread of the server process"))


@admin.register(StallIncidentRecord)
class StallIncidentAdmin(ServerColumn, admin.ModelAdmin):
    """Stalls, newest first: filter by engine, server, reason and date; open one for its evidence."""

    list_display = ("incident_label", "engine", "server_column", "reason", "opened", "lasted", "detail")
    list_display_links = ("incident_label",)
    list_filter = (("engine", IndexedValuesFilter), ServerFilter, "reason", "opened_at")
    ordering = ("-opened_at", "-id")
    show_facets = admin.ShowFacets.NEVER
    actions = None
    fields = ("engine", "engine_dashboard", "server_column", "reason", "detail", "opened_at", "closed_at", "lasted",
              "download")
    readonly_fields = fields
    # The list never reads the evidence (stacks and trace events: tens of kB a row).
    list_deferred = ("evidence",)

    def get_queryset(self, request: HttpRequest) -> Any:
        queryset = super().get_queryset(request)
        return queryset.defer(*self.list_deferred) if request.resolver_match and \
            request.resolver_match.url_name == "engines_stallincidentrecord_changelist" else queryset

    @admin.display(description="incident", ordering="id")
    def incident_label(self, obj: StallIncidentRecord) -> str:
        return f"#{obj.pk}"

    @admin.display(description="opened", ordering="opened_at")
    def opened(self, obj: StallIncidentRecord) -> str:
        return when_cell(obj.opened_at)

    @admin.display(description="lasted", ordering="duration_s")
    def lasted(self, obj: StallIncidentRecord) -> str:
        if obj.duration_s is None:
            return format_html('<span class="engines-incident-open">{}</span>', "open (or its server ended first)")
        return f"{obj.duration_s:,.1f} s"

    @admin.display(description="live page")
    def engine_dashboard(self, obj: StallIncidentRecord) -> str:
        return engine_dashboard_link(obj, obj.engine)

    @admin.display(description="evidence")
    def download(self, obj: StallIncidentRecord) -> str:
        url = reverse("admin:engines_stallincidentrecord_download", args=[obj.pk])
        return format_html('<a href="{}">Download the evidence (.json)</a>', url)

    def get_urls(self) -> list[URLPattern]:
        extra = [path("<path:object_id>/evidence.json", self.admin_site.admin_view(self.download_view),
                      name="engines_stallincidentrecord_download")]
        return extra + super().get_urls()

    def download_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The incident with its whole evidence, one JSON file."""
        record = self.get_object(request, unquote(object_id))
        if record is None or not self.has_view_permission(request, record):
            raise Http404("No such stall incident.")
        bundle = {"id": record.pk, "engine": record.engine, "server": record.server, "fleet": record.fleet,
                  "reason": record.reason, "detail": record.detail, "opened_at": record.opened_at.isoformat(),
                  "closed_at": record.closed_at.isoformat() if record.closed_at else None,
                  "duration_s": record.duration_s, "evidence": record.evidence}
        response = HttpResponse(orjson.dumps(bundle, option=orjson.OPT_INDENT_2), content_type="application/json")
        response["Content-Disposition"] = attachment(f"stall-{record.engine}-{record.pk}.json")
        return response

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """Django's read-only page, then the evidence laid out."""
        record = self.get_object(request, unquote(object_id))
        context = dict(extra_context or {})
        if record is not None:
            evidence = record.evidence or {}
            context.update(
                missing=sorted((evidence.get("missing") or {}).items()),
                requests=evidence.get("requests") or [], requests_total=evidence.get("requests_total"),
                streams=evidence.get("server_streams") or [],
                progress=evidence.get("progress") or {}, thresholds=evidence.get("thresholds") or {},
                texts=[(heading, evidence[key]) for key, heading in TEXT_PARTS if evidence.get(key)],
                trace_events=len(evidence.get("trace_events") or ()),
                kv=evidence.get("kv_cache") or {})
        return super().change_view(request, object_id, form_url, context)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: StallIncidentRecord | None = None) -> bool:
        return False
