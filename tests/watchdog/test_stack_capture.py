"""py-spy reads a live process's stacks, and a stopped one yields stacks or a stated reason."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from engines.watchdog.stack_capture import outside_stacks

SLEEPER = "import time\ndef parked_here():\n    time.sleep(120)\nparked_here()\n"


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    p = subprocess.Popen([sys.executable, "-c", SLEEPER])
    time.sleep(1.0)  # let the interpreter reach the function
    yield p
    os.kill(p.pid, signal.SIGCONT)
    p.kill()
    p.wait()


def test_a_running_process_stacks_name_its_function(sleeper: subprocess.Popen) -> None:
    got = outside_stacks(sleeper.pid)
    # No skip without ptrace: the watchdog's evidence needs it, so a machine that denies it fails here.
    assert got.missing is None, got.missing
    assert got.text is not None and "parked_here" in got.text


def test_a_stopped_process_gives_stacks_or_the_reason(sleeper: subprocess.Popen) -> None:
    os.kill(sleeper.pid, signal.SIGSTOP)
    got = outside_stacks(sleeper.pid, timeout_s=10)
    assert (got.text is not None and "parked_here" in got.text) or (got.missing and "py-spy" in got.missing)
