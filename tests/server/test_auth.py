"""The API-key gate: which routes it guards, what a refusal looks like, and that /health stays open."""
from __future__ import annotations

import httpx
import pytest

from debugsite.asgi import application
from engines.auth import bearer_token, is_protected, key_matches
from tests.server.conftest import TRACED, assert_error

KEY = "s3cret-key"

GUARDED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions",
     {"model": TRACED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("POST", "/v1/completions", {"model": TRACED, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/debug/dump_engine_metrics", {}),
    ("POST", "/debug/reset_engine", {"model": TRACED}),
    ("GET", "/metrics", None),
    ("POST", "/microserving/prep_recv", {}),
]


@pytest.mark.parametrize("method,path,body", GUARDED)
@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic czNjcmV0LWtleQ==", f"bearer  {KEY}x", "Bearer"])
async def test_guarded_routes_refuse_a_missing_or_wrong_key(serve, method, path, body, header) -> None:
    headers = {"Authorization": header} if header else {}
    async with serve(api_key=KEY) as http:
        response = await http.request(method, path, json=body, headers=headers)
    error = assert_error(response, 401)
    assert "Authorization: Bearer" in error["message"]
    assert error["type"] == "authentication_error"
    assert response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize("method,path,body", GUARDED[:-1])
async def test_guarded_routes_accept_the_key(serve, method, path, body) -> None:
    async with serve(api_key=KEY) as http:
        response = await http.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("method,path,body", GUARDED[:-1])
async def test_a_root_path_does_not_bypass_the_key(serve, method, path, body) -> None:
    """Daphne takes ``root_path`` from the client's ``Daphne-Root-Path`` header, and Django
    routes on the path with the root path removed: ``/x/v1/models`` with root path ``/x`` is
    ``/v1/models``, and must need the key as much as ``/v1/models`` itself."""
    async with serve(api_key=KEY):
        transport = httpx.ASGITransport(app=application, root_path="/x")
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            refused = await http.request(method, "/x" + path, json=body)
            accepted = await http.request(method, "/x" + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert_error(refused, 401)
    assert accepted.status_code == 200, accepted.text


async def test_health_needs_no_key(serve) -> None:
    async with serve(api_key=KEY) as http:
        response = await http.get("/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"
    assert {e["state"] for e in response.json()["engines"].values()} == {"running"}


async def test_no_key_configured_means_open(serve) -> None:
    async with serve(api_key=None) as http:
        assert (await http.get("/v1/models")).status_code == 200


def test_prefixes_match_whole_segments() -> None:
    assert is_protected("/v1") and is_protected("/v1/models") and is_protected("/metrics")
    assert is_protected("/debug/reset_engine") and is_protected("/microserving/prep_recv")
    assert not is_protected("/v1models") and not is_protected("/health") and not is_protected("/admin/")
    assert not is_protected("/metricsx")


def test_bearer_parsing_and_compare() -> None:
    assert bearer_token([(b"authorization", b"Bearer abc")]) == b"abc"
    assert bearer_token([(b"Authorization", b"bearer   abc ")]) == b"abc"
    assert bearer_token([(b"authorization", b"Basic abc")]) is None
    assert bearer_token([]) is None
    assert key_matches(b"abc", "abc") and not key_matches(b"abd", "abc") and not key_matches(None, "abc")


async def test_api_refuses_a_foreign_host_header(serve) -> None:
    """ALLOWED_HOSTS still guards the API (against DNS rebinding to a key-less loopback server)."""
    async with serve(api_key=None) as http:
        response = await http.get("/v1/models", headers={"Host": "evil.example"})
        error = assert_error(response, 400)  # in the error shape, saying what to do, not Django's HTML page
        assert "'evil.example'" in error["message"] and "ALLOWED_HOSTS" in error["message"]
        assert (await http.get("/v1/models", headers={"Host": "localhost:8000"})).status_code == 200
