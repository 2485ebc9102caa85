"""One kernel body compiled twice (threaded and single-threaded), each with a cache of its own.

numba's on-disk cache names a compiled function by its Python function (qualified name and
first line) and keys its entries by signature alone, not by ``parallel``: two ``njit`` variants
of one Python function share one cache entry, and whichever compiled first is what both load
from then on (the single-threaded variant silently ran threaded, or the reverse). A copy of the
function under another name gets a cache entry of its own.
"""
from __future__ import annotations

import types
from typing import Callable


def renamed(func: Callable, name: str) -> Callable:
    """``func`` as a new Python function called ``name`` (same code, globals and defaults)."""
    copy = types.FunctionType(func.__code__.replace(co_name=name), func.__globals__, name, func.__defaults__,
                              func.__closure__)
    copy.__qualname__ = name
    copy.__doc__ = func.__doc__
    copy.__module__ = func.__module__
    return copy
