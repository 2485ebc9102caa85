"""Database work from async code, on a worker thread that never keeps a connection.

``sync_to_async(..., thread_sensitive=False)`` runs a call on a pool thread that outlives it;
a connection that thread opened stays open, unchecked, since only requests' own threads get
Django's ``close_old_connections``. After PostgreSQL restarts, the next call that lands on
that thread fails on the dead connection ("terminating connection due to administrator
command"), whatever it is: the soak (``bench/soak.py``) saw a metrics snapshot fail 40 s after
the database was back because the fleet's last read had left a connection on that thread.
:func:`in_db_thread` closes the thread's connections after every call, so each call starts on a
fresh one (a connect on loopback costs ~1 ms; these calls run seconds apart).
"""
from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import connections

__all__ = ["closing_connections", "in_db_thread"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def closing_connections(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """``func``, closing the calling thread's database connections after it returns or raises."""
    @functools.wraps(func)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return func(*args, **kwargs)
        finally:
            connections.close_all()
    return run


def in_db_thread(func: Callable[_P, _R]) -> Callable[_P, Awaitable[_R]]:
    """``func`` as a coroutine function run on a worker thread with a connection of its own for the call."""
    return sync_to_async(closing_connections(func), thread_sensitive=False)
