"""URL routes: the dashboard, the OpenAI API, vLLM's utility routes, MLC's debug endpoints, Prometheus metrics
and health, the admin.

``/debug/*`` is always routed but answers 404 unless the server runs with
``--enable-debug`` (checked per request by :func:`engines.views.api.debug_gated`), so the
switch can be set after this module is imported. Which paths are API routes, and which of
them the API-key gate (in front of all of this, in :mod:`debugsite.asgi`) guards, is
:data:`engines.api_routes.API_ROUTES`.
"""
import re

from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from engines.api_routes import API_ROUTES
from engines.views import api, debug, fleet, metrics, microserving, openai, vllm

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="dashboard", permanent=False)),
    # Browsers ask for it on every page; an answer keeps tabs recognisable and the console clean.
    path("favicon.ico", RedirectView.as_view(url=static("engines/favicon.svg"), permanent=True)),
    path("dashboard/", include("engines.dashboard.urls")),
    path("v1/models", openai.list_models, name="v1-models"),
    # "path": served names may hold slashes (a Hugging Face "org/name").
    path("v1/models/<path:model>", openai.retrieve_model, name="v1-model"),
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
    path("debug/list_requests", debug.list_requests, name="debug-list-requests"),
    path("debug/list_incidents", debug.list_incidents, name="debug-list-incidents"),
    path("debug/dump_workload", debug.dump_workload, name="debug-dump-workload"),
    path("debug/abort_request", debug.abort_request, name="debug-abort-request"),
    path("debug/dump_kv_cache", debug.dump_kv_cache, name="debug-dump-kv-cache"),
    # vLLM's control routes (aiperf's defaults), gated and guarded as /debug is.
    path("reset_prefix_cache", debug.reset_prefix_cache, name="reset-prefix-cache"),
    path("start_profile", debug.profile_start, name="start-profile"),
    path("stop_profile", debug.profile_stop, name="stop-profile"),
    path("microserving/prep_recv", microserving.prep_recv, name="microserving-prep-recv"),
    path("microserving/remote_send", microserving.remote_send, name="microserving-remote-send"),
    path("microserving/start_generate", microserving.start_generate, name="microserving-start-generate"),
    path("microserving/kv_release", microserving.kv_release, name="microserving-kv-release"),
    path("metrics", metrics.prometheus_metrics, name="metrics"),
    path("health", metrics.health, name="health"),
    path("stats", metrics.stats, name="stats"),
    path("fleet.json", fleet.fleet_json, name="fleet-json"),
    path("tokenize", vllm.tokenize, name="tokenize"),
    path("detokenize", vllm.detokenize, name="detokenize"),
    path("version", vllm.version, name="version"),
    path("admin/", admin.site.urls),
    # Last: anything else under an API route gets a JSON 404, not Django's HTML page.
    re_path(r"^(?P<path>(%s)/.*)$" % "|".join(re.escape(route.prefix.lstrip("/")) for route in API_ROUTES),
            api.api_not_found, name="api-not-found"),
]
