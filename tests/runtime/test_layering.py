"""The runtime's rooms import one way, and everything outside them goes through the face.

``frontend -> core -> model -> kernels``; ``telemetry`` is used by all and uses none; nothing
under ``engines/runtime`` imports Django or ``engines.protocol``; code outside the runtime and
its tests imports ``engines.runtime`` itself, never a room.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "engines" / "runtime"

# Room -> rooms it may import (besides itself).
ALLOWED = {
    "model": {"telemetry"},
    "core": {"model", "telemetry"},
    "frontend": {"core", "model", "telemetry"},
    "telemetry": set(),
}


def imported_modules(path: Path) -> list[str]:
    """Every absolute module a file imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def room_of(path: Path) -> str | None:
    parts = path.relative_to(RUNTIME).parts
    return parts[0] if len(parts) > 1 else None


def runtime_files() -> list[Path]:
    return sorted(RUNTIME.rglob("*.py"))


@pytest.mark.parametrize("path", runtime_files(), ids=lambda p: str(p.relative_to(RUNTIME)))
def test_a_room_imports_only_the_rooms_below_it(path: Path) -> None:
    room = room_of(path)
    for module in imported_modules(path):
        assert not module.startswith(("django", "engines.protocol", "engines.views", "engines.history")), \
            f"{path.name} imports {module}: the runtime stays free of the Django app"
        if room is None or not module.startswith("engines.runtime."):
            continue
        target = module.split(".")[2]
        if target != room and target in ALLOWED:
            assert target in ALLOWED[room], f"{room}/{path.name} imports {module}: {room} may not use {target}"


def outside_files() -> list[Path]:
    roots = [REPO / "engines", REPO / "debugsite", REPO / "bench", REPO / "scripts"]
    return sorted(p for root in roots if root.exists() for p in root.rglob("*.py")
                  if RUNTIME not in p.parents and ".venv" not in p.parts)


def test_code_outside_the_runtime_imports_only_its_face() -> None:
    offenders = [f"{p.relative_to(REPO)}: {m}" for p in outside_files() for m in imported_modules(p)
                 if m.startswith("engines.runtime.")
                 # ``from engines.runtime import X`` also lists ``engines.runtime.X``: a name, fine
                 and not (m.count(".") == 2 and m.split(".")[2] not in {"model", "core", "frontend", "telemetry"})]
    assert not offenders, "import the runtime through engines.runtime:\n" + "\n".join(offenders)


def test_the_layering_check_sees_a_bad_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from engines.runtime.frontend.async_engine import AsyncEngine\nimport django.conf\n")
    assert "engines.runtime.frontend.async_engine" in imported_modules(bad)
    assert "django.conf" in imported_modules(bad)


def test_every_public_name_resolves() -> None:
    import engines.runtime as runtime

    for name in runtime.__all__:
        assert getattr(runtime, name) is not None, name
    with pytest.raises(AttributeError):
        runtime.NoSuchThing  # noqa: B018


def test_importing_the_face_and_the_protocol_side_stays_cheap() -> None:
    """What the server's protocol layer needs loads without numba or the model."""
    code = ("import sys; from engines.runtime import SamplingParams, GenerationRequest, FinishReason, "
            "REQUEST_LIMITS; print('numba' in sys.modules, 'engines.runtime.model.llama' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
