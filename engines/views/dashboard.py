"""The dashboard's pages: the engines overview and one engine's page, in the admin's look.

The pages are rendered once with what does not change (each engine's name, checkpoint and
configuration); everything live arrives over the engine websockets (``engines.consumers``) and
is drawn by the small modules under ``static/engines/js/``. Staff only, like the admin.
"""
from __future__ import annotations

import platform
from urllib.parse import quote
from typing import Any

from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase
from django.views.decorators.csrf import csrf_protect
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import urlencode

from engines import __version__
from engines.registry import registry
from engines.views import openai as openai_views


def engine_facts(engine: Any) -> dict[str, Any]:
    """What a page shows of an engine that does not change while it runs."""
    checkpoint, config = engine.checkpoint, engine.config
    model = checkpoint.config
    return {
        "name": engine.name,
        "checkpoint": str(checkpoint.path),
        # What the engine runs, in a few words: the checkpoint's own name and its weights' format.
        "model_name": f"{checkpoint.name} · {engine.source_format.split(' ')[0]}",
        "url": reverse("dashboard-engine", args=[engine.name]),
        "ws": "/ws/engines/" + quote(engine.name, safe="") + "/",
        "backend": engine.backend_name,
        "dtype": engine.dtype,
        "mode": "own process" if engine.process else "server thread",
        "tracing": engine.tracing_enabled,
        "traces_url": reverse("admin:engines_tracerecord_changelist") + "?" + urlencode({"engine__exact": engine.name}),
        "profiles_url": reverse("admin:engines_profilerecord_changelist") + "?" + urlencode({"engine__exact": engine.name}),
        "snapshots_url": (reverse("admin:engines_metricssnapshot_changelist") + "?"
                          + urlencode({"engine__exact": engine.name})),
        "config": [
            ("checkpoint", str(checkpoint.path)),
            ("weights", engine.source_format),
            ("architecture", f"{model.model_type}: {model.num_hidden_layers} layers, hidden {model.hidden_size}, "
                             f"{model.num_attention_heads} heads / {model.num_key_value_heads} KV heads, "
                             f"head dim {model.head_dim}, intermediate {model.intermediate_size}"),
            ("vocabulary", f"{model.vocab_size} tokens"),
            ("context", f"{model.max_position_embeddings} positions"),
            ("backend / dtype", f"{engine.backend_name} / {engine.dtype}"),
            ("engine loop", "own process" if engine.process else "server thread"),
            ("KV cache", engine.kv_cache.describe() if engine.kv_cache else "not allocated yet (starting)"),
            ("max sequences", str(config.max_num_seqs)),
            ("step token budget", str(config.prefill_chunk_size)),
            ("prefix cache", "on" if config.enable_prefix_cache else "off"),
            ("tracing", f"on (at most {config.max_trace_events:,} events)" if engine.tracing_enabled else "off"),
        ],
    }


def page_context(request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
    """What every dashboard page renders with: the admin's frame (header, sidebar), its title,
    the versions in the footer, and ``extra``."""
    import numba

    versions = [("server", __version__), ("numba", numba.__version__), ("python", platform.python_version())]
    return {**admin.site.each_context(request), "title": title, "versions": versions, **extra}


LOOPBACK_ADDRESSES = {"127.0.0.1", "::1"}


def local_login(request: HttpRequest, uid: str, token: str) -> HttpResponse:
    """``serve``'s one-time link (``engines.dashboard.local_login``): sign in as the local staff
    account and go to the dashboard. Only from this machine, only once."""
    from django.contrib.auth import get_user_model, login
    from django.contrib.auth.tokens import default_token_generator
    from django.utils.http import urlsafe_base64_decode

    from engines.dashboard.local_login import LOCAL_USERNAME

    user = None
    try:
        user = get_user_model().objects.get(pk=int(urlsafe_base64_decode(uid)), username=LOCAL_USERNAME)
    except (ValueError, TypeError, OverflowError, get_user_model().DoesNotExist):
        pass
    if (user is None or request.META.get("REMOTE_ADDR") not in LOOPBACK_ADDRESSES
            or not default_token_generator.check_token(user, token)):
        return render(request, "dashboard/login_link_used.html",
                      page_context(request, "This login link does not work"), status=403)
    login(request, user, backend="django.contrib.auth.backends.ModelBackend")
    return redirect("dashboard")


@staff_member_required
def playground(request: HttpRequest) -> HttpResponse:
    """``/dashboard/playground/``: chat with an engine (or complete a prompt), watch the answer stream
    with its logprobs and metrics, and take the request away as curl."""
    context = page_context(request, "Playground", engines=[engine_facts(engine) for engine in registry],
                           debug_enabled=registry.options.enable_debug,
                           # Only whether a key is set, never the key: its "Copy as curl" then adds the header.
                           api_key_required=registry.options.api_key is not None)
    return render(request, "dashboard/playground.html", context)


PLAYGROUND_ENDPOINTS = {"chat/completions": openai_views.chat_completions, "completions": openai_views.completions}


@staff_member_required
@csrf_protect
async def playground_api(request: HttpRequest, endpoint: str) -> HttpResponseBase:
    """The OpenAI endpoints for the playground, behind the staff session and CSRF instead of the
    API key: with ``--api-key`` set, the key never has to reach the page."""
    view = PLAYGROUND_ENDPOINTS.get(endpoint)
    if view is None:
        raise Http404(f"no endpoint {endpoint!r}")
    return await view(request)


@staff_member_required
def overview(request: HttpRequest) -> HttpResponse:
    """``/dashboard/``: every served engine, live."""
    context = page_context(request, "Engines", engines=[engine_facts(engine) for engine in registry])
    return render(request, "dashboard/overview.html", context)


@staff_member_required
def engine_page(request: HttpRequest, name: str) -> HttpResponse:
    """``/dashboard/engines/<name>/``: one engine's charts, metrics, configuration and controls."""
    engine = registry.get(name)
    if engine is None:
        raise Http404(f"No engine {name!r} is served here.")
    return render(request, "dashboard/engine.html", page_context(request, f"Engine {name}", engine=engine_facts(engine)))
