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

:func:`install_cache_locators` puts the locators that do this before numba's own (in
``CacheImpl``'s list, numba's hook for them); numba picks a function's locator when the function
is decorated, so the packages that hold compiled functions (``model``, and ``telemetry``'s modules
that do) call it first.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from numba.core import caching

__all__ = ["RUNTIME", "compiled_sources_digest", "install_cache_locators"]

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


class RuntimeUserProvidedCacheLocator(_RuntimeSourcesStamp, caching.UserProvidedCacheLocator):
    """numba's locator for ``NUMBA_CACHE_DIR``, stamped with the runtime's digest."""


class RuntimeInTreeCacheLocator(_RuntimeSourcesStamp, caching.InTreeCacheLocator):
    """numba's locator for a module's ``__pycache__``, stamped with the runtime's digest."""


def install_cache_locators() -> None:
    """Put the runtime's locators first in numba's list (once), in numba's own order."""
    locators = caching.CacheImpl._locator_classes
    for cls in (RuntimeInTreeCacheLocator, RuntimeUserProvidedCacheLocator):
        if cls not in locators:
            locators.insert(0, cls)
