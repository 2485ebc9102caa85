"""Prometheus' own checker, ``promtool`` (Debian's ``prometheus`` package, 2.42), for the tests of
``/metrics`` and of the rules in ``docs/prometheus/``.

``scripts/test.sh`` installs the package where promtool is missing, as it installs chromium, so a
test never skips for want of it: a missing promtool fails, saying so.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

__all__ = ["promtool"]


def promtool(*args: str, stdin: str | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``promtool ARGS`` (``stdin`` on its standard input); fails the test when promtool is missing."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: scripts/test.sh installs it (Debian's prometheus package, "
                    "apt-get install --no-install-recommends prometheus)")
    return subprocess.run([path, *args], input=stdin, capture_output=True, text=True, timeout=timeout_s)
