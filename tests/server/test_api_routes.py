"""The API's routes are declared once (``engines.api_routes``): the URLconf serves nothing
outside the site's pages that the table does not cover, and every route in it is served, guarded
as it says, and answers an unknown path under it in the API's error shape."""
from __future__ import annotations

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from engines.api_routes import API_ROUTES, api_route
from engines.auth import is_protected
from tests.server.conftest import assert_error

#: The site's own routes (the dashboard, the admin, the root's redirect, the favicon).
SITE = ("", "favicon.ico", "dashboard/", "admin/")


def served_paths() -> list[str]:
    """The URLconf's top-level routes, as paths (``/v1/models``), the site's and the JSON 404 left out."""
    paths = []
    for entry in get_resolver().url_patterns:
        if isinstance(entry, URLPattern) and entry.name == "api-not-found":
            continue
        route = str(entry.pattern)
        if route not in SITE:
            assert isinstance(entry, URLPattern | URLResolver)
            paths.append("/" + route)
    return paths


def test_every_served_api_path_is_under_a_declared_route() -> None:
    paths = served_paths()
    assert paths and all(api_route(path) is not None for path in paths), \
        [path for path in paths if api_route(path) is None]
    for route in API_ROUTES:
        assert any(route.covers(path) for path in paths), f"{route.prefix} serves nothing"


def test_the_gate_guards_what_the_table_says() -> None:
    assert [route.prefix for route in API_ROUTES if not route.needs_key] == ["/health"]
    for route in API_ROUTES:
        assert is_protected(route.prefix + "/anything") is route.needs_key
    assert not is_protected("/v1x") and not is_protected("/dashboard/") and api_route("/v1x") is None


@pytest.mark.parametrize("route", API_ROUTES, ids=lambda r: r.prefix)
async def test_an_unknown_path_under_a_route_is_a_json_404(client, route) -> None:
    response = await client.get(route.prefix + "/no-such-endpoint")
    assert "No endpoint GET" in assert_error(response, 404)["message"]
