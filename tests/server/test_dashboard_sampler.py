"""The dashboard's sampler when an engine is slow to answer: a "slow" snapshot, and no exception
left behind for asyncio to log."""
from __future__ import annotations

import asyncio
import gc

import pytest

from engines.dashboard import sampler as sampler_module
from engines.dashboard.sampler import EngineSampler
from engines.runtime import EngineDeadError
from engines.runtime.core.live_view import KVCacheDump, LiveRequests
from engines.runtime.frontend.messages import DashboardReading

#: An idle engine's KV cache, as the reading carries it.
EMPTY_KV = KVCacheDump(16, 64, 0, 0, 64, 0, 0, 0, 0.0, 0, 0, [], [], 0)


class Layer:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def group_send(self, group: str, message: dict) -> None:
        self.sent.append(message)


class SlowEngine:
    """An engine whose reads take ``delay`` seconds (a long step holding its process), or fail."""

    name = "slow"
    is_alive = True
    process = True
    tracing_enabled = False
    backend_name = "cpu"
    dtype = "float32"

    def __init__(self, delay: float, error: BaseException | None = None) -> None:
        self.delay, self.error = delay, error
        from engines.runtime.frontend.supervision import EngineState, EngineStatus

        self.status = EngineStatus(EngineState.RUNNING, None, 0)

    async def dashboard_reading(self, with_text: bool = False) -> DashboardReading:
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return DashboardReading({"num_running_requests": 0}, live=LiveRequests([], 0), ended=[], kv=EMPTY_KV)


@pytest.fixture
def quick_timeout(monkeypatch):
    monkeypatch.setattr(sampler_module, "READ_TIMEOUT_S", 0.05)


@pytest.fixture
async def loop_errors():
    """What the event loop's exception handler is handed (unretrieved task exceptions)."""
    caught: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: caught.append(context))
    yield caught
    loop.set_exception_handler(None)


@pytest.mark.parametrize("error", [None, EngineDeadError("gone")], ids=["slow", "slow-then-dead"])
async def test_a_slow_engine_gives_a_slow_snapshot_and_leaves_nothing_unretrieved(quick_timeout, loop_errors,
                                                                                 error) -> None:
    sampler = EngineSampler(SlowEngine(delay=0.5, error=error), Layer())
    for _ in range(3):
        snap = await sampler.snapshot()
        assert snap.slow and snap.metrics is None and snap.recent_requests is None and snap.state == "running"
    await asyncio.sleep(0.6)  # any read left running would have ended by now
    gc.collect()  # unretrieved exceptions are reported when their futures are collected
    await asyncio.sleep(0)
    assert loop_errors == []


async def test_an_engine_that_answers_in_time_is_not_slow(quick_timeout) -> None:
    sampler_module.READ_TIMEOUT_S = 1.0
    snap = await EngineSampler(SlowEngine(delay=0.01), Layer()).snapshot()
    assert not snap.slow and snap.metrics == {"num_running_requests": 0} and snap.recent_requests == []
    assert snap.live_requests == [] and snap.live_total == 0
    assert snap.kv_cache is not None and snap.kv_cache["free_pages"] == 64 and snap.kv_cache["entries"] == []


async def test_an_engine_that_died_mid_read_is_not_slow(quick_timeout) -> None:
    sampler_module.READ_TIMEOUT_S = 1.0
    snap = await EngineSampler(SlowEngine(delay=0.01, error=EngineDeadError("gone")), Layer()).snapshot()
    assert not snap.slow and snap.metrics is None


async def test_a_snapshot_says_when_the_server_drains_and_history_keeps_five_minutes(monkeypatch) -> None:
    from engines.dashboard.messages import CHART_FIELDS, EngineHistory
    from engines.registry import registry

    sampler = EngineSampler(SlowEngine(delay=0.0), Layer())
    monkeypatch.setattr(registry, "draining", True)
    snap = await sampler.publish()
    assert snap.draining
    monkeypatch.setattr(registry, "draining", False)
    # Samples older than the history's window fall off; the message lists the chart fields.
    sampler.history.appendleft((snap.at - 400, (1.0,) * len(CHART_FIELDS)))
    await sampler.publish()
    history = EngineHistory.model_validate_json(sampler.history_text())
    assert history.engine == "slow" and len(history.at) == 2 and history.fields == list(CHART_FIELDS)
    assert history.values[0][CHART_FIELDS.index("num_running_requests")] == 0.0
    assert history.values[0][CHART_FIELDS.index("ttft_s.last_60s.p50")] is None  # not in this engine's metrics


async def test_a_channel_layer_that_is_away_is_said_once_and_the_sampler_goes_on(caplog, monkeypatch) -> None:
    """Redis stopped under the channel layer: one warning an outage (no traceback every sample),
    the snapshots go on being taken, and it says when the layer answers again."""
    import socket

    from channels_redis.core import RedisChannelLayer

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(sampler_module, "IDLE_INTERVAL_S", 0.05)
    down = RedisChannelLayer(hosts=[{"address": f"redis://127.0.0.1:{port}/0"}])
    sampler = EngineSampler(SlowEngine(0.0), down)
    task = asyncio.create_task(sampler.run())
    await asyncio.sleep(0.6)
    sampler.layer = Layer()  # back
    await asyncio.sleep(0.2)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    warnings = [r for r in caplog.records if "channel layer does not answer" in r.getMessage()]
    assert len(warnings) == 1 and not any(r.exc_info for r in caplog.records)
    assert any("answers again" in r.getMessage() for r in caplog.records)
    assert sampler.latest is not None and sampler.layer.sent  # snapshots were taken throughout


def test_the_history_carries_the_engines_now_figures_for_the_charts() -> None:
    """The charts draw the engine's "now" figures as they are (the numbers the pages show beside
    them), not rates the page derives from counters between samples."""
    from engines.dashboard.messages import CHART_FIELDS, chart_values
    from engines.runtime import EngineMetrics

    metrics = EngineMetrics()
    metrics.set_gauges(num_running_requests=4)
    metrics.on_step(0.1, prefill_tokens=20, decode_seqs=3)
    metrics.on_step(0.1, prefill_tokens=0, decode_seqs=4)
    reading = metrics.as_dict()
    values = dict(zip(CHART_FIELDS, chart_values(reading), strict=True))
    now = reading["now"]
    assert values["now.decode_tokens_per_s"] == now["decode_tokens_per_s"] > 0
    assert values["now.prefill_tokens_per_s"] == now["prefill_tokens_per_s"] > 0
    assert values["now.decode_batch_size"] == pytest.approx(3.5) and values["now.decode_batch_size_max"] == 4
    assert values["num_running_requests"] == 4
