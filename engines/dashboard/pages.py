"""The dashboard's engine pages: the overview, one engine's page, the playground, and the
local login link, in the admin's look.

The pages are rendered once with what does not change (each engine's name, checkpoint and
configuration); everything live arrives over the engine websockets (``consumers``) and is drawn
by the small modules under ``static/engines/js/``. Staff only, like the admin.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import quote

from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth import get_user_model, login
from django.contrib.auth.tokens import default_token_generator
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import urlencode, urlsafe_base64_decode
from django.views.decorators.csrf import csrf_protect

from engines.dashboard.frame import page_context
from engines.dashboard.local_login import LOCAL_USERNAME
from engines.history.outage import OUTAGE_ERRORS
from engines.registry import registry
from engines.server.server_identity import server_id
from engines.views.api import AsyncView, database_unavailable

__all__ = ["engine_facts", "engine_page", "local_login", "overview", "playground", "playground_endpoint"]


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
        "traces_url": _history_url("tracerecord", engine.name),
        "profiles_url": _history_url("profilerecord", engine.name),
        "snapshots_url": _history_url("metricssnapshot", engine.name),
        "config": [
            ("checkpoint", str(checkpoint.path)),
            ("weights", engine.source_format),
            ("weights in memory", weights_in_memory(engine)),
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


def weights_in_memory(engine: Any) -> str:
    """What the engine computes with ("float32", "Q4_1 x210, Q8_0 x1"), and for a GGUF whether that is
    the file's own types or floats made from them at load (``serve --weights-dtype``)."""
    held = engine.weights_format
    if not engine.source_format.startswith("GGUF") or held == "pending":
        return held
    if held in ("float32", "float16"):
        return f"{held}, dequantized from the GGUF at load"
    return f"{held}, as the GGUF holds them (--weights-dtype float32 dequantizes)"


def _history_url(model: str, engine: str) -> str:
    """The admin's list of ``model`` records, filtered to ``engine`` on this server (another
    server's engine of the same name is another engine)."""
    return reverse(f"admin:engines_{model}_changelist") + "?" + urlencode({"engine__exact": engine,
                                                                           "server": server_id()})


LOOPBACK_ADDRESSES = {"127.0.0.1", "::1"}


def local_login(request: HttpRequest, uid: str, token: str) -> HttpResponse:
    """``serve``'s one-time link (``local_login``): sign in as the local staff account and go to
    the dashboard. Only from this machine, only once."""
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


def playground_endpoint(view: AsyncView) -> AsyncView:
    """An OpenAI endpoint for the playground, behind the staff session and CSRF instead of the
    API key: with ``--api-key`` set, the key never has to reach the page."""
    # A view of its own, not functools.wraps: the API view is marked CSRF-exempt, and copying
    # that mark would switch off the check this endpoint exists to make.
    @staff_member_required
    @csrf_protect
    async def staff_endpoint(request: HttpRequest) -> HttpResponseBase:
        return await view(request)

    async def endpoint(request: HttpRequest) -> HttpResponseBase:
        try:
            return await staff_endpoint(request)
        except OUTAGE_ERRORS as exc:  # the staff check reads the session: the API's 503, not the pages'
            return database_unavailable(exc)

    endpoint.__doc__ = f"The playground's {view.__name__}."
    return endpoint


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
    return render(request, "dashboard/engine.html",
                  page_context(request, f"Engine {name}", engine=engine_facts(engine),
                               capture_text=registry.options.capture_text))
