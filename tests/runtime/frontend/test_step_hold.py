"""The test-only step hold (``ENGINES_TEST_STEP_HOLD``): off unless set, the N-th step held, a bad
value refused with the form it takes."""
from __future__ import annotations

import time

import pytest

from engines.runtime.frontend.step_hold import StepHold


def test_unset_it_holds_nothing() -> None:
    assert not StepHold("").armed


def test_it_holds_the_nth_step_once() -> None:
    hold = StepHold("2:0.2")
    took = []
    for _ in range(4):
        start = time.perf_counter()
        if hold.armed:
            hold.before_step()
        took.append(time.perf_counter() - start)
    assert took[1] >= 0.2 and max(took[0], took[2], took[3]) < 0.1 and not hold.armed


def test_a_bad_value_says_the_form() -> None:
    with pytest.raises(ValueError, match="STEP:SECONDS"):
        StepHold("twenty")
