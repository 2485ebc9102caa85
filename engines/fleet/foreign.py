"""Servers that are not ours, read by URL: what kind each is, and what it reports, normalised.

:func:`fetch_metrics` reads a ``/metrics`` body within bounded time and bytes (a slow, huge,
redirecting or wrongly typed answer is an error that says so, never a stall);
:func:`detect_kind` names the kind of server from the body's metric prefixes and a few probes;
:class:`ForeignReader` keeps what the previous readings said, so that counters become rates over
the polls of the last ``windows.RATE_WINDOW_S`` or more and histograms become percentiles over
the last minute, and returns one :class:`ForeignReading` a
poll: per model, each quantity of :data:`~engines.fleet.server_kinds.QUANTITIES`, or the note that
the server does not export it.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from engines.fleet.server_kinds import ALIAS_TABLE_VERSION, KINDS, QUANTITIES, KindRecord, ServerKind, Source
from engines.fleet.exposition import Exposition, ExpositionError, Sample, parse_exposition
from engines.fleet.quantiles import Buckets, bucket_quantile, buckets_from_samples
from engines.fleet.rows import FLEET_WINDOW_QUANTITIES, EngineRow, ServerRows, WindowHistogram
from engines.fleet.windows import CounterRate, HistogramWindow
from engines.server.cancellation import within
from engines.prometheus_names import our_prefix

__all__ = ["MAX_METRICS_BYTES", "ForeignReader", "ForeignReading", "PollError", "detect_kind", "fetch_metrics",
           "probe_kind", "reading_rows", "record_for"]

#: The most a ``/metrics`` body may hold; vLLM's with every histogram is about 100 kB.
MAX_METRICS_BYTES = 8 << 20
#: The most one poll may take, connect to last byte.
POLL_TIMEOUT_S = 3.0
#: Percentiles are over this window of the server's histograms.
WINDOW_S = 60.0
_PERCENTILES = (0.5, 0.9, 0.99)
_TEXT_TYPES = ("text/plain", "application/openmetrics-text")


class PollError(Exception):
    """A poll that got nothing usable; the message is what the dashboard shows."""


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_metrics(client: httpx.AsyncClient, url: str, api_key: str | None = None,
                        max_bytes: int = MAX_METRICS_BYTES, timeout_s: float = POLL_TIMEOUT_S) -> str:
    """The body of ``url``'s ``/metrics``, or :class:`PollError` saying why not: no answer in
    ``timeout_s``, a status other than 200 (a redirect is not followed), a type that is not
    text, more than ``max_bytes``."""
    target = url.rstrip("/") + "/metrics"

    async def read() -> str:
        async with client.stream("GET", target, headers=_headers(api_key), follow_redirects=False) as response:
            if response.is_redirect:
                raise PollError(f"/metrics redirects to {response.headers.get('location', '?')}: attach that URL")
            if response.status_code == 404:
                raise PollError("/metrics answers 404: metrics are not enabled on this server")
            if response.status_code in (401, 403):
                raise PollError(f"/metrics answers {response.status_code}: the API key is missing or wrong")
            if response.status_code != 200:
                raise PollError(f"/metrics answers {response.status_code}")
            kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if kind and kind not in _TEXT_TYPES:
                raise PollError(f"/metrics answers {kind}, not Prometheus text")
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise PollError(f"/metrics is {int(declared):,} bytes, more than the {max_bytes:,} read")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise PollError(f"/metrics is more than the {max_bytes:,} bytes read")
            return body.decode("utf-8", "replace")

    try:
        return await within(read(), timeout_s)
    except asyncio.TimeoutError:
        raise PollError(f"/metrics did not answer in {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise PollError(f"/metrics could not be read: {type(exc).__name__}: {exc}") from None


# ----------------------------------------------------------------------------- detection


def detect_kind(exposition: Exposition) -> ServerKind:
    """The kind of server a ``/metrics`` body comes from, by its metric names and format alone:
    the first of :data:`~engines.fleet.server_kinds.KINDS` whose predicate it meets."""
    return next((kind for kind, record in KINDS.items() if record.detect(exposition)), ServerKind.UNKNOWN)


def record_for(kind: ServerKind, exposition: Exposition) -> KindRecord:
    """How to read a body of this kind: for ours, under the prefix it has (any ``--metrics-prefix``)."""
    record = KINDS[kind]
    if kind is ServerKind.OURS:
        prefix = our_prefix(exposition.names)
        if prefix is not None:
            return replace(record, prefixes=(prefix,))
    return record


_OWNERS = {owner: kind for kind, record in KINDS.items() for owner in record.owned_by}


async def probe_kind(client: httpx.AsyncClient, url: str, api_key: str | None = None,
                     timeout_s: float = POLL_TIMEOUT_S) -> tuple[ServerKind, str]:
    """The kind and version of a server whose ``/metrics`` did not tell (metrics off): from each
    kind's probes, in detection order (``/server_info`` or ``/get_server_info``: SGLang;
    ``/version``: vLLM; ``/props``: llama.cpp), then ``/v1/models``' ``owned_by``.
    ``(UNKNOWN, "")`` when none answers."""
    base = url.rstrip("/")

    async def get(path: str) -> Any:
        try:
            response = await client.get(base + path, headers=_headers(api_key), timeout=timeout_s,
                                        follow_redirects=False)
        except httpx.HTTPError:
            return None
        if response.status_code != 200 or len(response.content) > 1 << 20:
            return None
        try:
            return response.json()
        except ValueError:
            return None

    for kind, record in KINDS.items():
        for probe in record.probes:
            answer = await get(probe.path)
            if isinstance(answer, dict) and any(key in answer for key in probe.keys):
                return kind, str(answer.get(probe.version, ""))
    models = await get("/v1/models")
    if isinstance(models, dict):
        for model in models.get("data") or []:
            owner = str(model.get("owned_by", "")).lower() if isinstance(model, dict) else ""
            if owner in _OWNERS:
                return _OWNERS[owner], ""
    return ServerKind.UNKNOWN, ""


# ------------------------------------------------------------------------- normalisation


def _find(exposition: Exposition, record: KindRecord, name: str) -> tuple[str, list[Sample]] | None:
    for prefix in record.prefixes:
        samples = exposition.samples.get(prefix + name)
        if samples:
            return prefix + name, samples
    return None


def _selected(samples: list[Sample], source: Source) -> list[Sample]:
    return [s for s in samples
            if all(s.labels.get(k) == v for k, v in source.labels.items())
            and not any(s.labels.get(k) == v for k, v in source.exclude.items())]


def _by_model(samples: list[Sample], model_label: str | None) -> dict[str, list[Sample]]:
    grouped: dict[str, list[Sample]] = {}
    for sample in samples:
        grouped.setdefault(sample.labels.get(model_label, "") if model_label else "", []).append(sample)
    return grouped


@dataclass
class _Raw:
    """One quantity of one model as read: a value, a counter, a ratio's two counters, or buckets."""

    source: Source
    value: float | None = None
    denominator: float | None = None
    buckets: Buckets | None = None


