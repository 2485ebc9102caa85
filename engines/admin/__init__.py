"""The Django admin of the trace and metrics history, one module per admin.

``traces`` (trace records: list, detail, compare, downloads, retention), ``request_summaries``
(every request of every trace), ``metrics_snapshots`` (one server's engine charted above their
list), ``profiles`` (profile records; their pages are the dashboard's). ``payloads`` is what the
trace and profile admins share (the stored payload: deferred, shown, verified on request),
``large_tables`` the counting, filtering and sorting that keep the lists fast on 1,000,000 rows,
``cells`` how values print, ``servers`` the server that wrote a record (each list's column and
filter). ``fleet``: the attached foreign servers and the audit of the jobs run across the fleet;
``incidents``: the watchdog's stall incidents, each with its evidence laid out and as one download;
``workloads``: saved workloads, their replays onto servers by URL, and the regression report of two runs.
Staff only; what a user may do follows Django's view / change / delete permissions.
"""
from django.contrib import admin

# Importing the modules registers their admins (Django's autodiscover imports this package).
from engines.admin import (fleet, incidents, metrics_snapshots, profiles, request_summaries,  # noqa: F401
                           traces, workloads)

# The admin is the dashboard's frame: its header names the product, not the framework.
admin.site.site_header = "LLM engine debug server"
admin.site.site_title = "LLM engine debug server"
admin.site.index_title = "History and administration"
admin.site.site_url = "/dashboard/"  # "View site": the live dashboard
