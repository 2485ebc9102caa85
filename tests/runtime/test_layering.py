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


@pytest.mark.parametrize("path", sorted((RUNTIME / "core").rglob("*.py")), ids=lambda p: str(p.relative_to(RUNTIME)))
def test_core_asks_the_backend_about_the_device(path: Path) -> None:
    """``core`` serves a model on whatever computes it: device queries (name, bandwidth, the CUDA
    profiler) are the backend's (``model/backend/``), so nothing in ``core`` imports numba.cuda."""
    offenders = [m for m in imported_modules(path) if m == "numba.cuda" or m.startswith("numba.cuda.")]
    assert not offenders, f"core/{path.name} imports {offenders}: ask the model's backend instead"


def test_the_quantized_formats_know_no_file_reader() -> None:
    """``model/quant`` (ggml's formats: types, dequantization, the kept-quantized layouts) lies
    below ``model/gguf`` (the file reader): the reader builds on the formats, never the other way."""
    reader = "engines.runtime.model.gguf"
    files = sorted((RUNTIME / "model" / "quant").rglob("*.py"))
    assert len(files) >= 4, "model/quant is where the quantized formats live"
    offenders = [f"quant/{path.name}: {m}" for path in files for m in imported_modules(path)
                 if m == reader or m.startswith(reader + ".")]
    assert not offenders, "the quantized formats import the GGUF reader:\n" + "\n".join(offenders)


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


def module_name(path: Path, root: Path = REPO) -> str:
    """``engines.runtime.core.engine`` for ``engines/runtime/core/engine.py`` (a package's ``__init__``:
    the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(paths: list[Path], root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the modules among ``paths`` it imports: at the top, under ``if TYPE_CHECKING:`` or
    inside a function alike (an import for an annotation, or one made late, still closes a circle)."""
    modules = {module_name(path, root): path for path in paths}
    return {name: {m for m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}


def import_circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Each group of modules that reach one another through their imports, sorted."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for module in graph[todo.pop()] - seen:
                seen.add(module)
                todo.append(module)
        reach[start] = seen
    return sorted({tuple(sorted(m for m in reach[start] if start in reach[m]))
                   for start in graph if start in reach[start]})


# Circles not closed yet, each with what closes it. Any other circle fails the test, and so does one
# of these once it is gone: then it leaves this list.
KNOWN_CIRCLES: dict[tuple[str, ...], str] = {}


def test_runtime_modules_import_no_circle() -> None:
    """No two runtime modules import each other, directly or round a ring, not even for an annotation:
    a type two modules share lives one module below both (``forward_batch``, ``trace_window``)."""
    circles = {circle: ", ".join(circle) for circle in import_circles(import_graph(runtime_files()))}
    new = [text for circle, text in circles.items() if circle not in KNOWN_CIRCLES]
    assert not new, "runtime modules that import one another (move what they share one module down):\n" \
        + "\n".join(new)
    closed = [circle for circle in KNOWN_CIRCLES if circle not in circles]
    assert not closed, f"closed now, strike them from KNOWN_CIRCLES: {closed}"


def test_the_circle_check_sees_an_annotation_only_circle(tmp_path: Path) -> None:
    room = tmp_path / "room"
    room.mkdir()
    (room / "upper.py").write_text("from room.lower import Low\n")
    (room / "lower.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                   "    from room.upper import High\n")
    (room / "apart.py").write_text("import room.lower\n")
    graph = import_graph(sorted(room.glob("*.py")), root=tmp_path)
    assert graph == {"room.apart": {"room.lower"}, "room.lower": {"room.upper"}, "room.upper": {"room.lower"}}
    assert import_circles(graph) == [("room.lower", "room.upper")]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]


def test_every_public_name_resolves() -> None:
    import engines.runtime as runtime

    for name in runtime.__all__:
        assert getattr(runtime, name) is not None, name
    with pytest.raises(AttributeError):
        runtime.NoSuchThing  # noqa: B018


def test_the_face_declares_its_names_to_type_checkers() -> None:
    """The face's ``if TYPE_CHECKING:`` imports (what mypy and IDEs see) are its public names, each
    from the module it resolves from at run time."""
    import engines.runtime as runtime

    tree = ast.parse((RUNTIME / "__init__.py").read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    declared = {alias.name: node.module.removeprefix("engines.runtime.") for node in block.body
                if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
    assert declared == runtime._EXPORTS


def test_importing_the_face_and_the_protocol_side_stays_cheap() -> None:
    """What the server's protocol layer needs loads without numba or the model."""
    code = ("import sys; from engines.runtime import SamplingParams, GenerationRequest, FinishReason, "
            "REQUEST_LIMITS; print('numba' in sys.modules, 'engines.runtime.model.llama' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
