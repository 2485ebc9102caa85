"""The messages of a live timeline websocket (``/ws/engines/<name>/timeline/``).

Browser to server: :class:`TimelineRequest`. ``follow`` starts (or, after a reconnect, resumes)
the stream of the engine's trace from ``cursor`` (0: everything the recorder holds); a new
``follow`` replaces the one before, and its ``tag`` comes back in each of its deltas, so a
client tells them from the previous stream's deltas already in flight.

Server to browser, each a JSON object with a ``type``:

* ``hello``: :class:`TimelineHello`, once, on connect.
* ``trace_delta``: :class:`TraceDeltaHeader`'s fields plus ``calls``, the recorder's
  ``TraceDelta.calls_json`` spliced in as it came from the engine (one
  ``[ts_us, [request ids], event, args, engine_lane]`` per call): a few times a second, or
  back to back while catching up (``more``).
* ``restarted``: :class:`TimelineRestarted`, the engine's recorder is a new one (the engine was
  restarted): drop what was drawn and follow again from 0.
* ``error``: :class:`TimelineError`, a message that could not be read, tracing off, or the
  engine down; the socket stays open.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

__all__ = ["TimelineError", "TimelineHello", "TimelineRequest", "TimelineRestarted", "TraceDeltaHeader"]


class TimelineRequest(BaseModel):
    """What the browser asks of a live timeline socket."""

    model_config = ConfigDict(extra="forbid")
    action: Literal["follow"]
    cursor: StrictInt = Field(default=0, ge=0)
    tag: StrictInt = Field(default=0, ge=0, le=2**53)  # echoed in this stream's deltas


class TimelineHello(BaseModel):
    """The socket's first message: who serves the engine, whether it records a trace, how often deltas come."""

    type: Literal["hello"] = "hello"
    server: str
    engine: str
    tracing: bool
    interval_s: float


class TraceDeltaHeader(BaseModel):
    """A ``trace_delta`` message without its ``calls`` (``TraceDelta``'s other fields)."""

    type: Literal["trace_delta"] = "trace_delta"
    engine: str
    tag: int            # the ``tag`` of the follow this delta answers
    cursor: int
    missed: int
    more: bool
    now_us: int
    held_events: int
    dropped_events: int


class TimelineRestarted(BaseModel):
    """The engine's recorder is a new one: the stream goes on from its cursor 0."""

    type: Literal["restarted"] = "restarted"
    engine: str


class TimelineError(BaseModel):
    """What went wrong (a bad message, tracing off, the engine down); the socket stays open."""

    type: Literal["error"] = "error"
    message: str
