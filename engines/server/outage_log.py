"""One warning an outage and one line when it ends, for whatever keeps trying a dependency that
went away (Redis, the database): a server kept open all day must not log a line every few
seconds, every sample or every request while it is down, and must say when it works again.

The one way the server says an outage: the fleet's loops (``fleet: ... failed``), the history's
database (``engines.history.outage``) and the dashboard's channel layer
(``engines.dashboard.sampler``) each keep an :class:`OutageLog` in their own words.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["RETRYING", "OutageLog"]

#: What a loop that retries does meanwhile (the fleet's loops).
RETRYING = "retrying, quietly until it works again"


class OutageLog:
    """What ``logger`` is told of ``what``'s outages: the first failure of each (a warning:
    ``"<what> <down> (<reason>); <meanwhile>"``), nothing while it lasts, and once a try works
    again how long it lasted (info: ``"<what> <back> after 12 s (40 failed tries)"``).

    Thread-safe: requests that need the database fail on many threads at once, and the lock keeps
    their outage to one line."""

    def __init__(self, logger: logging.Logger, what: str, *, down: str = "failed", meanwhile: str = RETRYING,
                 back: str = "works again", describe: Callable[[BaseException], str] = str) -> None:
        self.logger = logger
        self.what = what
        self.down, self.meanwhile, self.back = down, meanwhile, back
        self.describe = describe
        self._lock = threading.Lock()
        self._since: float | None = None  # when the outage began
        self._failures = 0

    @property
    def failing(self) -> bool:
        """Whether the last try failed."""
        return self._since is not None

    def failed(self, exc: BaseException) -> str:
        """A try failed: warned at the first of an outage, counted after. Returns its reason
        (``describe(exc)``), for an answer that says why."""
        reason = self.describe(exc)
        with self._lock:
            first = self._since is None
            if first:
                self._since = time.monotonic()
            self._failures += 1
        if first:
            self.logger.warning("%s %s (%s); %s", self.what, self.down, reason, self.meanwhile)
        return reason

    def worked(self) -> None:
        """A try worked: ends an outage (logged with its length and failed tries)."""
        with self._lock:
            since, failures = self._since, self._failures
            self._since, self._failures = None, 0
        if since is not None:
            self.logger.info("%s %s after %.0f s (%d failed tries)", self.what, self.back,
                             time.monotonic() - since, failures)
