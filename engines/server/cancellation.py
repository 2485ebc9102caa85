"""Keeping a task's cancellation when a library loses it on the way.

A background loop (a fleet member's poller, publisher, heartbeat; a dashboard sampler) runs until
its owner cancels it at shutdown, then is awaited. Two things on this project's Python 3.11 lose
such a cancellation when it arrives just as an awaited call completes: ``asyncio.wait_for``
returns the result instead (CPython gh-86296, fixed in 3.12), and redis-py's asyncio client
(8.1.0) returns the command's reply. The task then runs on with its cancellation spent, and its
owner waits for it forever: a fleet poller so cancelled looped on once in ~10-110 runs of the
polling test under load, and hung the suite (docs/perf-log/ci-time.md#2026-11-29-cpu-seconds).

:func:`within` bounds an await in time without that loss (``asyncio.timeout`` tells its own
expiry from an outside cancel), and :func:`check_cancelled`, called once a turn by a loop that
runs until cancelled, raises the cancellation the task was asked for and never got.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["check_cancelled", "within"]

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float) -> T:
    """``await awaitable``, or ``TimeoutError`` after ``seconds`` (it is cancelled then): as
    ``asyncio.wait_for``, less the lost cancellation."""
    async with asyncio.timeout(seconds):
        return await awaitable


def check_cancelled() -> None:
    """Raise ``CancelledError`` if the running task has been asked to stop (``Task.cancelling``)
    and is still running: a callee swallowed the error that should have stopped it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
