"""Database calls from async code leave no connection on their worker thread (engines.server.db_calls):
a connection left there goes stale when PostgreSQL restarts and fails the next call on that thread."""
from __future__ import annotations

import threading

import pytest
from django.db import connections

from engines.server import db_calls


async def test_every_call_closes_its_threads_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[int] = []
    monkeypatch.setattr(connections, "close_all", lambda: closed.append(threading.get_ident()))

    def works() -> int:
        return threading.get_ident()

    def fails() -> None:
        raise RuntimeError("the database went away")

    ident = await db_calls.in_db_thread(works)()
    assert ident != threading.get_ident()  # a worker thread, not the event loop's
    with pytest.raises(RuntimeError, match="went away"):
        await db_calls.in_db_thread(fails)()
    assert len(closed) == 2 and closed[0] == ident  # closed on the thread that used it, failure or not


def test_the_fleet_and_the_history_use_it() -> None:
    """Every background database call of the server goes through in_db_thread (one unguarded
    call is enough to poison a pool thread)."""
    import inspect

    from engines.fleet import attach, controls, rollups, service
    from engines.history import capture, profiles

    for module in (attach, controls, rollups, service, capture, profiles):
        source = inspect.getsource(module)
        assert "thread_sensitive=False" not in source, module.__name__
