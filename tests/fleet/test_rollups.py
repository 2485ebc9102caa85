"""The fleet's history: rows sampled into per-minute rollups (means, tokens, histograms), minutes
summed into hours, old rows pruned, and SLO figures read back over any window."""
from __future__ import annotations

import datetime as dt

import numpy as np
import pytest
from asgiref.sync import sync_to_async

from engines.fleet.membership import ServerCard
from engines.fleet.quantiles import fleet_quantile
from engines.fleet.rollups import RollupWriter, share_within, slo_figures, sum_histograms
from engines.fleet.rows import EngineRow, ServerRows, WindowHistogram
from engines.fleet.store import LocalFleetStore
from tests.fleet import foreign_expositions as expo

pytestmark = pytest.mark.django_db(transaction=True)


def histogram(bounds: tuple[float, ...], values: np.ndarray) -> WindowHistogram:
    return WindowHistogram(bounds=list(bounds), cumulative=[float(np.sum(values <= b)) for b in bounds]
                           + [float(values.size)])


def test_share_within_a_target_from_buckets_brackets_the_true_share() -> None:
    rng = np.random.default_rng(3)
    fast, slow = rng.uniform(0.002, 0.05, 300), rng.uniform(0.3, 3.0, 100)
    parts = [histogram(expo.VLLM_TTFT, fast).buckets(), histogram(expo.SGLANG_TTFT, slow).buckets()]
    everything = np.concatenate([fast, slow])
    for target in (0.01, 1.0, 2.0):  # a bound of both servers' buckets (or past all of one's): exact
        assert share_within(target, parts) == pytest.approx(float(np.mean(everything <= target)))
    # Inside a bucket the CDF is interpolated: as close as the observations are evenly spread.
    assert share_within(0.5, parts) == pytest.approx(float(np.mean(everything <= 0.5)), abs=0.02)
    assert share_within(0.5, []) is None
    same = sum_histograms([parts[0], parts[0], parts[1]])
    assert len(same) == 2 and same[0][-1][1] == 600


async def test_a_minute_of_samples_becomes_one_row_an_hour_its_minutes_and_old_rows_go() -> None:
    from engines.models import FleetRollup

    store = LocalFleetStore()
    await store.announce(ServerCard(server="s:1", url="http://s", version="t", roles=[], engines=[], started_at=0))
    # The last hour whole (say 10:00-11:00), not a fixed date: rows older than the retention go.
    hour = (dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
            - dt.timedelta(hours=1)).timestamp()
    writer = RollupWriter(store, "s:1", sample_s=10.0)
    ttft = histogram((0.1, 1.0), np.array([0.05, 0.5]))
    for second, running in ((3540, 2.0), (3550, 4.0), (3560, 6.0)):   # 10:59:00-10:59:20
        await store.put_rows(ServerRows(server="s:1", at=hour + second, rows=[EngineRow(
            server="s:1", engine="demo", model="m", state="running", at=hour + second,
            figures={"running": running, "waiting": 1.0, "generation_tokens": 5.0}, windows={"ttft": ttft})]))
        await writer.sample(now=hour + second)
    await writer.sample(now=hour + 3605)                                 # 11:00:05: 10:59 ends, and 10:00-11:00
    rows = await sync_to_async(lambda: list(FleetRollup.objects.order_by("period")))()
    assert [(r.period, r.start.minute) for r in rows] == [("hour", 0), ("minute", 59)]
    hourly, minute = rows
    assert minute.running == 4.0 and minute.waiting == 1.0 and minute.samples == 3
    assert minute.generation_tokens == pytest.approx(5.0 * 10 * 3)   # 5 tok/s over three 10 s samples
    assert minute.ttft == ttft.model_dump() and hourly.ttft == ttft.model_dump()
    assert hourly.running == 4.0 and hourly.generation_tokens == minute.generation_tokens
    # Past the retention (a day of minutes by default), a minute row goes at the next write.
    await sync_to_async(FleetRollup.objects.filter(period="minute").update)(
        start=dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=25))
    await writer.sample(now=hour + 3670)   # 11:01: the 11:00 minute is written, the old one pruned
    minutes = await sync_to_async(lambda: list(FleetRollup.objects.filter(period="minute")))()
    assert [m.start.minute for m in minutes] == [0]
    assert await sync_to_async(FleetRollup.objects.filter(period="hour").count)() == 1


