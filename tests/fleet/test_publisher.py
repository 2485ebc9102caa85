"""Our engines' rows: the engine's own metrics turned into the fleet's quantities, as a foreign
server's /metrics is (tokens/s the engine's "now" figures, request counters as rates over the
readings of the last few seconds, latencies over the last minute from its buckets)."""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from engines.fleet.membership import ServerCard
from engines.fleet.publisher import EngineRowReader, FleetPublisher
from engines.fleet.quantiles import bucket_quantile
from engines.fleet.store import LocalFleetStore
from engines.runtime import EngineMetrics
from tests.metrics_clock import metrics_clock


def test_a_row_has_gauges_rates_and_last_minute_percentiles() -> None:
    metrics = EngineMetrics()
    metrics.set_gauges(num_running_requests=3, num_waiting_requests=1, kv_pages_used=5, kv_pages_total=20)
    reader = EngineRowReader("s:1", "demo", "demo-model")
    first = reader.row("running", metrics.as_dict(), metrics.histograms(), now=100.0)
    assert first.figures["running"] == 3 and first.figures["kv_usage"] == 0.25
    assert first.figures["generation_tokens"] == 0.0          # no step yet: the engine's own rate is 0
    assert first.figures["finished"] is None                    # a counter's rate needs two readings
    assert first.figures["ttft_p50"] is None and first.windows["ttft"].cumulative[-1] == 0
    for ttft in (0.01, 0.02, 0.03, 2.0):
        metrics.on_first_token(ttft)
    metrics.on_step(0.1, prefill_tokens=0, decode_seqs=8)
    metrics.on_step(0.1, prefill_tokens=64, decode_seqs=0)
    reading = metrics.as_dict()
    second = reader.row("running", reading, metrics.histograms(), now=102.0)
    # The tokens/s are the engine's "now" figures, the numbers its dashboard pages show.
    assert reading["now"]["decode_tokens_per_s"] > 0
    assert second.figures["generation_tokens"] == reading["now"]["decode_tokens_per_s"]
    assert second.figures["prompt_tokens"] == reading["now"]["prefill_tokens_per_s"]
    window = second.windows["ttft"].buckets()
    assert window[-1][1] == 4
    # Since the engine's reset, with the sum: what the rollups count a minute's observations from.
    assert second.totals["ttft"].cumulative[-1] == 4 and second.totals["ttft"].sum == pytest.approx(2.06)
    assert second.figures["ttft_p50"] == bucket_quantile(0.5, window) and 0.01 <= second.figures["ttft_p50"] <= 0.05
    # A minute later with no new first token, the window is empty again: an old stall no longer counts.
    later = reader.row("running", metrics.as_dict(), metrics.histograms(), now=170.0)
    later = reader.row("running", metrics.as_dict(), metrics.histograms(), now=171.0)
    assert later.figures["ttft_p50"] is None and later.windows["ttft"].cumulative[-1] == 0


def test_a_rows_tokens_per_s_hold_still_where_a_rate_between_readings_jumps(monkeypatch) -> None:
    """Steps of 0.26 s decoding 4 sequences, read once a second: a rate between two readings
    counts 3 or 4 steps (12 or 16 tok/s, the issue's flicker); the engine's window of steps
    gives 4 / 0.26 = 15.4 at every reading."""
    clock = metrics_clock(monkeypatch, 1000.0)
    metrics = EngineMetrics()
    reader = EngineRowReader("s:1", "demo", "m")
    figures = []
    step_end = clock.now
    for second in range(1, 21):
        while step_end + 0.26 <= 1000.0 + second:
            step_end += 0.26
            metrics.on_step(0.26, prefill_tokens=0, decode_seqs=4, ended_at=step_end)
        clock.now = 1000.0 + second
        figures.append(reader.row("running", metrics.as_dict(), None, now=clock.now).figures["generation_tokens"])
    steady = figures[5:]  # once a whole window of steps lies behind
    assert min(steady) == pytest.approx(4 / 0.26, rel=0.05) and max(steady) == pytest.approx(4 / 0.26, rel=0.05)


def test_an_engine_that_gives_no_metrics_has_every_figure_unknown() -> None:
    row = EngineRowReader("s:1", "demo", "m").row("dead", None, None)
    assert row.state == "dead" and all(value is None for value in row.figures.values())


@dataclass
class Engine:
    """What the publisher reads of an AsyncEngine: a served name, its checkpoint's name, its
    state and one metrics read (here from a real EngineMetrics)."""

    name: str
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    alive: bool = True
    slow: bool = False

    @property
    def checkpoint(self) -> SimpleNamespace:
        return SimpleNamespace(name="demo-model")

    @property
    def is_alive(self) -> bool:
        return self.alive

    @property
    def status(self) -> SimpleNamespace:
        return SimpleNamespace(state=SimpleNamespace(value="running" if self.alive else "dead"))

    async def metrics_with_histograms(self):
        if self.slow:
            await asyncio.sleep(30)
        return self.metrics.as_dict(), self.metrics.histograms()


async def test_the_publisher_announces_and_writes_rows_each_second_and_survives_a_slow_engine(monkeypatch) -> None:
    import engines.fleet.publisher as publisher

    monkeypatch.setattr(publisher, "READ_TIMEOUT_S", 0.2)
    engines = [Engine("a"), Engine("b", slow=True), Engine("c", alive=False)]
    engines[0].metrics.set_gauges(num_running_requests=2)
    store = LocalFleetStore()
    card = ServerCard(server="s:1", url="http://s", version="t", roles=["engines"], engines=[], started_at=0.0)
    pub = FleetPublisher(store, "s:1", lambda: engines, lambda: card, rows_interval_s=0.1, heartbeat_s=0.3)
    task = asyncio.create_task(pub.run())
    try:
        await asyncio.sleep(0.5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    rows = (await store.all_rows())["s:1"].rows
    by_engine = {row.engine: row for row in rows}
    assert by_engine["a"].figures["running"] == 2 and by_engine["a"].model == "demo-model"
    assert by_engine["b"].figures["running"] is None         # did not answer in time: unknown, not 0
    assert by_engine["c"].state == "dead"
    assert [m.card.server for m in await store.members()] == ["s:1"]


async def test_the_publisher_beats_every_heartbeat_even_when_its_loop_wakes_a_hair_early(monkeypatch) -> None:
    import engines.fleet.publisher as publisher

    clock = SimpleNamespace(now=1000.0)
    real_sleep = asyncio.sleep

    async def early_sleep(seconds: float) -> None:
        clock.now += max(0.0, seconds - 1e-6)    # asyncio may run a timer up to its clock's resolution early
        await real_sleep(0)

    monkeypatch.setattr(publisher, "time", SimpleNamespace(monotonic=lambda: clock.now, time=lambda: clock.now))
    monkeypatch.setattr(publisher.asyncio, "sleep", early_sleep)
    beats: list[float] = []

    class Store(LocalFleetStore):
        async def announce(self, card: ServerCard) -> None:
            beats.append(clock.now)

    card = ServerCard(server="s:1", url="http://s", version="t", roles=[], engines=[], started_at=0.0)
    pub = FleetPublisher(Store(), "s:1", list, lambda: card, rows_interval_s=1.0, heartbeat_s=2.0)
    task = asyncio.create_task(pub.run())
    for _ in range(10_000):
        if len(beats) == 5:
            break
        await real_sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    assert max(gaps) < 2.0 + 0.01, gaps                      # never the 3 s after which a member is gone
