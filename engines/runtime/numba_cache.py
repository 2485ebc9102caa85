"""numba's disk cache for the runtime's compiled functions, keyed by all of their sources at once.

numba keys a cached function by its own source file alone. A function that calls one of another
file compiles that callee into itself (inlined or linked), so after an edit or an upgrade that
changes only the callee's file, the caller's cache entry still holds the callee's old code, and
runs it, until the caller's own file changes. The runtime's compiled functions call across files
everywhere (the compiled step holds most kernels; the interleaved kernels quantize with
``quantized_dot``'s), so a function here is keyed by every runtime source that holds or calls
compiled code (every file that mentions numba): an edit to any of them retires every cached
function, which compiles again on first use, or up front at a server's start
(``frontend.precompile``, whose stamp is keyed by the sources too).

Where: ``NUMBA_CACHE_DIR`` when it is set (the tests' and CI's own cache), else one folder per
user and digest, ``<cache root>/kernels/<digest>/`` (:func:`kernel_cache_dir`), shared by every
checkout of the same sources on the machine: a second clone, a worktree or a new virtualenv at the
same commit starts warm, where numba's own place (each source folder's ``__pycache__``) made every
checkout compile everything again (a cold start's 100 s and more on two cores). Entries inside are
keyed by signature and CPU (numba's index holds the target's name and features), so machines that
share a home folder keep theirs apart. :func:`prune_kernel_caches` drops the folders of sources
no longer in use. Where that folder cannot be written, a module's ``__pycache__`` serves as before.

:func:`install_cache_locators` puts the locators that do this before numba's own (in
``CacheImpl``'s list, numba's hook for them); numba picks a function's locator when the function
is decorated, so the packages that hold compiled functions (``model``, and ``telemetry``'s modules
that do) call it first.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from numba.core import caching, config

from engines.runtime.cache_root import default_cache_root

__all__ = ["RUNTIME", "compiled_sources_digest", "install_cache_locators", "kernel_cache_dir",
           "prune_kernel_caches"]

#: The runtime package: the functions under it are keyed by :func:`compiled_sources_digest`.
RUNTIME = Path(__file__).resolve().parent


def compiled_sources_digest(root: Path) -> bytes:
    """A SHA-256 of every ``*.py`` under ``root`` that mentions numba (paths and contents)."""
    digest = hashlib.sha256()
    for source in sorted(root.rglob("*.py")):
        text = source.read_bytes()
        if b"numba" in text:
            digest.update(source.relative_to(root).as_posix().encode())
            digest.update(text)
    return digest.digest()


@functools.cache
def _runtime_digest() -> bytes:
    return compiled_sources_digest(RUNTIME)


class _RuntimeSourcesStamp:
    """A locator for functions under :data:`RUNTIME` whose source stamp is the runtime's digest."""

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> Any:  # noqa: ANN401 - numba's locator
        if not Path(py_file).resolve().is_relative_to(RUNTIME):
            return None
        return super().from_function(py_func, py_file)  # type: ignore[misc]

    def get_source_stamp(self) -> bytes:
        return _runtime_digest()


def _numba_cache_dir() -> str:
    """``NUMBA_CACHE_DIR`` as numba read it at import ("" when unset)."""
    return str(getattr(config, "CACHE_DIR", ""))


def _shared_root() -> Path:
    return default_cache_root() / "kernels"


def kernel_cache_dir() -> Path:
    """The folder the runtime's compiled functions are cached in: ``NUMBA_CACHE_DIR`` if set,
    else the shared folder of these sources (``<cache root>/kernels/<digest>``)."""
    if _numba_cache_dir():
        return Path(_numba_cache_dir()).expanduser()
    return _shared_root() / _runtime_digest().hex()[:16]


def prune_kernel_caches(keep: int = 4) -> list[Path]:
    """Remove the shared folders of other sources but the ``keep`` last used (the current one is
    never removed); the removed folders. Nothing with ``NUMBA_CACHE_DIR`` set."""
    if _numba_cache_dir():
        return []
    current = kernel_cache_dir()
    try:
        others = [p for p in _shared_root().iterdir() if p.is_dir() and p != current]
    except FileNotFoundError:
        return []
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    removed = others[max(0, keep - 1):]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


class RuntimeUserProvidedCacheLocator(_RuntimeSourcesStamp, caching.UserProvidedCacheLocator):
    """numba's locator for ``NUMBA_CACHE_DIR``, stamped with the runtime's digest."""


class RuntimeSharedCacheLocator(_RuntimeSourcesStamp, caching._SourceFileBackedLocatorMixin,
                                caching._CacheLocator):
    """The shared folder of these sources (:func:`kernel_cache_dir`), each source folder under
    it by its path inside the runtime (not the checkout's), stamped with the runtime's digest."""

    def __init__(self, py_func: Any, py_file: str) -> None:  # noqa: ANN401 - numba's locator
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        inside = Path(py_file).resolve().parent.relative_to(RUNTIME)
        self._cache_path = os.fspath(kernel_cache_dir() / inside)

    def get_cache_path(self) -> str:
        return self._cache_path

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> Any:  # noqa: ANN401 - numba's locator
        if _numba_cache_dir():
            return None  # NUMBA_CACHE_DIR's locator
        return super().from_function(py_func, py_file)


class RuntimeInTreeCacheLocator(_RuntimeSourcesStamp, caching.InTreeCacheLocator):
    """numba's locator for a module's ``__pycache__``, stamped with the runtime's digest (where
    the shared folder cannot be written)."""


def install_cache_locators() -> None:
    """Put the runtime's locators first in numba's list (once), in this order:
    ``NUMBA_CACHE_DIR``'s, the shared folder's, a module's ``__pycache__``."""
    locators = caching.CacheImpl._locator_classes
    for cls in (RuntimeInTreeCacheLocator, RuntimeSharedCacheLocator, RuntimeUserProvidedCacheLocator):
        if cls not in locators:
            locators.insert(0, cls)
