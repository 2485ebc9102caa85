"""What a fleet member publishes and what a fleet page is sent: typed, one definition each.

Every engine of every server, ours or foreign, becomes one :class:`EngineRow`: the quantities of
:data:`~engines.fleet.server_kinds.QUANTITIES` as figures (gauges as read, counters as rates per
second, latencies as p50/p99 over the last minute), the quantities its server does not export
named as such, and the last minute's histogram of TTFT and ITL (:class:`WindowHistogram`), so
that a fleet percentile is computed from the servers' own buckets (``quantiles.fleet_quantile``)
and never from per-server percentiles or from buckets summed across different bounds.
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel

from engines.fleet.quantiles import Buckets

__all__ = ["FLEET_WINDOW_QUANTITIES", "EngineRow", "EngineWeights", "FleetRequest", "FleetRowsUpdate", "FleetServer",
           "FleetSocketError", "FleetTotals", "FleetUnavailable", "FleetView", "ServerRows", "TotalQuantile",
           "WindowHistogram"]

#: The latencies whose last-minute histograms travel with a row, for the fleet's percentiles.
FLEET_WINDOW_QUANTITIES = ("ttft", "itl")


class WindowHistogram(BaseModel):
    """A histogram over some span (a row's last minute, a rollup's minute, or since its source's
    reset): its finite upper bounds and the cumulative count at each, then the total (the ``+Inf``
    bucket; JSON has no infinity), and the observations' sum where the source gives one."""

    bounds: list[float]
    cumulative: list[float]  # len(bounds) + 1
    sum: float | None = None

    @classmethod
    def of(cls, buckets: Buckets, total_sum: float | None = None) -> WindowHistogram:
        finite = [(b, c) for b, c in buckets if not math.isinf(b)]
        total = buckets[-1][1] if buckets else 0.0
        return cls(bounds=[b for b, _ in finite], cumulative=[c for _, c in finite] + [total], sum=total_sum)

    def buckets(self) -> Buckets:
        return (*zip(self.bounds, self.cumulative, strict=False), (math.inf, self.cumulative[-1]))


class EngineRow(BaseModel):
    """One engine (ours) or one served model (foreign) as the fleet grid shows it."""

    server: str                      # the server id (ours) or the foreign server's name
    engine: str
    model: str = ""
    kind: str = "ours"               # a ServerKind value
    state: str                       # ours: the engine's state; foreign: "up" or "unreachable"
    at: float                        # Unix time of the reading, on the publishing server's clock
    #: quantity -> value (rates per second); latencies as "<q>_p50"/"<q>_p99" in seconds; None: unknown yet.
    figures: dict[str, float | None] = {}
    not_exported: list[str] = []
    windows: dict[str, WindowHistogram] = {}
    #: The same histograms since their source's last reset, as read (with their sums): what the
    #: rollups count each minute's observations from, exactly (``rollups.RollupWriter``).
    totals: dict[str, WindowHistogram] = {}
    error: str | None = None


class ServerRows(BaseModel):
    """A server's engines, published once a second (ours) or after each poll (a foreign one)."""

    server: str
    at: float
    rows: list[EngineRow]
    kind: str = "ours"
    error: str | None = None         # a foreign server's poll error
    #: Ours: this server's clock minus the fleet's reference clock, and how well that is known.
    clock_offset_s: float | None = None
    clock_uncertainty_s: float | None = None


class EngineWeights(BaseModel):
    """What an engine of ours computes with and what its checkpoint holds (its card's words)."""

    in_memory: str                   # "Q4_1 x210, Q8_0 x1" (a GGUF's types kept), "float32", "pending"
    stored: str = ""                 # "GGUF F32 x61, Q4_1 x210, Q8_0 x1", "safetensors"


class FleetServer(BaseModel):
    """A server in the grid: a member of ours, or a foreign one attached by URL."""

    server: str
    name: str
    url: str
    kind: str
    version: str = ""
    roles: list[str] = []
    state: Literal["up", "gone", "stopped", "unreachable", "waiting"]
    last_seen: float | None = None   # Unix time of its last heartbeat or successful poll
    age_s: float | None = None
    error: str | None = None
    engines: int = 0
    #: Why a control is disabled on it (foreign servers without that endpoint): control -> reason.
    missing_controls: dict[str, str] = {}
    #: Ours: engine -> its dashboard page on this server (a foreign server's rows link to ``url``).
    engine_pages: dict[str, str] = {}
    #: Ours: engine -> its weights, as its card says (none for a foreign server, or an older one of ours).
    engine_weights: dict[str, EngineWeights] = {}


class TotalQuantile(BaseModel):
    """A fleet percentile with the interval the true value must lie in (the servers' buckets
    bound it), and how many observations it is over."""

    value: float | None
    low: float | None
    high: float | None
    count: float


class FleetTotals(BaseModel):
    engines: int
    servers_up: int
    running: float
    waiting: float
    prompt_tokens: float             # tokens/s, prefill
    generation_tokens: float         # tokens/s, decode
    quantiles: dict[str, TotalQuantile]  # "ttft_p50", "ttft_p99", "itl_p50", "itl_p99"


class FleetView(BaseModel):
    """The whole fleet, as every member's fleet page and ``/dashboard/fleet.json`` show it."""

    type: Literal["fleet"] = "fleet"
    fleet: str
    at: float
    shared: bool                     # False: no REDIS_URL, this server alone
    heartbeat_s: float               # seconds between a member's beats
    grace_s: float                   # a member is gone after heartbeat_s + grace_s without a beat
    servers: list[FleetServer]
    rows: list[EngineRow]
    totals: FleetTotals


class FleetUnavailable(BaseModel):
    """Sent instead of a view while the fleet's store (Redis) does not answer: the page says the
    feed is interrupted rather than showing the last numbers as if they were live."""

    type: Literal["fleet_unavailable"] = "fleet_unavailable"
    fleet: str
    at: float
    error: str


class FleetRequest(BaseModel):
    """What a fleet page sends: ``refresh`` (the view now, not at the next second)."""

    action: Literal["refresh"]


class FleetSocketError(BaseModel):
    """A fleet page's message that was not taken, and why (the socket stays open)."""

    type: Literal["error"] = "error"
    error: str


class FleetRowsUpdate(BaseModel):
    """Between two views, the rows servers published meanwhile (engine rows without their
    histograms): the page replaces those rows and leaves the rest."""

    type: Literal["fleet_rows"] = "fleet_rows"
    at: float
    rows: list[EngineRow]
