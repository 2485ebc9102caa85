"""What happens when an engine dies: its state as the server reports it, and the restart policy.

``AsyncEngine`` restarts an engine whose loop or process died, after a backoff, so one crash
(an out-of-memory kill, a driver fault) costs the requests in flight, not the rest of the run.
An engine that keeps dying is left dead: restarting it in a tight loop would only hide the
fault and burn the GPU's time. ``/debug/reset_engine`` restarts a dead engine by hand.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

logger = logging.getLogger("engines.runtime")

__all__ = ["DeathLog", "EngineState", "EngineStatus", "RestartPolicy", "Supervisor"]


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


class Supervisor:
    """One engine's life: its state as the server reports it, its deaths, and the restarts its
    policy allows, after a backoff, on a thread of their own.

    Args:
        name: the engine's name, for the log.
        policy: when to restart.
        restart: replaces the dead engine with a fresh one; blocks while it loads, raises what a
            failed start raises (``AsyncEngine.restart``).
    """

    def __init__(self, name: str, policy: RestartPolicy, restart: Callable[[], None]) -> None:
        self.name = name
        self.deaths = DeathLog(policy)
        self._restart = restart
        self.state = EngineState.STARTING
        self.reason: str | None = None
        #: How many times the engine was restarted after dying (or by hand, once dead).
        self.restarts = 0
        #: Set by a shutdown: no restart may start after it.
        self.stopping = threading.Event()

    @property
    def status(self) -> EngineStatus:
        """State, the reason it is not running, and the restart count."""
        return EngineStatus(self.state, self.reason, self.restarts)

    def set(self, state: EngineState, reason: str | None = None) -> None:
        """The engine is now in ``state`` (for ``reason``)."""
        self.state, self.reason = state, reason

    def restarted(self) -> None:
        """A fresh engine replaced the old one and runs."""
        self.restarts += 1
        self.set(EngineState.RUNNING)
        logger.info("engine %s: restarted (restart %d)", self.name, self.restarts)

    def on_death(self, reason: str) -> None:
        """The engine died: settle its state (``restarting`` or ``dead``), log it once, and start
        the restarts the policy allows. Call it before failing what waited on the engine, so
        that whoever sees a failure also sees whether a restart is coming."""
        if self.stopping.is_set():
            return
        deaths = self.deaths.record()
        if self.deaths.exhausted(deaths):
            self.set(EngineState.DEAD, reason)
            policy = self.deaths.policy
            why = "restarts are off" if not policy.enabled else f"it died {deaths} times in {policy.window_s:.0f} s"
            logger.error("engine %s died (%s) and stays dead: %s; /debug/reset_engine restarts it",
                         self.name, reason, why)
            return
        self.set(EngineState.RESTARTING, reason)
        logger.error("engine %s died (%s); restarting it", self.name, reason)
        threading.Thread(target=self._restart_with_backoff, name=f"engine-{self.name}-restart", daemon=True).start()

    def _restart_with_backoff(self) -> None:
        policy = self.deaths.policy
        for attempt in range(policy.max_deaths):
            if self.stopping.wait(policy.delay_s(attempt)):
                return
            try:
                self._restart()
                return
            except Exception as e:  # noqa: BLE001 - a start that fails is tried again, then given up
                logger.error("engine %s: restart attempt %d failed: %r", self.name, attempt + 1, e)
                self.reason = f"restart failed: {e!r}"
        if not self.stopping.is_set():
            self.set(EngineState.DEAD, self.reason)
            logger.error("engine %s: gave up after %d failed restarts; /debug/reset_engine restarts it",
                         self.name, policy.max_deaths)
