"""What a trace recorder held at one instant, as plain data (:class:`TraceWindow`): the input of
both Chrome-trace exporters (``chrome_trace``, the fast one, and ``chrome_trace_reference``).

Below ``trace_recorder``, which takes the window under its lock and imports the fast exporter, so
that the exporters can name their input without importing the recorder.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RecordedCall", "TraceWindow"]

# One add_event call as held in the buffer: (clock_ns, request ids, event, args or None,
# engine_lane). A plain tuple, not a class: building it is most of what recording costs.
RecordedCall = tuple[int, tuple[str, ...], str, Mapping[str, Any] | None, bool]


@dataclass(frozen=True, slots=True)
class TraceWindow:
    """What the recorder held at one instant, as plain data: the input of both exporters."""

    calls: Sequence[RecordedCall]   # in recorded order (timestamp order, at_ns aside)
    now_ns: int                     # the recorder clock at the take: closes still-open spans
    epoch_anchor_ns: int            # recorder clock + this = ns since the Unix epoch
    dropped_events: int             # trace events evicted since the last clear()
    max_events: int
    engine: str
    model: str
    backend: str
    version: str
