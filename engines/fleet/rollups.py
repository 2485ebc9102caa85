"""The fleet's history: every engine's rows rolled up per minute and per hour into the shared
database (``models.FleetRollup``), and SLO figures read back from them.

One member at a time (the ``rollup`` lease) samples every server's rows every
:data:`SAMPLE_S` seconds and, at each minute's end, writes a row per engine: the minute's mean
load, its tokens (rate x time), and its TTFT and ITL histograms in that server's bounds, with
their sums: each sample adds the change in the engine's histograms since the sample before
(``EngineRow.totals``), so every observation counts once, in the minute of the first sample
after it (a source's reset, or a lease that changed hands, starts the count afresh: the
observations between its last sample and the reset are lost). A row without totals (a server of
an older version) gives its last-minute window as published. An hour's row sums its minutes
(histograms summed where their bounds agree, as one engine's do). Minutes are kept ``FLEET_ROLLUP_MINUTES_H`` hours
(default 24), hours ``FLEET_ROLLUP_HOURS_D`` days (default 30). A row names its server as every
history record does (``host:port``: one of ours by its ``server_id()``, a foreign one by its URL's)
and the fleet that wrote it, so that fleets sharing a database keep their rollups apart.

SLO figures over any window (:func:`slo_figures`): per engine its minutes' histograms summed;
per server and for the fleet the mixture of its engines' (``quantiles.fleet_quantile``); the
share of requests within a target from the same piecewise-linear CDFs.
"""
from __future__ import annotations

import asyncio
import logging
import datetime as dt
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


from engines.server.cancellation import check_cancelled
from engines.server.outage_log import OutageLog
from engines.fleet.quantiles import Buckets, fleet_quantile, window_delta
from engines.fleet.rows import EngineRow, WindowHistogram
from engines.fleet.store import FleetStore
from engines.server.db_calls import in_db_thread
from engines.server.server_identity import fleet_name


__all__ = ["RollupWriter", "SloFigures", "share_within", "slo_figures", "sum_histograms"]

logger = logging.getLogger("engines.fleet")

#: Seconds between samples of the fleet's rows.
SAMPLE_S = 5.0


def sum_histograms(histograms: Iterable[Buckets]) -> list[Buckets]:
    """Histograms with equal bounds summed into one; those with other bounds kept apart."""
    by_bounds: dict[tuple[float, ...], list[float]] = {}
    for buckets in histograms:
        if not buckets:
            continue
        key = tuple(b for b, _ in buckets)
        counts = by_bounds.setdefault(key, [0.0] * len(key))
        for i, (_, c) in enumerate(buckets):
            counts[i] += c
    return [tuple(zip(bounds, counts, strict=True)) for bounds, counts in by_bounds.items()]


def share_within(target_s: float, histograms: Sequence[Buckets]) -> float | None:
    """The share of the observations at or below ``target_s`` (each histogram's CDF interpolated
    linearly inside its buckets, as its quantiles are); None when there are none."""
    total = sum(h[-1][1] for h in histograms if h)
    if total <= 0:
        return None
    below = 0.0
    for buckets in histograms:
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in buckets:
            if target_s <= bound:
                if math.isinf(bound):
                    below += lower_count  # past the largest bound: only what is known below
                else:
                    width = bound - lower_bound
                    part = (target_s - lower_bound) / width if width > 0 else 1.0
                    below += lower_count + (count - lower_count) * part
                break
            lower_bound, lower_count = bound, count
    return below / total


