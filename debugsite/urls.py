"""URL routes: the dashboard, the OpenAI API, MLC's debug endpoints, Prometheus metrics and health, the admin.

``/debug/*`` is always routed but answers 404 unless the server runs with
``--enable-debug`` (checked per request in :mod:`engines.views.debug`), so the
switch can be set after this module is imported. The API-key gate sits in front
of all of this in :mod:`debugsite.asgi`.
"""
from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from engines.views import dashboard, debug, errors, metrics, microserving, openai, timeline

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="dashboard", permanent=False)),
    # Browsers ask for it on every page; an answer keeps tabs recognisable and the console clean.
    path("favicon.ico", RedirectView.as_view(url=static("engines/favicon.svg"), permanent=True)),
    path("dashboard/", dashboard.overview, name="dashboard"),
    path("dashboard/engines/<str:name>/", dashboard.engine_page, name="dashboard-engine"),
    path("dashboard/engines/<str:name>/timeline/", timeline.engine_timeline, name="dashboard-engine-timeline"),
    path("dashboard/engines/<str:name>/trace.json", timeline.engine_trace, name="dashboard-engine-trace"),
    path("dashboard/traces/<int:pk>/timeline/", timeline.trace_timeline, name="dashboard-trace-timeline"),
    path("dashboard/profiles/", include("engines.views.profile_urls")),
    path("dashboard/login/<str:uid>/<str:token>/", dashboard.local_login, name="dashboard-local-login"),
    path("dashboard/playground/", dashboard.playground, name="dashboard-playground"),
    path("dashboard/playground/v1/<path:endpoint>", dashboard.playground_api, name="dashboard-playground-api"),
    path("v1/models", openai.list_models, name="v1-models"),
    path("v1/completions", openai.completions, name="v1-completions"),
    path("v1/chat/completions", openai.chat_completions, name="v1-chat-completions"),
    path("debug/dump_event_trace", debug.dump_event_trace, name="debug-dump-event-trace"),
    path("debug/save_event_trace", debug.save_event_trace, name="debug-save-event-trace"),
    path("debug/dump_engine_metrics", debug.dump_engine_metrics, name="debug-dump-engine-metrics"),
    path("debug/reset_engine", debug.reset_engine, name="debug-reset-engine"),
    path("debug/cuda_profiler_start", debug.cuda_profiler_start, name="debug-cuda-profiler-start"),
    path("debug/cuda_profiler_stop", debug.cuda_profiler_stop, name="debug-cuda-profiler-stop"),
    path("debug/profile_start", debug.profile_start, name="debug-profile-start"),
    path("debug/profile_stop", debug.profile_stop, name="debug-profile-stop"),
    path("microserving/prep_recv", microserving.prep_recv, name="microserving-prep-recv"),
    path("microserving/remote_send", microserving.remote_send, name="microserving-remote-send"),
    path("microserving/start_generate", microserving.start_generate, name="microserving-start-generate"),
    path("microserving/kv_release", microserving.kv_release, name="microserving-kv-release"),
    path("metrics", metrics.prometheus_metrics, name="metrics"),
    path("health", metrics.health, name="health"),
    path("stats", metrics.stats, name="stats"),
    path("admin/", admin.site.urls),
    # Last: anything else under the API prefixes gets a JSON 404, not Django's HTML page.
    re_path(r"^(?P<path>(v1|debug|microserving)/.*)$", errors.api_not_found, name="api-not-found"),
]
