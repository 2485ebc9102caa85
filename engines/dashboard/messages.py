"""The messages of a dashboard websocket, and the channel-layer group names they travel in.

Server to browser, each a JSON object with a ``type``:

* ``snapshot``: :class:`EngineSnapshot`, an engine's state and metrics, several times a second.
* ``history``: :class:`EngineHistory`, the last five minutes of an engine's chart fields, once when
  a socket opens (so a page's charts start full, not empty).
* ``ack``, ``progress``, ``done``, ``error``: :class:`ActionEvent`, about the action the browser
  sent with that ``id`` (``error`` without an ``id``: a message that could not be read at all).
* ``feed``: :class:`FeedEvent`, whether the snapshots arrive: once when a socket opens, then at each
  change (``interrupted`` while the channel layer does not carry them, ``live`` when they come again).

Browser to server: :class:`engines.engine_actions.ActionRequest`. Every snapshot names the server process it came from
(:func:`engines.server.server_identity.server_id`), so that servers sharing a Redis channel layer can feed
one fleet-wide view.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from pydantic import BaseModel, StrictInt, StrictStr

from engines.profiling import ProfileState

__all__ = ["CHART_FIELDS", "ActionEvent", "ActionEventType", "EngineHistory",
           "EngineSnapshot", "FeedEvent", "FeedState", "engine_group", "chart_values"]

_GROUP_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def engine_group(engine: str) -> str:
    """The channel-layer group an engine's snapshots go to. Group names allow only ASCII letters,
    digits, ``-_.`` and under 100 characters, and a served name may hold anything else, so the
    name is cleaned and a hash of the real one keeps two names that clean alike apart."""
    digest = hashlib.sha256(engine.encode()).hexdigest()[:12]
    return f"dashboard.engine.{_GROUP_UNSAFE.sub('_', engine)[:60]}.{digest}"


class StallBanner(BaseModel):
    """An engine's open stall incident as the page's banner shows it: the rule, its words, since
    when (Unix seconds), and the incident's page in the history (None until it is written)."""

    reason: str
    detail: str
    since: float
    url: str | None = None


class EngineSnapshot(BaseModel):
    """One engine as of ``at`` (Unix seconds): who serves it, its state, and its metrics
    (``None`` while it is not running)."""

    type: Literal["snapshot"] = "snapshot"
    server: str
    engine: str
    at: float
    state: str
    reason: str | None = None
    restarts: int = 0
    backend: str
    dtype: str
    mode: Literal["process", "thread"]
    tracing: bool
    metrics: dict[str, Any] | None = None
    #: The last requests that ended, newest first (``RecentRequest`` fields); None while not running.
    recent_requests: list[dict[str, Any]] | None = None
    #: The requests in the engine now, oldest first (``LiveRequest`` fields, at most
    #: ``DEFAULT_LIVE_LIMIT`` of ``live_total``); None while not running.
    live_requests: list[dict[str, Any]] | None = None
    live_total: int | None = None
    #: The KV cache opened (``KVCacheDump`` fields); None while not running.
    kv_cache: dict[str, Any] | None = None
    #: The server is shutting down: it refuses new requests while those in flight finish.
    draining: bool = False
    #: Running, but its metrics read went unanswered (a long step or compilation holds it): the
    #: numbers are left out, the page says "slow to answer".
    slow: bool = False
    profile: ProfileState = ProfileState()
    #: The watchdog's open incident (``engines.watchdog.stall_watch``): the page's banner; None while none.
    stall: StallBanner | None = None


#: An ``ActionEvent``'s ``type``.
ActionEventType = Literal["ack", "progress", "done", "error"]


class ActionEvent(BaseModel):
    """The server's word on an action: taken (``ack``), under way (``progress``), finished
    (``done``, with its ``result``) or failed (``error``, with a ``message`` for the user)."""

    type: ActionEventType
    id: StrictStr | StrictInt | None = None
    action: str | None = None
    engine: str | None = None
    message: str | None = None
    result: dict[str, Any] | None = None
    #: The outcome of an action asked on an earlier socket of this user, which closed before it ended.
    earlier: bool | None = None


#: A :class:`FeedEvent`'s ``state``.
FeedState = Literal["live", "interrupted"]


class FeedEvent(BaseModel):
    """Whether the socket's snapshots arrive (``engines.dashboard.feed``): ``interrupted``, with the
    ``reason``, while the channel layer that carries them does not answer or none came for a while
    (the page marks its figures stale), ``live`` again with the next snapshot."""

    type: Literal["feed"] = "feed"
    state: FeedState
    reason: str | None = None
    at: float  # Unix seconds: when this server saw it change


#: The metrics the engine page's and the overview's charts draw, as paths into a snapshot's
#: ``metrics``: the engine's ``now`` figures (tokens/s and decode batch size over its steps of the
#: last ``NOW_WINDOW_S``, charted as they are, so a chart and the number beside it agree), gauges,
#: request counters (the pages rate them over the same window of samples), and the last
#: minute's percentiles.
CHART_FIELDS: tuple[str, ...] = (
    "now.prefill_tokens_per_s", "now.decode_tokens_per_s", "now.decode_batch_size", "now.decode_batch_size_max",
    "num_running_requests", "num_waiting_requests", "kv_cache_usage", "prefix_cache_hit_rate", "num_preemptions",
    "num_kv_evictions",
    "num_finished_requests", "num_aborted_requests", "num_failed_requests", "ttft_s.last_60s.p50",
    "ttft_s.last_60s.p99", "token_gap_s.last_60s.p50", "token_gap_s.last_60s.p99",
)


def chart_values(metrics: dict[str, Any] | None) -> tuple[float | None, ...]:
    """:data:`CHART_FIELDS` of one snapshot's metrics (all None while the engine gave none)."""
    if metrics is None:
        return (None,) * len(CHART_FIELDS)
    values: list[float | None] = []
    for path in CHART_FIELDS:
        value: Any = metrics
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        values.append(float(value) if isinstance(value, (int, float)) else None)
    return tuple(values)


class EngineHistory(BaseModel):
    """An engine's last five minutes as this server process sampled them: each sample's time and
    :data:`CHART_FIELDS` (null where the engine was down or slow to answer: a gap in the charts)."""

    type: Literal["history"] = "history"
    engine: str
    fields: list[str] = list(CHART_FIELDS)
    at: list[float]
    values: list[list[float | None]]  # one row a sample, in ``fields`` order
