"""Profiles that start themselves: what an armed profile waits for, and the watch that sees it.

``profile_start`` with a trigger arms the profiler instead of starting it. The engine tells the
armed watch what happens (each step's wall time, each first token, each request added); the first
event that meets a condition fires it, and the profile starts with the next step, so the step that
fired it (already run) is not in it but the next ones are, a triggering request's prefill among
them. ``delay_steps`` holds every condition back for that many steps (the warm-up after a restart,
a burst's first steps); with no other condition it alone starts the profile. One profile at a time,
armed or running; the trigger and what fired it are kept with the profile.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["ArmedTrigger", "ProfileTrigger"]


@dataclass(frozen=True)
class ProfileTrigger:
    """What starts an armed profile: ``delay_steps`` steps seen, and then the first of the event
    conditions given (none given: the delay alone)."""

    #: Steps to let pass before any condition counts.
    delay_steps: int = 0
    #: A step whose wall time (schedule, model, update) is over this many seconds.
    step_over_s: float | None = None
    #: The p99 (nearest rank) of the TTFTs of the last ``ttft_window_s`` seconds over this.
    ttft_p99_over_s: float | None = None
    ttft_window_s: float = 60.0
    #: A request with this id (ours or the client's ``X-Request-Id``) added to the engine.
    request_id: str | None = None
    #: A request from this ``user`` added to the engine.
    user: str | None = None

    @property
    def has_event(self) -> bool:
        """Whether a condition other than the delay is set."""
        return any(v is not None for v in (self.step_over_s, self.ttft_p99_over_s, self.request_id, self.user))

    def describe(self) -> str:
        """The trigger in a line, as the dashboard and the saved profile show it."""
        parts = []
        if self.step_over_s is not None:
            parts.append(f"a step over {self.step_over_s * 1000:g} ms")
        if self.ttft_p99_over_s is not None:
            parts.append(f"TTFT p99 of the last {self.ttft_window_s:g} s over {self.ttft_p99_over_s * 1000:g} ms")
        if self.request_id is not None:
            parts.append(f"request {self.request_id!r} arriving")
        if self.user is not None:
            parts.append(f"a request of user {self.user!r} arriving")
        if not parts:
            return f"after {self.delay_steps} steps"
        what = " or ".join(parts)
        return f"{what}, after {self.delay_steps} steps" if self.delay_steps else what


class ArmedTrigger:
    """The watch of one armed profile (engine thread only). Each ``on_*`` returns what fired it
    (a sentence), once, or None; :attr:`fired_by` keeps it."""

    def __init__(self, trigger: ProfileTrigger) -> None:
        self.trigger = trigger
        self.steps_seen = 0
        self.fired_by: str | None = None
        self._ttfts: deque[tuple[float, float]] = deque()  # (when, ttft), the last window's

    @property
    def counting(self) -> bool:
        """Whether the delay has passed (conditions count from here)."""
        return self.steps_seen >= self.trigger.delay_steps

    def _fire(self, why: str) -> str | None:
        if self.fired_by is not None:
            return None
        self.fired_by = why
        return why

    def on_step(self, seconds: float) -> str | None:
        """A step ran for ``seconds`` of wall time."""
        held = not self.counting  # this step is one of the delay's
        self.steps_seen += 1
        t = self.trigger
        if not t.has_event:
            return self._fire(f"{self.steps_seen} steps passed") if self.counting else None
        if held:
            return None
        if t.step_over_s is not None and seconds > t.step_over_s:
            return self._fire(f"step {self.steps_seen} took {seconds * 1000:.0f} ms (over {t.step_over_s * 1000:g} ms)")
        return None

    def on_first_token(self, ttft_s: float, now: float) -> str | None:
        """A request got its first token ``ttft_s`` after its arrival, at ``now`` (perf_counter)."""
        t = self.trigger
        if t.ttft_p99_over_s is None:
            return None
        window = self._ttfts
        window.append((now, ttft_s))
        while window and window[0][0] < now - t.ttft_window_s:
            window.popleft()
        if not self.counting:
            return None
        p99 = nearest_rank([v for _, v in window], 0.99)
        if p99 > t.ttft_p99_over_s:
            return self._fire(f"TTFT p99 of the last {t.ttft_window_s:g} s reached {p99 * 1000:.0f} ms over "
                              f"{len(window)} requests (over {t.ttft_p99_over_s * 1000:g} ms)")
        return None

    def on_request(self, request_id: str, client_request_id: str | None, user: str | None) -> str | None:
        """A request was added to the engine."""
        t = self.trigger
        if not self.counting:
            return None
        if t.request_id is not None and t.request_id in (request_id, client_request_id):
            return self._fire(f"request {t.request_id!r} arrived")
        if t.user is not None and user == t.user:
            return self._fire(f"request {request_id!r} of user {t.user!r} arrived")
        return None


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (the smallest value with at least ``q`` of
    them at or below it); ``values`` must not be empty."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]
