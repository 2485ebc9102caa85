"""engines.server.cancellation: a bound in time that keeps a cancellation, and a loop that ends though a
callee swallowed its cancellation."""
from __future__ import annotations

import asyncio

import pytest

from engines.server.cancellation import check_cancelled, within


async def test_a_cancel_that_comes_as_the_awaited_thing_finishes_is_not_lost() -> None:
    """The race Python 3.11's wait_for loses (it returns the result; the cancelled task runs on)."""
    done = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(within(done, 10))
    await asyncio.sleep(0)  # the task now waits on the future
    done.set_result("ready")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_it_returns_the_result_or_times_out_and_cancels_what_it_awaited() -> None:
    assert await within(asyncio.sleep(0, "ready"), 10) == "ready"
    slow = asyncio.create_task(asyncio.sleep(60))
    with pytest.raises(TimeoutError):
        await within(slow, 0.05)
    assert slow.cancelled()


async def test_a_loop_that_checks_each_turn_ends_though_a_callee_swallowed_its_cancel() -> None:
    """As redis-py's client returns a reply that came with the cancel: without the check the loop
    would run on, and whoever awaits it would wait forever."""
    async def call_that_swallows_a_cancel() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "reply"
        return "late"

    turns = 0

    async def loop() -> None:
        nonlocal turns
        while True:
            check_cancelled()
            turns += 1
            await call_that_swallows_a_cancel()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)
    task.cancel()
    _, pending = await asyncio.wait([task], timeout=5)
    assert not pending and task.cancelled() and turns == 1
