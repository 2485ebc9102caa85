"""Every package under ``engines/`` names each of its modules in its docstring, so that a reader
who opens the package's face finds every room of it, and a module added without a word there
fails here.

Covered: every package below ``engines/`` found on disk (``admin``, ``dashboard``, ``disagg``,
``fleet``, ``history``, ``management`` and ``management/commands``, ``otel``, ``protocol``,
``serving``, ``views``, and any added later), except the runtime's, whose rooms
``docs/architecture.md`` maps and ``tests/runtime/test_layering.py`` holds, Django's generated
``migrations``, and ``engines`` itself, the app, whose modules ``docs/architecture.md`` names.
A module counts as named when the docstring holds it as a literal: ``name``, ``name.py``, a
dotted path ending in it, or ``:mod:`` of one.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ENGINES = Path(__file__).resolve().parents[1] / "engines"
#: Below ``engines/``, what the test leaves out (see the module's docstring).
LEFT_OUT = ("runtime", "migrations")


def packages(root: Path = ENGINES) -> list[Path]:
    """Every package below ``root`` (not ``root`` itself), outside :data:`LEFT_OUT`."""
    return sorted(init.parent for init in root.rglob("__init__.py")
                  if init.parent != root and init.parent.relative_to(root).parts[0] not in LEFT_OUT)


def modules_of(package: Path) -> list[str]:
    """The package's modules and subpackages, by the name an import gives them."""
    files = [path.stem for path in package.glob("*.py") if path.name != "__init__.py"]
    folders = [path.name for path in package.iterdir() if (path / "__init__.py").is_file()]
    return sorted(files + folders)


def unnamed_modules(package: Path) -> list[str]:
    """The modules of ``package`` that its ``__init__.py`` docstring does not name."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""

    def named(name: str) -> bool:
        name = re.escape(name)
        return re.search(rf"``(?:[\w.]+\.)?{name}(?:\.py)?``|:mod:`~?(?:[\w.]+\.)?{name}`", doc) is not None

    return [name for name in modules_of(package) if not named(name)]


@pytest.mark.parametrize("package", packages(), ids=lambda path: path.relative_to(ENGINES.parent).as_posix())
def test_a_package_names_every_module_in_its_docstring(package: Path) -> None:
    assert unnamed_modules(package) == [], f"name them in {package.relative_to(ENGINES.parent)}/__init__.py"


def test_the_packages_the_docstring_says_are_covered() -> None:
    covered = {path.relative_to(ENGINES).as_posix() for path in packages()}
    assert {"admin", "dashboard", "disagg", "fleet", "history", "management", "management/commands", "otel",
            "protocol", "serving", "views"} <= covered
    assert not any(name.startswith(LEFT_OUT) for name in covered)


def test_the_check_sees_a_module_left_unnamed(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text('"""``a`` and ``pkg.c``; b and the sub are named in prose only."""\n')
    for name in ("a", "b", "c"):
        (package / f"{name}.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    assert unnamed_modules(package) == ["b", "sub"]
    assert packages(tmp_path) == [package, package / "sub"]
