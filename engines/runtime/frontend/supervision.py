"""What happens when an engine dies: its state as the server reports it, and the restart policy.

``AsyncEngine`` restarts an engine whose loop or process died, after a backoff, so one crash
(an out-of-memory kill, a driver fault) costs the requests in flight, not the rest of the run.
An engine that keeps dying is left dead: restarting it in a tight loop would only hide the
fault and burn the GPU's time. ``/debug/reset_engine`` restarts a dead engine by hand.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["EngineState", "EngineStatus", "RestartPolicy", "DeathLog"]


class EngineState(StrEnum):
    """Where an engine is in its life, as ``/health``, ``/stats`` and the registry show it."""

    STARTING = "starting"      # built, not started yet
    RUNNING = "running"
    RESTARTING = "restarting"  # died; a restart is scheduled or under way
    DEAD = "dead"              # died and will not be restarted (the policy gave up, or it is off)
    STOPPED = "stopped"        # shut down on purpose


@dataclass(frozen=True)
class EngineStatus:
    """An engine's state, why it is not running (when it is not), and how often it was restarted."""

    state: EngineState
    reason: str | None = None
    restarts: int = 0

    def describe(self) -> str:
        """``running``, ``restarting (reason)`` or ``dead (reason, restarts N)``."""
        if self.state is EngineState.DEAD:
            return f"dead ({self.reason or 'unknown'}, restarts {self.restarts})"
        if self.state is EngineState.RESTARTING:
            return f"restarting ({self.reason or 'unknown'})"
        return self.state.value

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: ``{"state", "reason", "restarts"}``."""
        return {"state": self.state.value, "reason": self.reason, "restarts": self.restarts}


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead engine is restarted.

    The n-th attempt after a death waits ``first_delay_s * 2**n`` seconds (at most
    ``max_delay_s``). An engine that died ``max_deaths`` times within ``window_s`` seconds, or
    whose restart failed ``max_deaths`` times in a row, stays dead.
    """

    enabled: bool = True
    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    max_deaths: int = 5
    window_s: float = 600.0

    def delay_s(self, attempt: int) -> float:
        """Seconds to wait before restart attempt ``attempt`` (0 first)."""
        return min(self.first_delay_s * (2 ** attempt), self.max_delay_s)


@dataclass
class DeathLog:
    """The recent deaths of one engine, to tell a crash from a crash loop."""

    policy: RestartPolicy
    times: deque[float] = field(default_factory=deque)

    def record(self, now: float | None = None) -> int:
        """Note a death; returns how many fell within the policy's window, this one included."""
        now = time.monotonic() if now is None else now
        self.times.append(now)
        while self.times and now - self.times[0] > self.policy.window_s:
            self.times.popleft()
        return len(self.times)

    def exhausted(self, deaths_in_window: int) -> bool:
        """Whether the engine should stay dead."""
        return not self.policy.enabled or deaths_in_window >= self.policy.max_deaths