@dataclass
class _Minute:
    """One engine's samples in the current minute."""

    row: EngineRow
    server: str
    server_name: str
    samples: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    last_at: float | None = None
    #: The minute's observations so far, per latency (from the samples' changes).
    histograms: dict[str, WindowHistogram] = field(default_factory=dict)

    def observe(self, quantity: str, change: WindowHistogram) -> None:
        """Add one sample's change of a latency's histogram (a change of bounds starts it again)."""
        held = self.histograms.get(quantity)
        if held is None or held.bounds != change.bounds:
            self.histograms[quantity] = change
            return
        self.histograms[quantity] = WindowHistogram(
            bounds=held.bounds, cumulative=[a + b for a, b in zip(held.cumulative, change.cumulative, strict=True)],
            sum=held.sum + change.sum if held.sum is not None and change.sum is not None else None)

    def histogram(self, quantity: str) -> dict[str, Any] | None:
        """The minute's histogram: its observations; None when they are unknown (the engine was
        first seen in it); a row without totals (an older server): its last window."""
        if quantity in self.histograms:
            return self.histograms[quantity].model_dump()
        if quantity in self.row.totals:
            return None
        window = self.row.windows.get(quantity)
        return window.model_dump() if window is not None else None

    def add(self, row: EngineRow, now: float, sample_s: float) -> None:
        self.row = row
        self.samples += 1
        for quantity in ("running", "waiting", "kv_usage"):
            value = row.figures.get(quantity)
            if value is not None:
                self.sums[quantity] = self.sums.get(quantity, 0.0) + value
                self.counts[quantity] = self.counts.get(quantity, 0) + 1
        elapsed = sample_s if self.last_at is None else now - self.last_at
        for quantity in ("prompt_tokens", "generation_tokens"):
            rate = row.figures.get(quantity)
            if rate is not None:  # tokens = rate x the time it stood for
                self.sums[quantity] = self.sums.get(quantity, 0.0) + rate * elapsed
                self.counts[quantity] = 1
        self.last_at = now

    def mean(self, quantity: str) -> float | None:
        n = self.counts.get(quantity)
        return self.sums[quantity] / n if n else None


