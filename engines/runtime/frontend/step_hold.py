"""A test-only hook: one engine step held for a while, as a device that hangs in a kernel would.

The watchdog's long-step rule (``engines.watchdog.stall_watch``) is tested against a real server whose
engine process holds one step: ``ENGINES_TEST_STEP_HOLD="N:S"`` holds the N-th step that has work
for S seconds (``tests/watchdog/test_stall_e2e.py``). Unset, as everywhere but that test, the
loop pays one attribute read a step. Read once, when the engine's loop is made.
"""
from __future__ import annotations

import os
import time

__all__ = ["ENV", "StepHold"]

ENV = "ENGINES_TEST_STEP_HOLD"


class StepHold:
    """Holds the ``step``-th step for ``seconds`` (from :data:`ENV`; none when unset)."""

    def __init__(self, value: str | None = None) -> None:
        value = os.environ.get(ENV, "") if value is None else value
        self.step, self.seconds, self._seen = 0, 0.0, 0
        if value:
            step, _, seconds = value.partition(":")
            try:
                self.step, self.seconds = int(step), float(seconds)
            except ValueError:
                raise ValueError(f'{ENV} must be "STEP:SECONDS", such as "3:20", not {value!r}') from None
        self.armed = self.step > 0 and self.seconds > 0

    def before_step(self) -> None:
        """Called before each step with work; sleeps through the held one."""
        self._seen += 1
        if self._seen == self.step:
            self.armed = False
            _held_for_a_test(self.seconds)


def _held_for_a_test(seconds: float) -> None:
    time.sleep(seconds)  # the stacks an incident takes show this frame
