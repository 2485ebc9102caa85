"""The fleet's admins: the attached foreign servers (their API keys never shown), and the jobs
run across the fleet with each target's outcome: the audit of who did what, when, and how it went."""
from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from engines.models import FleetJob, FleetJobTarget, ForeignServer

__all__ = ["FleetJobAdmin", "ForeignServerAdmin"]


@admin.register(ForeignServer)
class ForeignServerAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "version", "url", "poll_interval_s", "has_api_key", "attached_by", "attached_at")
    search_fields = ("name", "url")
    # The key is written when attaching (the fleet page, manage.py fleet attach) and never read back.
    exclude = ("api_key",)
    readonly_fields = ("kind", "version", "attached_by", "attached_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # attached from the fleet page or manage.py fleet attach, which detect its kind

    @admin.display(boolean=True, description="API key")
    def has_api_key(self, server: ForeignServer) -> bool:
        return bool(server.api_key)


class FleetJobTargetInline(admin.TabularInline):
    model = FleetJobTarget
    extra = 0
    can_delete = False
    fields = ("server_name", "server", "engine", "state", "message", "updated_at")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: FleetJob | None = None) -> bool:
        return False


@admin.register(FleetJob)
class FleetJobAdmin(admin.ModelAdmin):
    """Read only: an audit is not edited."""

    list_display = ("created_at", "action", "requested_by", "requested_on", "outcome", "finished_at")
    list_filter = ("action", "requested_by")
    date_hierarchy = "created_at"
    inlines = [FleetJobTargetInline]
    readonly_fields = ("action", "requested_by", "requested_on", "options", "created_at", "finished_at")

    @admin.display(description="outcome")
    def outcome(self, job: FleetJob) -> str:
        states = [t.state for t in job.targets.all()]
        done, failed = states.count("done"), states.count("error")
        running = len(states) - done - failed
        return f"{done} done, {failed} failed" + (f", {running} running" if running else "")

    def get_queryset(self, request: HttpRequest) -> QuerySet[FleetJob]:
        return super().get_queryset(request).prefetch_related("targets")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: FleetJob | None = None) -> bool:
        return False
