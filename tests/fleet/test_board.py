"""The fleet view: members and attached servers from the store, rows of ours and theirs side by
side, quantities a server lacks left as "not exported", and fleet totals whose percentiles come
from each engine's own buckets (never from percentiles, never from buckets summed by bound)."""
from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import orjson
import pytest

from engines.fleet.board import ForeignTarget, fleet_totals, fleet_view
from engines.fleet.foreign import ForeignReader, reading_rows
from engines.fleet.membership import EngineCard, ServerCard
from engines.fleet.quantiles import fleet_quantile
from engines.fleet.rows import EngineRow, EngineWeights, ServerRows, WindowHistogram
from engines.fleet.store import LocalFleetStore, RedisFleetStore
from tests.fleet import foreign_expositions as expo


def card(server: str) -> ServerCard:
    return ServerCard(server=server, url=f"http://{server}", version="t", roles=["engines"], started_at=0.0,
                      engines=[EngineCard(name="demo", model="demo", backend="cpu", dtype="float32",
                                          mode="process", tracing=False)])


def histogram(bounds: tuple[float, ...], values: np.ndarray) -> WindowHistogram:
    cumulative = [float(np.sum(values <= b)) for b in bounds] + [float(values.size)]
    return WindowHistogram(bounds=list(bounds), cumulative=cumulative)


def row(server: str, ttft: WindowHistogram | None = None, **figures: float) -> EngineRow:
    return EngineRow(server=server, engine="demo", model="demo", state="running", at=0.0, figures=figures,
                     windows={"ttft": ttft} if ttft else {})


def test_a_window_histogram_round_trips_its_buckets_without_infinity_in_json() -> None:
    h = histogram((0.1, 1.0), np.array([0.05, 0.5, 5.0]))
    assert "Infinity" not in h.model_dump_json() and "inf" not in h.model_dump_json()
    back = WindowHistogram.model_validate_json(h.model_dump_json()).buckets()
    assert back == ((0.1, 1.0), (1.0, 2.0), (math.inf, 3.0))
    assert WindowHistogram.of(back) == h


def test_fleet_totals_sum_rates_and_take_percentiles_from_each_engines_own_buckets() -> None:
    rng = np.random.default_rng(0)
    fast = rng.uniform(0.002, 0.05, 400)     # a vLLM-like server: buckets from 1 ms
    slow = rng.uniform(0.3, 3.0, 100)        # an SGLang-like server: buckets from 100 ms
    rows = [row("a", histogram(expo.VLLM_TTFT, fast), running=3, waiting=1, prompt_tokens=100.0,
                generation_tokens=50.0),
            row("b", histogram(expo.SGLANG_TTFT, slow), running=2, waiting=0, prompt_tokens=10.0,
                generation_tokens=None)]  # type: ignore[arg-type]
    totals = fleet_totals(rows, servers_up=2)
    assert (totals.running, totals.waiting, totals.prompt_tokens, totals.generation_tokens) == (5, 1, 110.0, 50.0)
    p50, p99 = totals.quantiles["ttft_p50"], totals.quantiles["ttft_p99"]
    everything = np.concatenate([fast, slow])
    for got, q in ((p50, 50), (p99, 99)):
        true = float(np.percentile(everything, q))
        assert got.count == 500
        assert got.low <= true <= got.high  # the interval the buckets allow holds the true value
        assert got.value == fleet_quantile(q / 100, [r.windows["ttft"].buckets() for r in rows]).value
    # Summing the two bucket sets by bound (what a PromQL sum by (le) does) lands elsewhere: the
    # 400 fast requests fall below SGLang's first bound, so their p50 is not 0.1 s.
    assert p50.value < 0.06
    assert totals.quantiles["itl_p50"].value is None and totals.quantiles["itl_p50"].count == 0


async def test_the_view_lists_members_with_their_rows_and_marks_a_silent_one_gone(store) -> None:
    await store.announce(card("a:1"))
    await store.announce(card("b:2"))
    await store.put_rows(ServerRows(server="a:1", at=1.0, rows=[row("a:1", running=2, waiting=0)]))
    await store.put_rows(ServerRows(server="b:2", at=1.0, rows=[row("b:2", running=5, waiting=1)]))
    view = await fleet_view(store, [])
    assert view.shared and {s.server: s.state for s in view.servers} == {"a:1": "up", "b:2": "up"}
    assert (view.heartbeat_s, view.grace_s) == (0.4, 0.2)  # what the page states: gone after 0.6 s
    assert view.totals.running == 7 and view.totals.servers_up == 2
    await asyncio.sleep(0.25 * 3 + 0.2)      # b stops beating; a goes on
    await store.announce(card("a:1"))
    view = await fleet_view(store, [])
    states = {s.server: s for s in view.servers}
    assert states["a:1"].state == "up" and states["b:2"].state == "gone"
    assert states["b:2"].age_s > 0.6 and states["b:2"].last_seen is not None
    assert view.totals.running == 2  # a gone server's last rows stay listed, out of the totals
    assert {r.server for r in view.rows} == {"a:1", "b:2"}
    await store.announce(card("b:2"))       # back
    assert {s.state for s in (await fleet_view(store, [])).servers} == {"up"}


