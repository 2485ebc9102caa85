"""This server's part in the fleet: its card with a heartbeat, and its engines' rows once a second.

The rows come from one read of each engine a second (``metrics_with_histograms``, answered by the
engine process even mid-step) turned into the fleet's quantities by :class:`EngineRowReader`:
the same quantities, rates and last-minute windows as a foreign server's ``/metrics`` gives
(``foreign.ForeignReader``), so that a grid of ours and theirs compares like with like. The
tokens/s are the engine's own ``now`` figures (over its steps of the last ``NOW_WINDOW_S``), the
numbers its dashboard pages show; the request counters are rated over the readings of as long.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from engines.server.outage_log import OutageLog
from engines.fleet.clock import ClockTracker, measure_offset
from engines.fleet.membership import HEARTBEAT_S, ServerCard
from engines.fleet.quantiles import bucket_quantile
from engines.fleet.rows import FLEET_WINDOW_QUANTITIES, EngineRow, ServerRows, WindowHistogram
from engines.fleet.store import FleetStore
from engines.fleet.windows import CounterRate, HistogramWindow
from engines.server.cancellation import check_cancelled, within

logger = logging.getLogger("engines.fleet")

__all__ = ["ROWS_INTERVAL_S", "EngineRowReader", "FleetPublisher"]

#: Seconds between a server's row updates.
ROWS_INTERVAL_S = 1.0
#: A read an engine does not answer in this long leaves its figures unknown for that second.
READ_TIMEOUT_S = 2.0

# Our engine metrics (``EngineMetrics.as_dict()`` keys) for the fleet's quantities.
_GAUGES = {"running": "num_running_requests", "waiting": "num_waiting_requests", "kv_usage": "kv_cache_usage",
           "prefix_hit_rate": "prefix_cache_hit_rate"}
_NOW = {"prompt_tokens": "prefill_tokens_per_s", "generation_tokens": "decode_tokens_per_s"}  # of metrics["now"]
_COUNTERS = {"finished": "num_finished_requests", "aborted": "num_aborted_requests", "preemptions": "num_preemptions"}
# ... and the histogram families (``EngineMetrics.histograms()`` keys, vLLM's names).
_HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds",
               "e2e": "e2e_request_latency_seconds", "queue_time": "request_queue_time_seconds"}


class EngineRowReader:
    """Turns one engine's successive readings into :class:`EngineRow` s (it keeps the counters'
    readings of the last few seconds and the histograms' of the last minute)."""

    def __init__(self, server: str, engine: str, model: str) -> None:
        self.server, self.engine, self.model = server, engine, model
        self._rates: dict[str, CounterRate] = {}
        self._windows: dict[str, HistogramWindow] = {}

    def row(self, state: str, metrics: dict[str, Any] | None, histograms: dict[str, Any] | None,
            now: float | None = None) -> EngineRow:
        """The row for a reading at ``now`` (monotonic seconds); without metrics (the engine is
        down or did not answer) every figure is unknown."""
        now = time.monotonic() if now is None else now
        figures: dict[str, float | None] = {}
        windows: dict[str, WindowHistogram] = {}
        totals: dict[str, WindowHistogram] = {}
        if metrics is None:
            figures.update(dict.fromkeys([*_GAUGES, *_NOW, *_COUNTERS]))
        else:
            for quantity, key in _GAUGES.items():
                figures[quantity] = _number(metrics.get(key))
            now_figures = metrics.get("now") or {}
            for quantity, key in _NOW.items():
                figures[quantity] = _number(now_figures.get(key))
            for quantity, key in _COUNTERS.items():
                value = _number(metrics.get(key))
                rate = self._rates.setdefault(quantity, CounterRate())
                figures[quantity] = rate.add(now, value) if value is not None else None
        for quantity, family in _HISTOGRAMS.items():
            snapshot = (histograms or {}).get(family)
            if snapshot is None:
                figures[f"{quantity}_p50"] = figures[f"{quantity}_p99"] = None
                continue
            window = self._windows.setdefault(quantity, HistogramWindow()).add(now, tuple(snapshot.cumulative()))
            figures[f"{quantity}_p50"] = bucket_quantile(0.5, window)
            figures[f"{quantity}_p99"] = bucket_quantile(0.99, window)
            if quantity in FLEET_WINDOW_QUANTITIES:
                windows[quantity] = WindowHistogram.of(window)
                totals[quantity] = WindowHistogram.of(tuple(snapshot.cumulative()), snapshot.sum)
        return EngineRow(server=self.server, engine=self.engine, model=self.model, state=state, at=time.time(),
                         figures=figures, windows=windows, totals=totals)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


