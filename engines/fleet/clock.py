"""A member's clock against the fleet's reference clock (the Redis server's ``TIME``), measured as
NTP measures against one server (``merged_trace`` says how it is used)."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["ClockOffset", "ClockTracker", "measure_offset"]


@dataclass(frozen=True)
class ClockOffset:
    """This clock minus the reference clock, in seconds, known to within ``uncertainty_s``."""

    offset_s: float
    uncertainty_s: float
    measured_at: float


async def measure_offset(reference_now: Callable[[], Awaitable[float]],
                         local_now: Callable[[], float] = time.time) -> ClockOffset:
    """One measurement: the local clock before and after reading the reference."""
    before = local_now()
    reference = await reference_now()
    after = local_now()
    return ClockOffset(offset_s=(before + after) / 2 - reference, uncertainty_s=max(0.0, after - before) / 2,
                       measured_at=after)


class ClockTracker:
    """The best of the last few measurements (the one with the shortest round trip: a delayed
    answer says the least about when the reference read its clock)."""

    def __init__(self, keep: int = 8) -> None:
        self._recent: deque[ClockOffset] = deque(maxlen=keep)

    def add(self, measured: ClockOffset) -> ClockOffset:
        self._recent.append(measured)
        return self.best  # type: ignore[return-value]  # not None: one was just added

    @property
    def best(self) -> ClockOffset | None:
        return min(self._recent, key=lambda m: m.uncertainty_s, default=None)
