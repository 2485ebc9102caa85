"""The sizes issue 63 set: no file under ``engines/`` over 600 lines, and ``core/engine.py`` at most
550 (the step and the request life cycle; a feature gets a collaborator in a module of its own).
``BENCHMARKS.md``'s 40 KB is ``scripts/bench_report.py``'s ``MAX_PAGE_BYTES``, held by
``tests/test_bench_report.py``.

A file past its limit is split by concept, one concept a module, not cut at a line.
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINES = REPO / "engines"
MAX_LINES = 600
#: Tighter limits for hubs that features used to land on as more methods.
LIMITS = {"engines/runtime/core/engine.py": 550}
#: Files over their limit now, each with what brings it under. A file not listed fails the test past
#: its limit, and so does a listed one once it is under: then it leaves this list.
KNOWN_OVER: dict[str, str] = {}


def line_counts() -> dict[str, int]:
    """Every file under ``engines/`` (compiled caches aside) by its path from the repository root."""
    return {str(path.relative_to(REPO)): len(path.read_bytes().splitlines())
            for path in sorted(ENGINES.rglob("*"))
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}


def test_no_file_under_engines_is_over_its_limit() -> None:
    counts = line_counts()
    over = {name: n for name, n in counts.items() if n > LIMITS.get(name, MAX_LINES)}
    new = [f"{name}: {n} lines (at most {LIMITS.get(name, MAX_LINES)})" for name, n in over.items()
           if name not in KNOWN_OVER]
    assert not new, "split by concept, one concept a module:\n" + "\n".join(new)
    under = [name for name in KNOWN_OVER if name not in over]
    assert not under, f"under the limit now, strike them from KNOWN_OVER: {under}"


def test_the_limits_name_files_that_exist() -> None:
    counts = line_counts()
    assert "engines/runtime/core/engine.py" in counts and len(counts) > 100
    missing = [name for name in (*LIMITS, *KNOWN_OVER) if name not in counts]
    assert not missing, f"no such file (moved? then move its limit too): {missing}"
