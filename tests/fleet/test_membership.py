"""Our servers find each other in the shared Redis: announced, listed, gone after missed
heartbeats (with when they were last seen), back when they beat again, stopped when they leave."""
from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from engines.fleet.membership import EngineCard, Membership, ServerCard, member_state
from tests.fleet.conftest import REDIS_URL


def card(server: str, engines: int = 1) -> ServerCard:
    return ServerCard(server=server, url=f"http://{server}/", version="test", roles=["engines"], started_at=0.0,
                      engines=[EngineCard(name=f"e{i}", model="demo", backend="cpu", dtype="float32", mode="process",
                                          tracing=True) for i in range(engines)])


@pytest.fixture
async def fleet():
    client = aioredis.from_url(REDIS_URL)
    name = f"test-{uuid.uuid4().hex[:8]}"
    yield client, name
    keys = [k async for k in client.scan_iter(f"fleet:{name}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_members_see_each_other_and_a_silent_one_goes(fleet):
    client, name = fleet
    a, b = Membership(client, name, heartbeat_s=0.3), Membership(client, name, heartbeat_s=0.3)  # gone after 0.45 s
    await a.announce(card("host-a:1", engines=2))
    await b.announce(card("host-b:2"))
    members = {m.card.server: m for m in await a.members()}
    assert set(members) == {"host-a:1", "host-b:2"} and all(m.state == "up" for m in members.values())
    assert [e.name for e in members["host-a:1"].card.engines] == ["e0", "e1"]
    await asyncio.sleep(0.6)   # b misses its beats; a beats on
    await a.announce(card("host-a:1", engines=2))
    members = {m.card.server: m for m in await b.members()}
    assert members["host-a:1"].state == "up" and members["host-b:2"].state == "gone"
    assert members["host-b:2"].age_s >= 0.3
    await b.announce(card("host-b:2"))
    assert {m.card.server: m.state for m in await a.members()}["host-b:2"] == "up"  # back


async def test_a_server_that_leaves_shows_as_stopped_and_the_long_gone_are_forgotten(fleet):
    client, name = fleet
    a = Membership(client, name, heartbeat_s=0.1, forget_after_s=0.5)
    await a.announce(card("host-a:1"))
    await a.leave()
    assert [(m.card.server, m.state) for m in await a.members()] == [("host-a:1", "stopped")]
    await asyncio.sleep(0.6)
    assert await a.members() == []
    assert not await client.exists(f"fleet:{name}:cards")


async def test_the_heartbeat_loop_survives_a_redis_that_does_not_answer(fleet, caplog):
    client, name = fleet
    dead = aioredis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.05)
    task = asyncio.create_task(Membership(dead, name, heartbeat_s=0.05).run(lambda: card("host-x:9")))
    await asyncio.sleep(0.3)
    assert not task.done()
    task.cancel()
    await dead.aclose()
    assert sum("announcing this server" in r.message for r in caplog.records) == 1  # once per outage


def test_a_member_is_gone_at_its_first_missed_beat_plus_the_stated_grace() -> None:
    heartbeat = Membership(None)
    assert (heartbeat.heartbeat_s, heartbeat.grace_s, heartbeat.gone_after_s) == (2.0, 1.0, 3.0)
    assert member_state(2.9, 3.0, stopped=False) == "up"      # a beat late by less than the grace
    assert member_state(3.1, 3.0, stopped=False) == "gone"
    assert member_state(0.0, 3.0, stopped=True) == "stopped"


async def test_a_silent_member_is_gone_one_heartbeat_and_the_grace_after_its_last_beat(fleet):
    client, name = fleet
    a = Membership(client, name, heartbeat_s=1.0)                # gone after 1 s + 0.5 s
    await a.announce(card("host-a:1"))
    assert [m.state for m in await a.members()] == ["up"]
    await asyncio.sleep(1.8)                                     # one beat missed and the grace, not three
    (member,) = await a.members()
    assert member.state == "gone" and member.age_s > a.gone_after_s


async def test_a_server_back_on_its_port_is_the_same_member_with_its_new_card(fleet):
    client, name = fleet
    before = Membership(client, name, heartbeat_s=10)
    await before.announce(card("host-a:8000"))
    await before.leave()
    after = Membership(client, name, heartbeat_s=10)            # the restarted process
    restarted = card("host-a:8000", engines=2).model_copy(update={"started_at": 5.0})
    await after.announce(restarted)
    (member,) = await after.members()
    assert member.state == "up" and member.card.started_at == 5.0 and len(member.card.engines) == 2


async def test_a_server_back_on_its_url_under_another_id_replaces_its_ghost(fleet):
    client, name = fleet
    a = Membership(client, name, heartbeat_s=0.4)                # gone after 0.6 s
    url = "http://10.0.0.5:8000/"
    await a.announce(card("host-a:pid100").model_copy(update={"url": url}))
    await client.hset(f"fleet:{name}:rows", "host-a:pid100", b"{}")
    # Another machine's server on the same loopback URL is another server: not a ghost of it.
    await a.announce(card("host-b:pid7").model_copy(update={"url": url}))
    await asyncio.sleep(0.8)                                      # both gone
    await a.announce(card("host-a:pid200").model_copy(update={"url": url.rstrip("/")}))
    members = {m.card.server: m.state for m in await a.members()}
    assert members == {"host-a:pid200": "up", "host-b:pid7": "gone"}
    for key in ("cards", "rows", "left"):
        assert not await client.hexists(f"fleet:{name}:{key}", "host-a:pid100")
    assert await client.zscore(f"fleet:{name}:beats", "host-a:pid100") is None


async def test_two_live_servers_claiming_one_url_are_both_listed(fleet):
    client, name = fleet
    a = Membership(client, name, heartbeat_s=10)
    for server in ("host-a:pid1", "host-a:pid2"):
        await a.announce(card(server).model_copy(update={"url": "http://h:1"}))
    assert {m.state for m in await a.members()} == {"up"} and len(await a.members()) == 2


async def test_a_member_purged_while_it_lives_is_back_at_its_next_beat(fleet):
    client, name = fleet
    a = Membership(client, name, heartbeat_s=10)
    await a.announce(card("host-a:1"))
    await client.delete(f"fleet:{name}:cards")                    # e.g. its Redis restarted empty
    await a.announce(card("host-a:1"))
    assert [m.card.server for m in await a.members()] == ["host-a:1"]


async def test_a_forgotten_member_leaves_the_rows_too(fleet):
    client, name = fleet
    a = Membership(client, name, heartbeat_s=0.1, forget_after_s=0.3)
    await a.announce(card("host-a:1"))
    await client.hset(f"fleet:{name}:rows", "host-a:1", b"{}")
    await asyncio.sleep(0.4)
    assert await a.members() == []
    assert not await client.exists(f"fleet:{name}:rows")
