"""The stall rules on constructed readings: each opens an incident once, and progress closes it."""
from __future__ import annotations

import pytest

from engines.watchdog.detector import ProgressReading as R
from engines.watchdog.detector import StallDetector, StallThresholds

T = StallThresholds(no_progress_s=1.0, step_s=2.0, loop_lag_s=0.5)


def test_work_waiting_without_a_step_opens_one_incident_and_progress_closes_it() -> None:
    d = StallDetector("m", T)
    assert d.observe(R(0.0, steps=5, work=2)) is None
    assert d.observe(R(0.9, steps=5, work=2)) is None
    opened = d.observe(R(1.2, steps=5, work=2))
    assert opened is not None and opened.reason == "no_progress" and "2 request(s)" in opened.detail
    assert d.observe(R(3.0, steps=None, work=2)) is None  # still stalled: not a second incident
    assert d.stalls_total == 1 and d.incident is opened and opened.open
    assert d.observe(R(4.5, steps=6, work=2)) is None
    assert d.incident is None and not opened.open and opened.duration_s == pytest.approx(3.3)


def test_an_unanswered_poll_is_no_progress_and_says_so() -> None:
    d = StallDetector("m", T)
    d.observe(R(0.0, steps=5, work=1))
    opened = d.observe(R(1.5, steps=None, work=1))
    assert opened is not None and "does not answer" in opened.detail


def test_idle_is_not_stalled() -> None:
    d = StallDetector("m", T)
    for t in range(10):
        assert d.observe(R(float(t), steps=5, work=0)) is None
    assert d.stalls_total == 0


def test_a_long_step_opens_before_the_no_progress_limit_would() -> None:
    d = StallDetector("m", StallThresholds(no_progress_s=100.0, step_s=2.0, loop_lag_s=0.5))
    d.observe(R(0.0, steps=1, work=1, step_started_at=0.0))
    opened = d.observe(R(2.5, steps=1, work=1, step_started_at=0.0))
    assert opened is not None and opened.reason == "long_step"
    assert d.observe(R(3.0, steps=2, work=1)) is None and d.incident is None


def test_loop_lag_opens_and_closes_with_the_loop() -> None:
    d = StallDetector("m", T)
    d.observe(R(0.0, steps=1, work=0))
    opened = d.observe(R(0.2, steps=1, work=0, loop_lag_s=0.8))
    assert opened is not None and opened.reason == "loop_lag"
    assert d.observe(R(0.4, steps=1, work=0, loop_lag_s=0.01)) is None and d.incident is None


def test_a_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="step_s"):
        StallThresholds(step_s=0)
