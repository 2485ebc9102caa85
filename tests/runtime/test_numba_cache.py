"""The runtime's compiled functions are cached under a stamp of all of their sources
(``numba_cache``): an edit to a callee's file retires its callers' cache entries, which numba's
own stamp (the function's own file) does not."""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from numba.core.caching import NullCache
from numba.core.registry import CPUDispatcher

import engines.runtime
from engines.runtime import numba_cache

REPO = Path(__file__).resolve().parents[2]

CALLER = """from numba import njit
from callee import value

@njit(cache=True)
def caller():
    return value() + 1
"""
CALLEE = """from numba import njit

@njit
def value():
    return {value}
"""
# Run in a fresh process: the caller's result, and whether numba compiled it or read its cache.
RUN = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "runtime":
    from engines.runtime import numba_cache
    numba_cache.RUNTIME = Path(sys.argv[1])
    numba_cache.install_cache_locators()
from caller import caller
result = caller()
print(json.dumps([result, len(caller.stats.cache_misses) > 0]))
"""


def run_caller(folder: Path, locators: str, cache: Path) -> tuple[int, bool]:
    return run_in(folder, locators, {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)})


def run_in(folder: Path, locators: str, env: dict[str, str]) -> tuple[int, bool]:
    done = subprocess.run([sys.executable, "-c", RUN, str(folder), locators], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result, compiled = json.loads(done.stdout.strip().splitlines()[-1])
    return result, compiled


def test_an_edit_to_a_callee_retires_its_callers_cache_entry(tmp_path: Path) -> None:
    for locators in ("numba", "runtime"):
        folder = tmp_path / locators
        folder.mkdir()
        (folder / "caller.py").write_text(CALLER)
        (folder / "callee.py").write_text(CALLEE.format(value=1))
        cache = tmp_path / f"cache-{locators}"
        assert run_caller(folder, locators, cache) == (2, True)
        assert run_caller(folder, locators, cache) == (2, False)  # from the cache
        (folder / "callee.py").write_text(CALLEE.format(value=10))
        got = run_caller(folder, locators, cache)
        if locators == "numba":
            assert got == (2, False), "numba's own stamp: the caller's stale entry, the callee's old code"
        else:
            assert got == (11, True)


def test_checkouts_of_the_same_sources_share_one_kernel_cache(tmp_path: Path) -> None:
    """Without NUMBA_CACHE_DIR, two copies of the sources in other folders (two clones, a
    worktree) share the user's cache folder: the second starts warm; an edit to one gets a
    folder of its own, and the other stays warm."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env |= {"ENGINES_CACHE_DIR": str(tmp_path / "home-cache"), "PYTHONPATH": str(REPO)}
    first, second = tmp_path / "clone-a" / "runtime", tmp_path / "clone-b" / "runtime"
    for folder in (first, second):
        folder.mkdir(parents=True)
        (folder / "caller.py").write_text(CALLER)
        (folder / "callee.py").write_text(CALLEE.format(value=1))
    assert run_in(first, "runtime", env) == (2, True)
    assert run_in(second, "runtime", env) == (2, False)  # the first clone's entry
    assert not (second / "__pycache__").exists() or not any((second / "__pycache__").glob("*.nbi"))
    (second / "callee.py").write_text(CALLEE.format(value=10))
    assert run_in(second, "runtime", env) == (11, True)
    assert run_in(first, "runtime", env) == (2, False)
    folders = sorted(p.name for p in (tmp_path / "home-cache" / "kernels").iterdir())
    assert len(folders) == 2 and all(len(name) == 16 for name in folders)


def test_pruning_keeps_the_current_folder_and_the_last_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINES_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(numba_cache.config, "CACHE_DIR", "")
    current = numba_cache.kernel_cache_dir()
    current.mkdir(parents=True)
    old = []
    for age in range(5):
        folder = tmp_path / "kernels" / f"old-{age}"
        folder.mkdir()
        os.utime(folder, (1_000_000 - age, 1_000_000 - age))
        old.append(folder)
    os.utime(current, (0, 0))  # the oldest mtime, still kept
    removed = numba_cache.prune_kernel_caches(keep=3)
    assert sorted(removed) == sorted(old[2:])
    assert current.exists() and old[0].exists() and old[1].exists()
    monkeypatch.setattr(numba_cache.config, "CACHE_DIR", str(tmp_path / "own"))
    assert numba_cache.prune_kernel_caches(keep=1) == [] and old[0].exists()
    assert numba_cache.kernel_cache_dir() == tmp_path / "own"


def test_the_digest_covers_every_file_that_mentions_numba(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "a.py").write_text("from numba import njit\n")
    (tmp_path / "b.py").write_text("import numba\n")
    (tmp_path / "c.py").write_text("import json\n")
    first = numba_cache.compiled_sources_digest(tmp_path)
    (tmp_path / "c.py").write_text("import json  # edited\n")
    assert numba_cache.compiled_sources_digest(tmp_path) == first  # holds no compiled code
    (tmp_path / "kernels" / "a.py").write_text("from numba import njit  # edited\n")
    second = numba_cache.compiled_sources_digest(tmp_path)
    assert second != first
    (tmp_path / "b.py").write_text("import numba  # edited\n")
    assert numba_cache.compiled_sources_digest(tmp_path) not in (first, second)


def cached_dispatchers() -> list[tuple[str, CPUDispatcher]]:
    """Every cached compiled function of the runtime's modules (the made steps included)."""
    found = []
    for module in pkgutil.walk_packages(engines.runtime.__path__, "engines.runtime."):
        loaded = importlib.import_module(module.name)
        for name, value in vars(loaded).items():
            if isinstance(value, CPUDispatcher) and value.__module__ == module.name \
                    and not isinstance(value._cache, NullCache):
                found.append((f"{module.name}.{name}", value))
    return found


def test_every_cached_function_of_the_runtime_is_stamped_by_all_its_sources() -> None:
    found = cached_dispatchers()
    names = {name for name, _ in found}
    assert {"engines.runtime.model.kernels.interleaved_dot.interleaved_dot_rows_cpu",
            "engines.runtime.telemetry.profiler.streams_sum",
            "engines.runtime.model.cpu_step.decode_step_cpu"} <= names
    assert len(found) > 40
    for name, dispatcher in found:
        locator = dispatcher._cache._impl.locator
        assert isinstance(locator, (numba_cache.RuntimeInTreeCacheLocator, numba_cache.RuntimeSharedCacheLocator,
                                    numba_cache.RuntimeUserProvidedCacheLocator)), name
        assert locator.get_source_stamp() == numba_cache.compiled_sources_digest(numba_cache.RUNTIME), name
