"""The Django side's layers import one way, as the runtime's rooms do (``tests/runtime/test_layering.py``).

- ``engines.profiling`` and ``engines.history`` (what the pages show) import nothing from the
  dashboard, the views or the admin (which show it);
- ``engines.fleet``, ``engines.serving`` and ``engines.disagg`` import nothing from the dashboard,
  the views or the admin either: what they share with the dashboard (the server's identity, the
  engine actions) sits below both (``engines.server.server_identity``, ``engines.engine_actions``);
- a view module imports no other view module, except the API views' base (``engines.views.api``):
  what two views share lives in a module of its own (``engines.serving``, the dashboard's ``frame``);
- ``engines.protocol``, ``engines.serving`` and ``engines.api_routes`` import no Django: the
  request models, the request mapping and the route table stand apart from HTTP;
- ``engines.server`` (the serving process itself: its name, its health, its outage log) imports
  nothing of the project but the runtime's face: the dashboard, the fleet, the history and the
  views all stand on it.

Imports inside functions count: a function-local import hides a layering, it does not make one.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.test_layering import imported_modules

REPO = Path(__file__).resolve().parents[2]
ENGINES = REPO / "engines"

#: The modules that answer requests with pages or JSON.
VIEW_MODULES = sorted(p for p in (ENGINES / "views").glob("*.py") if p.name != "__init__.py") + [
    ENGINES / "dashboard" / name for name in ("pages.py", "timeline.py", "profiles.py")]
API_BASE = "engines.views.api"
#: What shows the history, or serves it over HTTP: the layers above it.
ABOVE_THE_HISTORY = ("engines.dashboard", "engines.views", "engines.admin", "debugsite")
#: What the fleet, the serving layer and the disaggregated router may not reach up to.
SHOWING = ("engines.dashboard", "engines.views", "engines.admin")
#: Django and what comes with it.
DJANGO = ("django", "channels", "daphne", "engines.models", "engines.views", "engines.dashboard", "engines.admin",
          "engines.history")


#: What ``engines.server`` may import of the project: itself and the runtime's face.
BESIDE_THE_SERVER = ("engines.server", "engines.runtime")


def module_of(path: Path) -> str:
    """``engines/views/api.py`` -> ``engines.views.api``."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in ([root] if root.is_file() else root.rglob("*.py")))


def imports_from(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    """The modules ``path`` imports that are ``prefixes`` or below them."""
    return sorted({m for m in imported_modules(path) if any(m == p or m.startswith(p + ".") for p in prefixes)})


def view_modules_imported(path: Path) -> list[str]:
    """The other view modules ``path`` imports, the API base left out."""
    others = tuple(module_of(p) for p in VIEW_MODULES if p != path and module_of(p) != API_BASE)
    return imports_from(path, others)


def relative(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", python_files(ENGINES / "profiling.py", ENGINES / "history"), ids=relative)
def test_the_history_and_the_profiler_import_nothing_that_shows_them(path: Path) -> None:
    assert not imports_from(path, ABOVE_THE_HISTORY), \
        f"{relative(path)} imports {imports_from(path, ABOVE_THE_HISTORY)}: what the pages show sits below them"


@pytest.mark.parametrize("path", python_files(ENGINES / "fleet", ENGINES / "serving", ENGINES / "disagg"), ids=relative)
def test_the_fleet_the_serving_layer_and_the_router_import_nothing_that_shows_them(path: Path) -> None:
    assert not imports_from(path, SHOWING), \
        f"{relative(path)} imports {imports_from(path, SHOWING)}: move what it shares with them below both"


@pytest.mark.parametrize("path", VIEW_MODULES, ids=relative)
def test_a_view_imports_no_other_view_but_the_api_base(path: Path) -> None:
    assert not view_modules_imported(path), \
        f"{relative(path)} imports {view_modules_imported(path)}: give what views share a module of its own"


@pytest.mark.parametrize("path", python_files(ENGINES / "protocol", ENGINES / "serving", ENGINES / "api_routes.py"),
                         ids=relative)
def test_the_protocol_the_serving_layer_and_the_route_table_import_no_django(path: Path) -> None:
    assert not imports_from(path, DJANGO), f"{relative(path)} imports {imports_from(path, DJANGO)}"


def above_the_server(path: Path) -> list[str]:
    """The project's modules ``path`` imports that ``engines.server`` may not."""
    return sorted(m for m in imports_from(path, ("engines",)) if m != "engines"
                  and not any(m == p or m.startswith(p + ".") for p in BESIDE_THE_SERVER))


@pytest.mark.parametrize("path", python_files(ENGINES / "server"), ids=relative)
def test_the_server_package_imports_nothing_that_stands_on_it(path: Path) -> None:
    assert not above_the_server(path), \
        f"{relative(path)} imports {above_the_server(path)}: engines/server/ sits below all but the runtime"


def test_the_checks_see_a_bad_import(tmp_path: Path) -> None:
    """Each rule fails on the import it forbids, at the top of a module or inside a function."""
    bad = tmp_path / "bad.py"
    bad.write_text("import django.http\n\ndef late():\n    from engines.dashboard.messages import ProfileState\n"
                   "    from engines.views import openai\n")
    late = ["engines.dashboard.messages", "engines.dashboard.messages.ProfileState",
            "engines.views", "engines.views.openai"]
    assert imports_from(bad, ABOVE_THE_HISTORY) == late
    assert imports_from(bad, SHOWING) == late
    assert "django.http" in imports_from(bad, DJANGO)
    assert above_the_server(bad) == late
    view = ENGINES / "views" / "debug.py"
    assert module_of(view) == "engines.views.debug" and view in VIEW_MODULES
    copied = tmp_path / "debug.py"
    copied.write_text(view.read_text() + "\nfrom engines.views.openai import chat_completions\n")
    assert view_modules_imported(copied) == ["engines.views.openai", "engines.views.openai.chat_completions"]
    copied.write_text(view.read_text() + "\nfrom engines.views.api import json_body\n")
    assert not view_modules_imported(copied)