def _minute_start(at: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(at - at % 60, tz=dt.timezone.utc)


def _write_minute(start: dt.datetime, minutes: Sequence[_Minute], fleet: str, keep_minutes_h: float,
                  keep_hours_d: float) -> None:
    from engines.models import FleetRollup

    rows = [FleetRollup(period="minute", start=start, server=m.server, server_name=m.server_name, fleet=fleet,
                        engine=m.row.engine, model=m.row.model, kind=m.row.kind, samples=m.samples,
                        running=m.mean("running"), waiting=m.mean("waiting"), kv_usage=m.mean("kv_usage"),
                        prompt_tokens=m.sums.get("prompt_tokens"), generation_tokens=m.sums.get("generation_tokens"),
                        ttft=m.histogram("ttft"), itl=m.histogram("itl"))
            for m in minutes]
    FleetRollup.objects.bulk_create(rows, ignore_conflicts=True)  # a lease handed over mid-minute: first wins
    if start.minute == 59:
        _write_hour(start.replace(minute=0), fleet)
    now = dt.datetime.now(dt.timezone.utc)
    FleetRollup.objects.filter(period="minute", start__lt=now - dt.timedelta(hours=keep_minutes_h)).delete()
    FleetRollup.objects.filter(period="hour", start__lt=now - dt.timedelta(days=keep_hours_d)).delete()


def _write_hour(start: dt.datetime, fleet: str) -> None:
    """The hour's rows of ``fleet`` from its minutes, per engine."""
    from engines.models import FleetRollup

    minutes = FleetRollup.objects.filter(period="minute", fleet=fleet, start__gte=start,
                                         start__lt=start + dt.timedelta(hours=1))
    groups: dict[tuple[str, str], list[Any]] = {}
    for row in minutes:
        groups.setdefault((row.server, row.engine), []).append(row)
    hours = []
    for (server, engine), rows in groups.items():
        def mean(name: str, rows: list[Any] = rows) -> float | None:
            values = [getattr(r, name) for r in rows if getattr(r, name) is not None]
            return sum(values) / len(values) if values else None

        def total(name: str, rows: list[Any] = rows) -> float | None:
            values = [getattr(r, name) for r in rows if getattr(r, name) is not None]
            return sum(values) if values else None

        def histogram(name: str, rows: list[Any] = rows) -> dict[str, Any] | None:
            parts = [WindowHistogram(**getattr(r, name)) for r in rows if getattr(r, name)]
            summed = sum_histograms(p.buckets() for p in parts)
            sums = [p.sum for p in parts]
            total_sum = sum(s for s in sums if s is not None) if len(summed) == 1 and None not in sums else None
            return WindowHistogram.of(summed[0], total_sum).model_dump() if summed else None

        last = rows[-1]
        hours.append(FleetRollup(period="hour", start=start, server=server, server_name=last.server_name, fleet=fleet,
                                 engine=engine, model=last.model, kind=last.kind,
                                 samples=sum(r.samples for r in rows), running=mean("running"),
                                 waiting=mean("waiting"), kv_usage=mean("kv_usage"),
                                 prompt_tokens=total("prompt_tokens"), generation_tokens=total("generation_tokens"),
                                 ttft=histogram("ttft"), itl=histogram("itl")))
    FleetRollup.objects.bulk_create(hours, ignore_conflicts=True)


class RollupWriter:
    """Samples the fleet's rows and writes its minutes, while this member holds the lease.

    ``names`` and ``addresses`` give, for each foreign server's key in the store, its name and its
    ``host:port`` (``server_identity.url_server_id``); ``fleet`` is this fleet's name."""

    def __init__(self, store: FleetStore, holder: str, names: Any = dict, keep_minutes_h: float = 24.0,
                 keep_hours_d: float = 30.0, sample_s: float = SAMPLE_S, addresses: Any = dict,
                 fleet: str | None = None) -> None:
        self.store, self.holder, self.names, self.addresses = store, holder, names, addresses
        self.fleet = fleet_name() if fleet is None else fleet
        self.keep_minutes_h, self.keep_hours_d, self.sample_s = keep_minutes_h, keep_hours_d, sample_s
        self.minute: dt.datetime | None = None
        self.engines: dict[tuple[str, str], _Minute] = {}
        #: Each engine's latency histograms at its last sample, since its source's reset.
        self.totals: dict[tuple[str, str, str], WindowHistogram] = {}

    async def sample(self, now: float | None = None) -> None:
        """Take one sample of every up server's rows; at a new minute, write the last one."""
        now = time.time() if now is None else now
        start = _minute_start(now)
        if self.minute is not None and start != self.minute and self.engines:
            await in_db_thread(_write_minute)(
                self.minute, list(self.engines.values()), self.fleet, self.keep_minutes_h, self.keep_hours_d)
            self.engines = {}
        self.minute = start
        members, rows, foreign = await asyncio.gather(self.store.members(), self.store.all_rows(),
                                                      self.store.all_foreign())
        up = {m.card.server for m in members if m.state == "up"}
        names, addresses = self.names(), self.addresses()
        published = [r for server, r in rows.items() if server in up] + [r for r in foreign.values() if not r.error]
        for server_rows in published:
            for row in server_rows.rows:
                if not row.engine:
                    continue
                key = (row.server, row.engine)
                entry = self.engines.get(key)
                if entry is None:
                    entry = self.engines[key] = _Minute(row, addresses.get(row.server, row.server),
                                                        names.get(row.server, row.server))
                entry.add(row, now, self.sample_s)
                for quantity, total in row.totals.items():
                    change = self._change((row.server, row.engine, quantity), total)
                    if change is not None:
                        entry.observe(quantity, change)

    def _change(self, key: tuple[str, str, str], total: WindowHistogram) -> WindowHistogram | None:
        """What a histogram gained since the last sample of it (None at its first sight: when its
        observations came is unknown); after its source's reset, all it holds now."""
        last, self.totals[key] = self.totals.get(key), total
        if last is None:
            return None
        buckets = window_delta(total.buckets(), last.buckets())
        if buckets is None:  # the source was reset or restarted in between: its counts began anew
            return total
        change_sum = total.sum - last.sum if total.sum is not None and last.sum is not None else None
        return WindowHistogram.of(buckets, change_sum)

    async def run(self) -> None:
        outage = OutageLog(logger, "fleet: sampling the fleet's rollups")
        while True:
            check_cancelled()  # a callee may have swallowed our cancel (engines.server.cancellation)
            try:
                if await self.store.take_lease("rollup", self.holder, ttl_s=3 * self.sample_s):
                    await self.sample()
                else:  # another member writes; start afresh if it stops
                    self.minute, self.engines, self.totals = None, {}, {}
                outage.worked()
            except Exception as exc:  # noqa: BLE001 - Redis or the database down: the next sample tries again
                outage.failed(exc)
            await asyncio.sleep(self.sample_s)


@dataclass(frozen=True)
class SloFigures:
    """TTFT and ITL over a window for one engine, one server or the fleet."""

    label: str
    requests: float
    ttft: dict[str, float | None]    # "p50", "p90", "p99", "mean", "within" (share within the target)
    itl: dict[str, float | None]
    prompt_tokens: float
    generation_tokens: float


def _figures(label: str, rows: Sequence[Any], ttft_target_s: float, itl_target_s: float) -> SloFigures:
    out: dict[str, dict[str, float | None]] = {}
    count = 0.0
    for name, target in (("ttft", ttft_target_s), ("itl", itl_target_s)):
        by_engine: dict[tuple[str, str], list[Buckets]] = {}
        sums: list[float | None] = []
        for row in rows:
            value = getattr(row, name)
            if value:
                histogram = WindowHistogram(**value)
                by_engine.setdefault((row.server, row.engine), []).append(histogram.buckets())
                sums.append(histogram.sum)
        histograms = [h for parts in by_engine.values() for h in sum_histograms(parts)]
        figures: dict[str, float | None] = {}
        for q in (0.5, 0.9, 0.99):
            found = fleet_quantile(q, histograms)
            figures[f"p{round(q * 100)}"] = found.value if found else None
        figures["within"] = share_within(target, histograms)
        observed = sum(h[-1][1] for h in histograms)
        # The mean where every part carries its sum (rollups from before sums were kept do not).
        figures["mean"] = (sum(s for s in sums if s is not None) / observed
                           if observed and sums and None not in sums else None)
        out[name] = figures
        if name == "ttft":
            count = sum(h[-1][1] for h in histograms)
    return SloFigures(label=label, requests=count, ttft=out["ttft"], itl=out["itl"],
                      prompt_tokens=sum(r.prompt_tokens or 0.0 for r in rows),
                      generation_tokens=sum(r.generation_tokens or 0.0 for r in rows))


def slo_figures(rows: Sequence[Any], ttft_target_s: float, itl_target_s: float) -> dict[str, Any]:
    """The fleet's, each model's, each server's and each engine's SLO figures over ``rows``
    (rollups of one period)."""
    servers: dict[str, list[Any]] = {}
    models: dict[str, list[Any]] = {}
    engines: dict[tuple[str, str], list[Any]] = {}
    for row in rows:
        servers.setdefault(row.server_name or row.server, []).append(row)
        models.setdefault(row.model or row.engine, []).append(row)
        engines.setdefault((row.server_name or row.server, row.engine), []).append(row)
    return {"fleet": _figures("fleet", rows, ttft_target_s, itl_target_s),
            "models": [_figures(f"model {name}", part, ttft_target_s, itl_target_s)
                       for name, part in sorted(models.items())],
            "servers": [_figures(name, part, ttft_target_s, itl_target_s) for name, part in sorted(servers.items())],
            "engines": [_figures(f"{engine} @ {server}", part, ttft_target_s, itl_target_s)
                        for (server, engine), part in sorted(engines.items())]}
