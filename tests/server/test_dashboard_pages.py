"""The dashboard's pages: staff only, in the admin's frame, static files served, the engines listed."""
from __future__ import annotations

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.test import Client
from django.utils.http import urlencode

from engines.server.server_identity import server_id
from tests.server.conftest import TRACED, UNTRACED

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def staff_client(serve) -> Client:
    from django.contrib.auth.models import User

    client = Client()
    client.force_login(User.objects.create_user("staff", password="pw", is_staff=True))
    return client


def test_root_leads_to_the_dashboard_and_anonymous_users_to_the_login(serve) -> None:
    response = Client().get("/")
    assert response.status_code == 302 and response["Location"] == "/dashboard/"
    login = Client().get("/dashboard/")
    assert login.status_code == 302 and login["Location"].startswith("/admin/login/?next=/dashboard/")


def test_the_favicon_is_the_dashboards_icon(serve) -> None:
    from django.contrib.staticfiles import finders

    response = Client().get("/favicon.ico")
    assert response.status_code == 301 and response["Location"].endswith("/engines/favicon.svg")
    icon = finders.find("engines/favicon.svg")
    assert icon and open(icon).read().startswith("<svg")


async def test_the_overview_lists_every_engine_in_the_admins_frame(serve, staff_client: Client) -> None:
    async with serve(enable_debug=True):
        page = await sync_to_async(staff_client.get)("/dashboard/")
    assert page.status_code == 200
    html = page.content.decode()
    assert f'data-engine="{TRACED}"' in html and f'data-engine="{UNTRACED}"' in html
    assert "LLM engine debug server" in html and 'class="breadcrumbs"' in html
    assert "vendor/uplot-1.6.32/uPlot.iife.min.js" in html and "engines/js/overview.js" in html


async def test_an_engine_page_shows_its_configuration_and_an_unknown_one_is_404(serve, staff_client) -> None:
    async with serve(enable_debug=True):
        page = await sync_to_async(staff_client.get)(f"/dashboard/engines/{TRACED}/")
        missing = await sync_to_async(staff_client.get)("/dashboard/engines/nope/")
    html = page.content.decode()
    assert page.status_code == 200 and 'data-ws="/ws/engines/demo/"' in html
    assert "8 layers, hidden 512" in html and "numba version" in html
    # The KV pool as allocated and why (the tests size it by tokens), and what the weights came from.
    assert "2,048 tokens (128 pages of 16), 32 MiB; --max-total-tokens 2048" in html
    assert "<td>safetensors</td>" in html
    assert "weights in memory" in html and "<td>float32</td>" in html
    # Its history: this server's records of the engine (another server's engine of its name is another).
    here = urlencode({"server": server_id()})
    for model in ("tracerecord", "profilerecord", "metricssnapshot"):
        assert f"/admin/engines/{model}/?engine__exact={TRACED}&amp;{here}" in html
    assert missing.status_code == 404


@pytest.mark.parametrize("source, held, shown", [
    ("safetensors", "float32", "float32"),
    ("GGUF F32 x61, Q4_1 x210, Q8_0 x1", "Q4_1 x210, Q8_0 x1",
     "Q4_1 x210, Q8_0 x1, as the GGUF holds them (--weights-dtype float32 dequantizes)"),
    ("GGUF F32 x61, Q4_1 x210, Q8_0 x1", "float32", "float32, dequantized from the GGUF at load"),
    ("GGUF F32 x61, Q4_1 x210, Q8_0 x1", "pending", "pending"),
])
def test_the_engine_page_says_how_a_ggufs_weights_are_held(source: str, held: str, shown: str) -> None:
    from types import SimpleNamespace

    from engines.dashboard.pages import weights_in_memory

    assert weights_in_memory(SimpleNamespace(source_format=source, weights_format=held)) == shown


async def test_untraced_engines_have_their_trace_controls_disabled_with_the_reason(serve, staff_client) -> None:
    async with serve(enable_debug=True):
        html = (await sync_to_async(staff_client.get)(f"/dashboard/engines/{UNTRACED}/")).content.decode()
    assert "Tracing is off for this engine" in html and html.count("disabled") >= 2


async def test_static_files_are_served_by_the_asgi_app_with_debug_off(serve, settings) -> None:
    from debugsite.asgi import application

    settings.DEBUG = False
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://127.0.0.1") as http:
        for path in ("/static/vendor/uplot-1.6.32/uPlot.iife.min.js", "/static/engines/js/engine.js",
                     "/static/admin/css/base.css"):
            response = await http.get(path)
            assert response.status_code == 200, path


def test_the_one_time_link_signs_in_once_and_only_from_this_machine(serve) -> None:
    from engines.dashboard.local_login import local_login_path

    path = local_login_path()
    assert Client(REMOTE_ADDR="192.0.2.9").get(path).status_code == 403  # another machine
    browser = Client(REMOTE_ADDR="127.0.0.1")
    response = browser.get(path)
    assert response.status_code == 302 and response["Location"] == "/dashboard/"
    assert browser.get("/dashboard/").status_code == 200  # signed in, as staff
    again = Client(REMOTE_ADDR="127.0.0.1").get(path)
    assert again.status_code == 403 and "was used already" in again.content.decode()
    assert Client().get(path.replace(path.split("/")[-2], "forged-token")).status_code == 403
    assert Client(REMOTE_ADDR="127.0.0.1").get(local_login_path()).status_code == 302  # a new link works


