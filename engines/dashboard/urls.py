"""The dashboard's routes, under ``/dashboard/``: the engine pages, the timeline, the profiles
and the playground (whose API is the OpenAI views' own, behind the staff session)."""
from __future__ import annotations

from django.urls import path

from engines.dashboard import fleet, fleet_history, pages, profiles, request_page, timeline
from engines.views import openai

urlpatterns = [
    path("", pages.overview, name="dashboard"),
    path("engines/<str:name>/", pages.engine_page, name="dashboard-engine"),
    path("fleet/", fleet.fleet_page, name="dashboard-fleet"),
    path("fleet/attach/", fleet.fleet_attach, name="dashboard-fleet-attach"),
    path("fleet/servers/<int:pk>/detach/", fleet.fleet_detach, name="dashboard-fleet-detach"),
    path("fleet/history/", fleet_history.fleet_history, name="dashboard-fleet-history"),
    path("fleet/jobs/", fleet.fleet_job_submit, name="dashboard-fleet-jobs"),
    path("fleet/jobs/<int:pk>.json", fleet.fleet_job, name="dashboard-fleet-job"),
    path("fleet/jobs/<int:pk>/trace.json", fleet.fleet_job_trace, name="dashboard-fleet-job-trace"),
    path("fleet/jobs/<int:pk>/timeline/", fleet.fleet_job_timeline, name="dashboard-fleet-job-timeline"),
    path("engines/<str:name>/requests/<path:request_id>/", request_page.request_page, name="dashboard-request"),
    path("engines/<str:name>/timeline/", timeline.engine_timeline, name="dashboard-engine-timeline"),
    path("engines/<str:name>/trace.json", timeline.engine_trace, name="dashboard-engine-trace"),
    path("traces/<int:pk>/timeline/", timeline.trace_timeline, name="dashboard-trace-timeline"),
    path("traces/<int:pk>/data.json", timeline.trace_data, name="dashboard-trace-data"),
    path("traces/<int:pk>/requests.json", timeline.trace_requests, name="dashboard-trace-requests"),
    path("profiles/compare/", profiles.profile_compare, name="dashboard-profile-compare"),
    path("profiles/<int:pk>/", profiles.profile_page, name="dashboard-profile"),
    path("profiles/<int:pk>/data.json", profiles.profile_data, name="dashboard-profile-data"),
    path("profiles/<int:pk>/profile.json.gz", profiles.profile_download, name="dashboard-profile-download"),
    path("profiles/<int:pk>/trace.json", profiles.profile_trace, name="dashboard-profile-trace"),
    path("profiles/<int:pk>/timeline/", profiles.profile_timeline, name="dashboard-profile-timeline"),
    path("login/<str:uid>/<str:token>/", pages.local_login, name="dashboard-local-login"),
    path("playground/", pages.playground, name="dashboard-playground"),
    path("playground/v1/chat/completions", pages.playground_endpoint(openai.chat_completions),
         name="dashboard-playground-chat-completions"),
    path("playground/v1/completions", pages.playground_endpoint(openai.completions),
         name="dashboard-playground-completions"),
]