async def _read(engine: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    if not engine.is_alive:
        return None, None
    try:
        metrics, histograms = await within(engine.metrics_with_histograms(), READ_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - slow, dead or restarting: this second's figures are unknown
        return None, None
    return metrics, histograms


class FleetPublisher:
    """Announces this server (``card()``, every heartbeat) and publishes its engines' rows (every
    :data:`ROWS_INTERVAL_S`) until cancelled; a store that fails is logged once per outage."""

    def __init__(self, store: FleetStore, server: str, engines: Callable[[], Iterable[Any]],
                 card: Callable[[], ServerCard], rows_interval_s: float = ROWS_INTERVAL_S,
                 heartbeat_s: float = HEARTBEAT_S, extra: Callable[[], list[EngineRow]] = list) -> None:
        self.store = store
        self.server = server
        self.engines = engines
        self.card = card
        self.extra = extra  # rows of what is not an engine (the router's)
        self.rows_interval_s = rows_interval_s
        self.heartbeat_s = heartbeat_s
        self._readers: dict[str, EngineRowReader] = {}
        self._outage = OutageLog(logger, f"fleet: publishing this server to fleet {store.name}")
        #: This server's clock against the fleet's reference, measured every heartbeat.
        self.clock = ClockTracker()

    async def rows(self) -> ServerRows:
        """Read every engine once (concurrently) and make this second's rows."""
        engines = list(self.engines())
        readings = await asyncio.gather(*(_read(engine) for engine in engines))
        rows = []
        for engine, (metrics, histograms) in zip(engines, readings, strict=True):
            model = str(getattr(engine.checkpoint, "name", ""))
            reader = self._readers.get(engine.name)
            if reader is None or reader.model != model:
                reader = self._readers[engine.name] = EngineRowReader(self.server, engine.name, model)
            rows.append(reader.row(engine.status.state.value, metrics, histograms))
        for gone in set(self._readers) - {engine.name for engine in engines}:
            del self._readers[gone]
        clock = self.clock.best
        return ServerRows(server=self.server, at=time.time(), rows=rows + self.extra(),
                          clock_offset_s=clock.offset_s if clock else None,
                          clock_uncertainty_s=clock.uncertainty_s if clock else None)

    async def publish_once(self, announce: bool) -> None:
        if announce:
            await self.store.announce(self.card())
            self.clock.add(await measure_offset(self.store.reference_time))
        await self.store.put_rows(await self.rows())

    async def run(self) -> None:
        last_beat = -float("inf")
        while True:
            check_cancelled()  # a callee may have swallowed our cancel (engines.server.cancellation)
            started = time.monotonic()
            # Half a rows interval early rather than a whole interval late: a loop woken a hair
            # early must not leave 3 s between beats, which is when a member is gone.
            beat = started - last_beat >= self.heartbeat_s - self.rows_interval_s / 2
            try:
                await self.publish_once(beat)
                if beat:
                    last_beat = started
                self._outage.worked()
            except Exception as exc:  # noqa: BLE001 - Redis down: the server serves on, the fleet waits
                self._outage.failed(exc)
            await asyncio.sleep(max(0.0, self.rows_interval_s - (time.monotonic() - started)))

    async def leave(self) -> None:
        """Say this server stopped on purpose (best effort: the store may be down)."""
        try:
            await self.store.leave()
        except Exception as exc:  # noqa: BLE001 - stopping anyway
            logger.warning("fleet %s: could not say this server stopped (%s)", self.store.name, exc)