async def test_each_engine_of_ours_links_to_its_page_on_its_own_server(store) -> None:
    router = EngineCard(name="router", model="", backend="router", dtype="", mode="thread", tracing=True)
    with_router = card("a:1").model_copy(update={"url": "http://10.0.0.1:8000/", "engines": [*card("a:1").engines,
                                                                                             router]})
    await store.announce(with_router)
    await store.announce(card("b:2").model_copy(update={"url": ""}))
    servers = {s.server: s for s in (await fleet_view(store, [ForeignTarget("foreign-1", "v", "http://v")])).servers}
    assert servers["a:1"].engine_pages == {"demo": "http://10.0.0.1:8000/dashboard/engines/demo/"}  # no router page
    assert servers["b:2"].engine_pages == {} and servers["foreign-1"].engine_pages == {}


async def test_each_engine_of_ours_says_the_weights_it_computes_with(store) -> None:
    """The weights in memory travel in each engine's card (a GGUF kept in its types, or float32) with
    what the file holds; a server whose cards do not say (an older one) and a router's lane show none."""
    router = EngineCard(name="router", model="", backend="router", dtype="", mode="thread", tracing=True)
    kept = EngineCard(name="smollm2", model="SmolLM2-135M-Instruct.Q4_1", backend="cpu", dtype="float32",
                      mode="process", tracing=False, weights="GGUF F32 x61, Q4_1 x210, Q8_0 x1",
                      weights_in_memory="Q4_1 x210, Q8_0 x1")
    floats = EngineCard(name="demo", model="demo", backend="cpu", dtype="float32", mode="process", tracing=False,
                        weights="safetensors", weights_in_memory="float32")
    await store.announce(card("a:1").model_copy(update={"engines": [kept, floats, router]}))
    await store.announce(card("b:2"))
    servers = {s.server: s for s in (await fleet_view(store, [])).servers}
    assert servers["a:1"].engine_weights == {
        "smollm2": EngineWeights(in_memory="Q4_1 x210, Q8_0 x1", stored="GGUF F32 x61, Q4_1 x210, Q8_0 x1"),
        "demo": EngineWeights(in_memory="float32", stored="safetensors")}
    assert servers["b:2"].engine_weights == {}


def test_a_servers_card_says_what_each_engine_holds_its_weights_as() -> None:
    """``server_card`` reads them off the served engines (``weights_format``, ``source_format``)."""
    from types import SimpleNamespace

    from engines.fleet.service import server_card
    from engines.registry import ServerOptions, registry

    engine = SimpleNamespace(name="smollm2", checkpoint=SimpleNamespace(name="SmolLM2-135M-Instruct.Q4_1"),
                             backend_name="cpu", dtype="float32", process=True, tracing_enabled=False, kv_cache=None,
                             source_format="GGUF F32 x61, Q4_1 x210, Q8_0 x1", weights_format="Q4_1 x210, Q8_0 x1")
    registry.replace([engine], ServerOptions())  # type: ignore[list-item]
    try:
        (served,) = server_card().engines
    finally:
        registry.replace([], ServerOptions())
    assert (served.weights, served.weights_in_memory) == ("GGUF F32 x61, Q4_1 x210, Q8_0 x1", "Q4_1 x210, Q8_0 x1")


async def test_foreign_rows_keep_not_exported_and_an_unreachable_server_says_why(store) -> None:
    reader = ForeignReader()
    reader.read(expo.llama_cpp(prompt_tokens=100), now=0.0)
    reading = reader.read(expo.llama_cpp(prompt_tokens=300), now=2.0)
    await store.put_foreign("foreign-1", reading_rows("foreign-1", reading))
    broken = ForeignReader().read("this is not metrics {", now=0.0)
    await store.put_foreign("foreign-2", reading_rows("foreign-2", broken))
    targets = [ForeignTarget("foreign-1", "llama", "http://l:8080"), ForeignTarget("foreign-2", "bad", "http://b"),
               ForeignTarget("foreign-3", "new", "http://n", kind="vllm")]
    view = await fleet_view(store, targets)
    servers = {s.server: s for s in view.servers}
    assert servers["foreign-1"].state == "up" and servers["foreign-1"].kind == "llama.cpp"
    assert "profile_start" in servers["foreign-1"].missing_controls
    assert servers["foreign-2"].state == "unreachable" and "not metrics text" in servers["foreign-2"].error
    assert servers["foreign-3"].state == "waiting"     # attached, not polled yet
    (llama,) = [r for r in view.rows if r.server == "foreign-1"]
    assert llama.figures["prompt_tokens"] == pytest.approx(100.0)
    assert "ttft" in llama.not_exported and "ttft_p50" not in llama.figures
    assert view.totals.servers_up == 1 and view.totals.prompt_tokens == pytest.approx(100.0)