def test_slo_figures_per_engine_server_and_fleet() -> None:
    rng = np.random.default_rng(5)
    start = dt.datetime(2026, 11, 27, tzinfo=dt.timezone.utc)

    def rollup(server: str, engine: str, bounds: tuple[float, ...], values: np.ndarray, minute: int):
        from engines.models import FleetRollup

        return FleetRollup(period="minute", start=start + dt.timedelta(minutes=minute), server=server,
                           server_name=server, engine=engine, generation_tokens=100.0,
                           ttft=histogram(bounds, values).model_dump(), itl=None)

    a1, a2, b = rng.uniform(0.01, 0.05, 200), rng.uniform(0.01, 0.05, 200), rng.uniform(0.2, 2.0, 100)
    rows = [rollup("a", "x", expo.VLLM_TTFT, a1, 0), rollup("a", "x", expo.VLLM_TTFT, a2, 1),
            rollup("b", "y", expo.SGLANG_TTFT, b, 0)]
    figures = slo_figures(rows, ttft_target_s=0.1, itl_target_s=0.05)
    fleet = figures["fleet"]
    assert fleet.requests == 500 and fleet.generation_tokens == 300.0
    assert fleet.ttft["within"] == pytest.approx(0.8, abs=0.02)      # a's 400 under 100 ms, none of b's
    summed = sum_histograms([histogram(expo.VLLM_TTFT, a1).buckets(), histogram(expo.VLLM_TTFT, a2).buckets()])
    expected = fleet_quantile(0.99, summed + [histogram(expo.SGLANG_TTFT, b).buckets()])
    assert fleet.ttft["p99"] == expected.value
    assert fleet.itl == {"p50": None, "p90": None, "p99": None, "within": None, "mean": None}
    assert fleet.ttft["mean"] is None  # these rollups carry no sums
    assert [s.label for s in figures["servers"]] == ["a", "b"] and figures["servers"][0].requests == 400
    assert [m.label for m in figures["models"]] == ["model x", "model y"] and figures["models"][1].requests == 100
    assert [e.label for e in figures["engines"]] == ["x @ a", "y @ b"]


async def test_rows_name_the_server_as_history_does_and_the_fleet_that_wrote_them() -> None:
    """One of ours by its server id, a foreign one by its URL's host:port (its store key is an
    attachment's id), beside the fleet's name; an hour sums this fleet's minutes only."""
    from engines.models import FleetRollup

    store = LocalFleetStore()
    await store.announce(ServerCard(server="h:8001", url="http://h:8001", version="t", roles=[], engines=[],
                                    started_at=0))
    hour = (dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
            - dt.timedelta(hours=1)).timestamp()
    # Another fleet sharing the database wrote the same engine of the same server in that hour.
    await sync_to_async(FleetRollup.objects.create)(
        period="minute", start=dt.datetime.fromtimestamp(hour + 3540, dt.timezone.utc), server="h:8001",
        server_name="h:8001", fleet="green", engine="demo", samples=1, running=100.0)
    writer = RollupWriter(store, "h:8001", names=lambda: {"foreign-3": "gpu-1"},
                          addresses=lambda: {"foreign-3": "gpu-7:8000"}, fleet="blue", sample_s=10.0)
    for at in (hour + 3540, hour + 3550):
        await store.put_rows(ServerRows(server="h:8001", at=at, rows=[EngineRow(
            server="h:8001", engine="demo", model="m", state="running", at=at, figures={"running": 2.0})]))
        await store.put_foreign("foreign-3", ServerRows(server="foreign-3", at=at, rows=[EngineRow(
            server="foreign-3", engine="llama", model="llama", kind="vllm", state="up", at=at,
            figures={"running": 5.0})]))
        await writer.sample(now=at)
    await writer.sample(now=hour + 3605)                   # 10:59 written, and the hour 10:00-11:00
    rows = await sync_to_async(lambda: sorted(
        (r.period, r.fleet, r.server, r.server_name, r.engine, r.running)
        for r in FleetRollup.objects.exclude(fleet="green")))()
    assert rows == [("hour", "blue", "gpu-7:8000", "gpu-1", "llama", 5.0),
                    ("hour", "blue", "h:8001", "h:8001", "demo", 2.0),
                    ("minute", "blue", "gpu-7:8000", "gpu-1", "llama", 5.0),
                    ("minute", "blue", "h:8001", "h:8001", "demo", 2.0)]
    # The other fleet's minute is still its own, and was not summed into this fleet's hour.
    assert await sync_to_async(FleetRollup.objects.filter(fleet="green").count)() == 1


