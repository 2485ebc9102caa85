"""One warning per outage for a fleet loop that retries: a server kept open all day must not log a
line every few seconds while Redis or the database is down, and must say when the loop works again."""
from __future__ import annotations

import logging
import time

__all__ = ["OutageLog"]

logger = logging.getLogger("engines.fleet")


class OutageLog:
    """What a retrying loop tells the log: the first failure of an outage (a warning naming
    ``what``), nothing while it lasts, and how long it lasted once the loop works again (info)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._since: float | None = None  # when the outage began
        self._failures = 0

    @property
    def failing(self) -> bool:
        """Whether the loop's last try failed."""
        return self._since is not None

    def failed(self, exc: BaseException) -> None:
        """A try failed: warned at the first of an outage, counted after."""
        if self._since is None:
            self._since = time.monotonic()
            logger.warning("fleet: %s failed (%s); retrying, quietly until it works again", self.what, exc)
        self._failures += 1

    def worked(self) -> None:
        """A try worked: ends an outage (logged with its length and failed tries)."""
        if self._since is not None:
            logger.info("fleet: %s works again after %.0f s (%d failed tries)", self.what,
                        time.monotonic() - self._since, self._failures)
        self._since, self._failures = None, 0
