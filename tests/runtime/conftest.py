"""Fixtures for the runtime tests."""
from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def quick_simulator_barriers() -> Iterator[None]:
    """The simulator's block manager polls its threads while holding the GIL, so at the
    default 5 ms switch interval every barrier costs several intervals; 0.5 ms makes the
    simulated kernels about 3x faster. Harmless on a real GPU."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)
    yield
    sys.setswitchinterval(previous)