async def test_each_observation_counts_once_in_the_minute_of_the_sample_after_it() -> None:
    """From the engines' histograms since their reset (a row's totals), not the last-minute window
    at a minute's last sample: a minute's counts and sum are exactly what came in it, and its mean
    is the mean of those observations."""
    from engines.models import FleetRollup

    store = LocalFleetStore()
    await store.announce(ServerCard(server="s:1", url="http://s", version="t", roles=[], engines=[], started_at=0))
    hour = (dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
            - dt.timedelta(hours=1)).timestamp()
    writer = RollupWriter(store, "s:1", sample_s=5.0)
    bounds = (0.5, 1.0, 2.0)
    seen: list[float] = []

    async def sample(at: float, new: list[float]) -> None:
        seen.extend(new)
        values = np.array(seen)
        total = histogram(bounds, values)
        total.sum = float(values.sum()) if values.size else 0.0
        window = histogram(bounds, values[-2:])  # a last-minute window that would miss and repeat
        await store.put_rows(ServerRows(server="s:1", at=at, rows=[EngineRow(
            server="s:1", engine="demo", model="m", state="running", at=at, figures={},
            windows={"ttft": window}, totals={"ttft": total})]))
        await writer.sample(now=at)

    await sample(hour + 3535, [0.3, 0.4])             # 10:58:55, first sight: counted from here on
    await sample(hour + 3540, [0.6])                  # 10:59:00
    await sample(hour + 3570, [0.7, 1.5, 3.0])        # 10:59:30
    await sample(hour + 3600, [0.2])                  # 11:00:00: into the 11:00 minute
    await sample(hour + 3610, [])
    await sample(hour + 3660, [])                     # 11:01: 11:00 written
    rows = await sync_to_async(lambda: {r.start.minute: r for r in FleetRollup.objects.filter(period="minute")})()
    got = {minute: WindowHistogram(**row.ttft) for minute, row in rows.items() if row.ttft}
    assert rows[58].ttft is None  # first seen then: when its observations came is unknown
    assert got[59].cumulative == [0.0, 2.0, 3.0, 4.0] and got[59].sum == pytest.approx(0.6 + 0.7 + 1.5 + 3.0)
    assert got[0].cumulative == [1.0, 1.0, 1.0, 1.0] and got[0].sum == pytest.approx(0.2)
    hourly = await sync_to_async(lambda: FleetRollup.objects.get(period="hour"))()
    assert WindowHistogram(**hourly.ttft).cumulative[-1] == 4.0
    figures = slo_figures([rows[59]], ttft_target_s=1.0, itl_target_s=1.0)["fleet"]
    assert figures.requests == 4 and figures.ttft["mean"] == pytest.approx((0.6 + 0.7 + 1.5 + 3.0) / 4)
    # The source reset (its counts fell): what it holds afterwards is all new.
    seen.clear()
    await sample(hour + 3665, [0.9])
    assert writer.engines[("s:1", "demo")].histograms["ttft"].cumulative == [0.0, 1.0, 1.0, 1.0]
