"""A fleet loop that retries says an outage once and its end once, however long it lasts: a
server kept open all day must not log a line every sample while Redis or the database is down.
The log itself: tests/server/test_outage_log.py."""
from __future__ import annotations

import asyncio
import logging

import pytest

from engines.fleet.rollups import RollupWriter
from engines.fleet.store import LocalFleetStore


def fleet_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "engines.fleet"]


class FlakyStore(LocalFleetStore):
    """A store whose lease fails while ``down``."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.tries = 0

    async def take_lease(self, what: str, holder: str, ttl_s: float) -> bool:
        self.tries += 1
        if self.down:
            raise ConnectionError("redis: connection refused")
        return False  # another member writes: nothing to sample


async def test_the_rollup_loop_warns_once_through_an_outage_and_says_when_it_is_over(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engines.fleet")
    store = FlakyStore()
    task = asyncio.create_task(RollupWriter(store, "me", sample_s=0.01).run())
    try:
        while store.tries < 10:
            await asyncio.sleep(0.01)
        store.down = False
        tries = store.tries
        while store.tries < tries + 3:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    lines = fleet_lines(caplog)
    assert [level for level, _ in lines] == [logging.WARNING, logging.INFO], lines
    assert "sampling the fleet's rollups failed (redis: connection refused)" in lines[0][1]
    assert "works again" in lines[1][1]
