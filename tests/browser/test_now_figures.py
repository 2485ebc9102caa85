"""The "now" figures in a real browser: the decode batch size chart never shows more sequences
than there are requests. Screenshots in ``var/screenshots/now-*.png``.
"""
from __future__ import annotations

import json
import time

import pytest

from engines.dashboard.messages import EngineHistory, chart_values
from engines.runtime import EngineMetrics
from tests.browser.conftest import SHOTS, LiveServer
from tests.metrics_clock import metrics_clock

pytestmark = pytest.mark.slow
SERVE_MODELS = ("demo",)


def steady_history(monkeypatch, running: int = 4) -> EngineHistory:
    """A minute of an engine with ``running`` requests, as the sampler would keep it: steps of
    0.1 s decoding every request, and every fourth step a prefill (a new request's prompt) with
    the other ``running - 1`` decoding alongside; a sample every 0.25 s. A decode-token delta over
    a decode-step delta counts the riding decodes but not their steps: 5.5 sequences a step."""
    clock = metrics_clock(monkeypatch, 5000.0)
    metrics = EngineMetrics()
    metrics.set_gauges(num_running_requests=running)
    wall = time.time() - 60.0
    at: list[float] = []
    values: list[list[float | None]] = []
    step = 0
    for sample in range(1, 240):
        until = 5000.0 + 0.25 * sample
        while 5000.0 + 0.1 * (step + 1) <= until:
            step += 1
            hybrid = step % 4 == 0
            metrics.on_step(0.1, prefill_tokens=20 if hybrid else 0, decode_seqs=running - 1 if hybrid else running,
                            ended_at=5000.0 + 0.1 * step)
        clock.now = until
        at.append(wall + 0.25 * sample)
        values.append(list(chart_values(metrics.as_dict())))
    return EngineHistory(engine="demo", at=at, values=values)


async def test_the_batch_size_chart_never_shows_more_sequences_than_requests(
        page, dashboard_server: LiveServer, monkeypatch) -> None:
    """The engine page fed a minute of 4 requests with prefills among the decodes (its socket
    answered by the test): the batch chart draws what the steps ran, at most 4 sequences, where
    the old delta of decode tokens over decode steps drew 5.5."""
    history = steady_history(monkeypatch)

    def answer(socket) -> None:  # in place of the server's socket: the history, then nothing
        socket.send(history.model_dump_json())

    await page.route_web_socket("**/ws/engines/demo/", answer)
    await page.goto(f"{dashboard_server.base}/dashboard/engines/demo/")
    await page.wait_for_function("() => Number(document.getElementById('charts').dataset.samples) > 200")
    charts = await page.evaluate("""() => {
      const c = window.enginePage.charts;
      return {batch: c.batch.data.slice(1), running: c.requests.data[1], legend: c.batch.series.map((s) => s[0])};
    }""")
    drawn = [v for series in charts["batch"] for v in series if v is not None]
    running = max(v for v in charts["running"] if v is not None)
    assert running == 4 and drawn, charts
    assert max(drawn) <= running, f"the batch chart shows {max(drawn)} sequences a step with {running} requests"
    assert min(drawn) >= 3  # a mean of the steps' batch sizes: 4, and 3 beside a prefill
    await page.screenshot(path=str(SHOTS / "now-engine-batch.png"), full_page=False)
    print(json.dumps(charts["legend"]))
