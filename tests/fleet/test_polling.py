"""Polling an attached server over real HTTP: its readings land in the store; a redirect, a
wrong type or silence is an error that says so; and of several members, one polls at a time."""
from __future__ import annotations

import asyncio
import io
import httpx

from engines.fleet.board import ForeignTarget
from engines.fleet.polling import ForeignPoller, ForeignPolling
from engines.fleet.store import LocalFleetStore
from tests.fleet.fake_server import FakeServer


def every_tasks_stack() -> str:
    """Each task of the running loop with where it waits: what a hang is read from."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        out.write(f"{task!r}\n")
        task.print_stack(limit=20, file=out)
    return out.getvalue()


async def test_a_poll_stores_the_servers_rows_and_errors_say_what_went_wrong(server: FakeServer) -> None:
    local = LocalFleetStore()
    target = ForeignTarget("foreign-1", "gpu-1", server.url)
    async with httpx.AsyncClient() as client:
        poller = ForeignPoller(local, "me", target, client)
        reading = await poller.poll_once()
        assert reading.error is None and reading.kind.value == "vllm"
        (row,) = (await local.all_foreign())["foreign-1"].rows
        assert row.figures["running"] == 4 and row.kind == "vllm" and row.state == "up"
        server.behaviour = "redirect"
        assert "redirects to http://elsewhere/metrics" in (await poller.poll_once()).error
        server.behaviour = "html"
        assert "text/html, not Prometheus text" in (await poller.poll_once()).error
        stored = (await local.all_foreign())["foreign-1"]
        assert stored.error and stored.rows[0].state == "unreachable"
    server.http.shutdown()
    server.http.server_close()
    async with httpx.AsyncClient() as client:
        reading = await ForeignPoller(local, "me", target, client).poll_once()
    assert reading.error == "/metrics could not be read: ConnectError: All connection attempts failed"


async def test_of_two_members_one_polls_a_server_at_a_time(server: FakeServer, store) -> None:
    target = ForeignTarget("foreign-7", "gpu-7", server.url, interval_s=0.5)
    members = [ForeignPolling(store, holder, lambda: [target]) for holder in ("m1", "m2")]
    tasks = [asyncio.create_task(m.run()) for m in members]
    try:
        await asyncio.sleep(2.1)
    finally:
        for task in tasks:
            task.cancel()
        # Bounded, and with every task's stack if it is not: once, under a full suite's load, the
        # members did not finish (the worker idle, its Redis connections quiet) and the run hung.
        _, pending = await asyncio.wait(tasks, timeout=30)
        assert not pending, every_tasks_stack()
    # One member's poller every 0.5 s for ~2 s: about 5 polls, not twice that.
    assert 3 <= server.polls <= 6
    assert (await asyncio.wait_for(store.all_foreign(), 30))["foreign-7"].rows[0].figures["running"] == 4
