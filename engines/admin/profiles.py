"""The profile records' admin: filter by engine, server, backend and date; open one's page (the
dashboard's, ``engines.dashboard.profiles``), download it, compare two, verify their payloads."""
from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import urlencode

from engines.admin.cells import engine_dashboard_link, note_cell, when_cell
from engines.admin.large_tables import IndexedValuesFilter
from engines.admin.payloads import PayloadRecordAdmin
from engines.admin.servers import ServerColumn, ServerFilter
from engines.models import ProfileRecord

__all__ = ["ProfileRecordAdmin"]


@admin.register(ProfileRecord)
class ProfileRecordAdmin(ServerColumn, PayloadRecordAdmin[ProfileRecord]):
    """Saved profiles: filter by engine, backend and date; open one's page, download it, compare two."""

    list_display = ("profile_label", "engine_and_backend", "server_column", "captured", "duration", "steps",
                    "kernel_calls", "stopped_by", "note_start", "links")
    list_display_links = ("profile_label",)
    list_filter = (("engine", IndexedValuesFilter), ServerFilter, "backend", "captured_at", "source")
    search_fields = ("engine", "model", "note")
    ordering = ("-captured_at", "-id")
    show_facets = admin.ShowFacets.NEVER
    actions = ("compare_two", "verify_payloads")
    fields = ("engine", "engine_dashboard", "server_column", "model", "backend", "device", "source", "captured_at",
              "duration", "steps", "kernel_calls", "stopped_by", "stack_samples", "payload_size", "payload_check",
              "page", "download", "note")
    readonly_fields = tuple(f for f in fields if f != "note")
    # Nor the kernel table: the list and the record's page show its totals only.
    deferred_fields = ("payload", "kernels")

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
        return when_cell(obj.captured_at, obj.get_source_display())

    @admin.display(description="note")
    def note_start(self, obj: ProfileRecord) -> str:
        return note_cell(obj.note)

    @admin.display(description="open")
    def links(self, obj: ProfileRecord) -> str:
        return format_html('<a href="{}">profile</a> <a href="{}">.json.gz</a>',
                           reverse("dashboard-profile", args=[obj.pk]),
                           reverse("dashboard-profile-download", args=[obj.pk]))

    @admin.display(description="dashboard")
    def engine_dashboard(self, obj: ProfileRecord) -> str:
        return engine_dashboard_link(obj, obj.engine)

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