async def test_admin_records_link_back_to_their_engines_dashboard(serve) -> None:
    from django.contrib.auth.models import User

    from engines.history import asave_metrics_snapshot, asave_trace

    staff_client = Client()
    await sync_to_async(staff_client.force_login)(
        await sync_to_async(User.objects.create_superuser)("boss", "b@example.com", "pw"))
    from engines.models import MetricsSnapshot, TraceRecord
    from tests.history.trace_builder import serving_trace

    record = await asave_trace(serving_trace(engine=TRACED, num_requests=1), engine=TRACED, model="demo")
    gone = await asave_trace(serving_trace(engine="retired", num_requests=1), engine="retired", model="demo")
    await asave_metrics_snapshot(TRACED, "demo", {"num_running_requests": 0})
    snapshot = await MetricsSnapshot.objects.aget(engine=TRACED)
    async with serve(enable_debug=True):
        pages = [(await sync_to_async(staff_client.get)(f"/admin/engines/{kind}/{pk}/change/")).content.decode()
                 for kind, pk in (("tracerecord", record.pk), ("metricssnapshot", snapshot.pk),
                                  ("tracerecord", gone.pk))]
    for page in pages[:2]:
        assert f'href="/dashboard/engines/{TRACED}/"' in page, page[page.find("dashboard"):][:300]
    assert "not served by this server now" in pages[2]
    assert await TraceRecord.objects.acount() == 2


async def test_the_playground_needs_the_session_and_csrf_not_the_api_key(serve) -> None:
    from django.contrib.auth.models import User

    browser = Client(enforce_csrf_checks=True)
    await sync_to_async(browser.force_login)(await sync_to_async(User.objects.create_user)(
        "player", password="pw", is_staff=True))
    body = {"model": TRACED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "debug_config": {"ignore_eos": True}}  # the demo's random weights may end early
    async with serve(enable_debug=True, api_key="secret-key"):
        page = await sync_to_async(browser.get)("/dashboard/playground/")
        assert page.status_code == 200 and "secret-key" not in page.content.decode()
        token = browser.cookies["csrftoken"].value
        post = sync_to_async(browser.post)
        no_csrf = await post("/dashboard/playground/v1/chat/completions", body, content_type="application/json")
        assert no_csrf.status_code == 403
        ok = await post("/dashboard/playground/v1/chat/completions", body, content_type="application/json",
                        HTTP_X_CSRFTOKEN=token)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        unknown = await post("/dashboard/playground/v1/embeddings", body, content_type="application/json",
                             HTTP_X_CSRFTOKEN=token)
        assert unknown.status_code == 404
        anonymous = await sync_to_async(Client().post)("/dashboard/playground/v1/chat/completions", body,
                                                       content_type="application/json")
        assert anonymous.status_code == 302  # to the login page


async def test_a_request_page_shows_a_request_live_then_where_its_time_went(serve) -> None:
    """Reached from the engine page's tables: while the request runs, its live row; once it has
    ended, its waterfall and diagnosis from the engine (as its client's ``usage.extra`` had them);
    a request the engine and the history do not hold is a 404."""
    import asyncio

    from django.contrib.auth.models import User
    from django.test import AsyncClient
    from django.utils.html import escape

    from engines.registry import registry

    browser = AsyncClient()
    await browser.aforce_login(await User.objects.acreate(username="staff-r", is_staff=True))
    async with serve(enable_debug=True) as http:
        engine = registry.get(TRACED)
        await engine.reset()
        running = asyncio.ensure_future(http.post("/v1/completions", json={
            "model": TRACED, "prompt": "hi", "max_tokens": 400, "user": "slow/one",
            "debug_config": {"ignore_eos": True}}))
        try:
            for _ in range(200):
                if any(r.request_id == "slow/one" for r in (await engine.live_requests()).requests):
                    break
                await asyncio.sleep(0.02)
            live = await browser.get(f"/dashboard/engines/{TRACED}/requests/slow%2Fone/")
            html = live.content.decode()
            assert live.status_code == 200, html
            assert 'data-where="live"' in html and "In the engine now" in html and "engines/js/request_page.js" in html
        finally:
            done = await running
        extra = done.json()["usage"]["extra"]
        ended = await browser.get(f"/dashboard/engines/{TRACED}/requests/slow/one/")
        html = ended.content.decode()
        assert ended.status_code == 200 and 'data-where="ended"' in html and "request_page.js" not in html
        assert f"{extra['end_to_end_latency_s']:.3f} s" in html
        for phase, seconds in extra["time_breakdown"].items():
            assert (f'<tr data-phase="{phase}">' in html) == (seconds > 0), phase
        assert all(escape(sentence) in html for sentence in extra["diagnosis"])
        missing = await browser.get(f"/dashboard/engines/{TRACED}/requests/never-sent/")
        assert missing.status_code == 404
        assert (await browser.get("/dashboard/engines/nope/requests/x/")).status_code == 404
        await engine.reset()
