"""The server that wrote a history record, as every history admin shows and filters it: servers
sharing a database keep their histories apart (``engines.models.ServerRecord``).

Rows saved before records named their server hold ``""``: they read "unknown" in the list and
are the filter's "unknown (saved before servers were recorded)" choice (``?server=-``).
"""
from __future__ import annotations

from django.contrib import admin
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from engines.admin.large_tables import distinct_values
from engines.models import UNRECORDED, UNRECORDED_SERVER_TEXT, ServerRecord

__all__ = ["UNRECORDED_PARAMETER", "ServerColumn", "ServerFilter", "server_cell", "server_choice"]

#: The filter's value for rows saved before records named their server ("" reads as no filter).
UNRECORDED_PARAMETER = "-"


def server_choice(server: str) -> str:
    """The filter's (and the charts' select's) value for ``server``."""
    return server or UNRECORDED_PARAMETER


def server_cell(record: ServerRecord) -> str:
    """A list cell: the server, its fleet below it; "unknown" (its reason in the tooltip) for a
    row saved before records named their server."""
    if record.server == UNRECORDED:
        return format_html('<span class="engines-quiet" title="{}">unknown</span>', UNRECORDED_SERVER_TEXT)
    fleet = format_html('<span class="engines-quiet">fleet {}</span>', record.fleet) if record.fleet else ""
    # A narrow column breaks host:port after the colon, not inside the port.
    host, colon, port = record.server.rpartition(":")
    shown = format_html("{}:<wbr>{}", host, port) if colon else record.server
    return format_html('<span class="engines-server">{}</span>{}', shown, fleet)


class ServerFilter(admin.SimpleListFilter):
    """The servers that wrote the list's rows, listed through the ``(server, ...)`` index
    (``large_tables.distinct_values``); the parameter is ``server``, as the dashboard's links use."""

    title = "server"
    parameter_name = "server"
    #: The model whose index lists the servers: the admin's own, unless a subclass names another.
    listed_from: type[models.Model] | None = None

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        servers = distinct_values(self.listed_from or model_admin.model, "server")
        return [(server_choice(s), s or UNRECORDED_SERVER_TEXT) for s in servers]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if not value:
            return queryset
        return queryset.filter(server=UNRECORDED if value == UNRECORDED_PARAMETER else value)



class ServerColumn:
    """A history admin's ``server_column``: the list's server column and a record page's server."""

    @admin.display(description="server", ordering="server")
    def server_column(self, record: ServerRecord) -> str:
        return server_cell(record)
