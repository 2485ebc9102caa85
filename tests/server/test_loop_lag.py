"""The event loop's lag monitor (engines.server.loop_lag): a stalled loop shows in its histogram and summary."""
from __future__ import annotations

import asyncio
import time

from engines.server.loop_lag import LoopLagMonitor


async def test_a_stalled_loop_shows_as_lag() -> None:
    monitor = LoopLagMonitor(interval_s=0.02)
    monitor.start()
    await asyncio.sleep(0.2)  # probes on an idle loop: each a few ms late at most
    quiet = monitor.summary()
    time.sleep(0.3)  # the loop held, as a blocking call in a view would hold it
    await asyncio.sleep(0.1)
    await monitor.stop()
    assert not monitor.running
    figures = monitor.summary()
    assert quiet["probes"] >= 3 and quiet["max_ms"] < 250
    assert figures["max_ms"] >= 250 and figures["max_ms_1m"] >= 250
    cumulative = dict(monitor.histogram().cumulative())
    assert cumulative[0.25] == figures["probes"] - 1  # the one stalled probe is past 250 ms, the others not
    assert cumulative[float("inf")] == figures["probes"]


async def test_start_twice_runs_one_probe() -> None:
    monitor = LoopLagMonitor(interval_s=0.01)
    monitor.start()
    task = monitor._task
    monitor.start()
    assert monitor._task is task
    await monitor.stop()