def _read_raw(exposition: Exposition, record: KindRecord) -> dict[str, dict[str, _Raw]]:
    """model -> quantity -> what the body says of it (the first source of each that is present)."""
    out: dict[str, dict[str, _Raw]] = {}
    for quantity, sources in record.sources.items():
        for source in sources:
            found = _find(exposition, record, source.name + ("_bucket" if source.type == "histogram" else ""))
            if found is None:
                continue
            _, samples = found
            samples = _selected(samples, source)
            if source.type == "histogram":
                sums = _find(exposition, record, source.name + "_sum")
                sum_by_model = _by_model(_selected(sums[1], source), record.model_label) if sums else {}
                for model, group in _by_model(samples, record.model_label).items():
                    pairs = [(float(s.labels["le"]), s.value) for s in group if "le" in s.labels]
                    total = sum(s.value for s in sum_by_model[model]) if model in sum_by_model else None
                    out.setdefault(model, {})[quantity] = _Raw(source, value=total, buckets=buckets_from_samples(pairs))
            elif source.type == "ratio":
                denominator = _find(exposition, record, source.denominator)
                if denominator is None:
                    continue
                below = _by_model(_selected(denominator[1], source), record.model_label)
                for model, group in _by_model(samples, record.model_label).items():
                    out.setdefault(model, {})[quantity] = _Raw(
                        source, sum(s.value for s in group), sum(s.value for s in below.get(model, [])))
            else:
                combine = max if quantity == "kv_usage" else sum
                for model, group in _by_model(samples, record.model_label).items():
                    out.setdefault(model, {})[quantity] = _Raw(source, combine(s.value for s in group))
            break
    return out


@dataclass(frozen=True)
class ForeignReading:
    """One poll of a foreign server. ``models`` maps each model it serves to its figures:
    gauges as read, counters as rates per second over the polls of the last
    :data:`~engines.fleet.windows.RATE_WINDOW_S` or more (``windows.CounterRate``; None until two
    polls), histograms as
    ``{"p50", "p90", "p99", "count", "window"}`` (``window``: the buckets) over the last
    :data:`WINDOW_S` (or since the server started, until a window has passed), with ``total`` and
    ``total_sum``: the buckets and the sum as read, since the server's start. ``not_exported``
    lists the quantities it has no name for, shown as such and never as 0. ``error`` is set (and
    the rest empty) when the poll failed."""

    at: float
    kind: ServerKind
    version: str = ""
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    not_exported: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)  # quantity -> the metric it was read from
    error: str | None = None
    elapsed_s: float = 0.0
    nbytes: int = 0
    alias_table: str = ALIAS_TABLE_VERSION