async def test_a_lease_goes_to_one_member_and_passes_on_when_it_runs_out(store) -> None:
    assert await store.take_lease("poll:x", "a", ttl_s=0.3)
    assert not await store.take_lease("poll:x", "b", ttl_s=0.3)
    assert await store.take_lease("poll:x", "a", ttl_s=0.3)   # renewed by its holder
    await asyncio.sleep(0.4)
    assert await store.take_lease("poll:x", "b", ttl_s=0.3)


async def test_a_fleet_of_one_without_redis_lists_this_server() -> None:
    local = LocalFleetStore("solo")
    await local.announce(card("me:1"))
    await local.put_rows(ServerRows(server="me:1", at=0.0, rows=[row("me:1", running=1, waiting=0)]))
    view = await fleet_view(local, [])
    assert not view.shared and [s.state for s in view.servers] == ["up"] and view.totals.running == 1
    await local.leave()
    assert [s.state for s in (await fleet_view(local, [])).servers] == ["stopped"]


async def test_a_board_whose_redis_is_gone_says_the_feed_is_interrupted() -> None:
    import socket

    import redis.asyncio as aioredis

    from engines.fleet.board import FleetBoard
    from engines.fleet.store import RedisFleetStore

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = aioredis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.5)
    board = FleetBoard(RedisFleetStore(client, "down"), list, interval_s=0.1)
    got: list[str] = []

    async def send(text: str) -> None:
        got.append(text)

    viewer = object()
    board.watch(viewer, send)
    for _ in range(50):
        if got:
            break
        await asyncio.sleep(0.1)
    board.unwatch(viewer)
    await client.aclose()
    message = orjson.loads(got[0])
    assert message["type"] == "fleet_unavailable" and message["fleet"] == "down" and message["error"]


async def test_a_page_gets_a_servers_new_rows_within_a_push_interval_not_a_second(store) -> None:
    from engines.fleet.board import PUSH_INTERVAL_S, FleetBoard

    await store.announce(card("a:1"))
    await store.put_rows(ServerRows(server="a:1", at=0.0, rows=[row("a:1", running=1)]))
    board = FleetBoard(store, list, interval_s=5.0)  # whole views seldom: the rows come by the feed
    got: list[dict] = []

    async def send(text: str) -> None:
        got.append(orjson.loads(text))

    board.watch(object(), send)
    await asyncio.sleep(0.3)
    assert got[0]["type"] == "fleet" and got[0]["rows"][0]["figures"]["running"] == 1
    published = time.time()
    await store.put_rows(ServerRows(server="a:1", at=published, rows=[row("a:1", running=7)]))
    while not any(m["type"] == "fleet_rows" for m in got):
        assert time.time() - published < 2 * PUSH_INTERVAL_S + 0.3, got
        await asyncio.sleep(0.02)
    (update,) = [m for m in got if m["type"] == "fleet_rows"]
    assert update["rows"][0]["figures"]["running"] == 7 and "windows" not in update["rows"][0]
    assert update["at"] - published <= 2 * PUSH_INTERVAL_S
    board.viewers.clear()
    await asyncio.sleep(0.3)


async def test_every_key_of_a_fleet_expires_once_no_member_beats(store) -> None:
    short = RedisFleetStore(store.redis, store.name, heartbeat_s=0.2, key_ttl_s=2.0)
    await short.announce(card("a:1"))
    await short.put_rows(ServerRows(server="a:1", at=0.0, rows=[row("a:1", running=1)]))
    await short.put_foreign("foreign-1", ServerRows(server="foreign-1", at=0.0, rows=[], kind="vllm"))
    assert await short.take_lease("poll:foreign-1", "a:1", ttl_s=2.0)
    await short.push_control("a:1", "{}")
    await short.leave()
    keys = [k async for k in store.redis.scan_iter(f"fleet:{store.name}:*")]
    assert {k.decode().rsplit(":", 1)[-1] for k in keys} >= {"cards", "beats", "left", "rows", "foreign"}
    for key in keys:
        assert 0 < await store.redis.pttl(key) <= 60_000, key   # none without an expiry
    await asyncio.sleep(1.0)
    await short.announce(card("a:1"))                         # a beat pushes every shared key's expiry back
    for key in ("cards", "beats", "rows", "foreign"):
        assert await store.redis.pttl(f"fleet:{store.name}:{key}") > 1000, key
    await asyncio.sleep(2.3)
    assert [k async for k in store.redis.scan_iter(f"fleet:{store.name}:*") if not k.endswith(b":control:a:1")] == []


def test_the_fleets_keys_must_outlive_two_heartbeats() -> None:
    with pytest.raises(ValueError, match="at least two heartbeats"):
        RedisFleetStore(None, "x", heartbeat_s=2.0, key_ttl_s=3.0)