class ForeignReader:
    """Turns a foreign server's successive ``/metrics`` bodies into :class:`ForeignReading`\\ s
    (it keeps the previous counters and the last minutes of histogram readings)."""

    def __init__(self, kind: ServerKind | None = None, version: str = "") -> None:
        self.kind = kind
        self.version = version
        self._rates: dict[tuple[str, str, str], CounterRate] = {}
        self._windows: dict[tuple[str, str], HistogramWindow] = {}

    def read(self, text: str, now: float | None = None, elapsed_s: float = 0.0) -> ForeignReading:
        """Normalise one body read at ``now`` (monotonic seconds). An unparseable body is a
        reading with its ``error``."""
        now = time.monotonic() if now is None else now
        try:
            exposition = parse_exposition(text)
        except ExpositionError as exc:
            return ForeignReading(at=time.time(), kind=self.kind or ServerKind.UNKNOWN, version=self.version,
                                  error=f"/metrics is not metrics text: {exc}", nbytes=len(text))
        kind = self.kind or detect_kind(exposition)
        raw = _read_raw(exposition, record_for(kind, exposition))
        models: dict[str, dict[str, Any]] = {}
        present: set[str] = set()
        sources: dict[str, str] = {}
        for model, quantities in raw.items():
            figures = models.setdefault(model, {})
            for quantity, item in quantities.items():
                present.add(quantity)
                sources[quantity] = item.source.name + (f" ({item.source.note})" if item.source.note else "")
                figures[quantity] = self._figure(model, quantity, item, now)
        not_exported = tuple(q for q in QUANTITIES if q not in present)
        return ForeignReading(at=time.time(), kind=kind, version=self.version, models=models,
                              not_exported=not_exported, sources=sources, elapsed_s=elapsed_s, nbytes=len(text))

    def _figure(self, model: str, quantity: str, item: _Raw, now: float) -> Any:
        source = item.source
        if source.type == "gauge":
            return _finite(item.value)  # a NaN gauge (no data yet) reads as unknown
        if source.type in ("counter", "ratio"):
            rate = self._rate(model, quantity, "", now, item.value or 0.0)
            if source.type == "counter":
                return rate
            below = self._rate(model, quantity, "denominator", now, item.denominator or 0.0)
            return rate / below if rate is not None and below else None
        delta = self._windows.setdefault((model, quantity), HistogramWindow(WINDOW_S)).add(now, item.buckets or ())
        count = delta[-1][1] if delta else 0.0
        total = {"total": item.buckets, "total_sum": item.value} if item.buckets else {}
        if count <= 0:
            return {"count": 0.0, **total}
        return {"count": count, "window": delta, **total,
                **{f"p{round(q * 100)}": bucket_quantile(q, delta) for q in _PERCENTILES}}

    def _rate(self, model: str, quantity: str, part: str, now: float, value: float) -> float | None:
        return self._rates.setdefault((model, quantity, part), CounterRate()).add(now, value)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def reading_rows(server: str, reading: ForeignReading) -> ServerRows:
    """A poll as the fleet grid takes it: one :class:`EngineRow` per served model (one row
    saying the error when the poll failed)."""
    if reading.error is not None:
        row = EngineRow(server=server, engine="", kind=reading.kind.value, state="unreachable", at=reading.at,
                        error=reading.error)
        return ServerRows(server=server, at=reading.at, rows=[row], kind=reading.kind.value, error=reading.error)
    rows = []
    for model, quantities in sorted(reading.models.items()):
        figures: dict[str, float | None] = {}
        windows: dict[str, WindowHistogram] = {}
        totals: dict[str, WindowHistogram] = {}
        for quantity, value in quantities.items():
            if isinstance(value, dict):
                figures[f"{quantity}_p50"] = value.get("p50")
                figures[f"{quantity}_p99"] = value.get("p99")
                if quantity in FLEET_WINDOW_QUANTITIES and value.get("window"):
                    windows[quantity] = WindowHistogram.of(value["window"])
                if quantity in FLEET_WINDOW_QUANTITIES and value.get("total"):
                    totals[quantity] = WindowHistogram.of(value["total"], value.get("total_sum"))
            else:
                figures[quantity] = value
        rows.append(EngineRow(server=server, engine=model or "(all)", model=model, kind=reading.kind.value,
                              state="up", at=reading.at, figures=figures, not_exported=list(reading.not_exported),
                              windows=windows, totals=totals))
    return ServerRows(server=server, at=reading.at, rows=rows, kind=reading.kind.value)
