"""Settings read from the environment: a bad limit stops start-up with a message."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def load_settings(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import debugsite.settings as s; print(s.TRACE_RETENTION_MAX_RECORDS)"],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("TRACE_RETENTION_MAX_RECORDS", "-1", "must be a finite number >= 0"),
    ("TRACE_RETENTION_MAX_DAYS", "ten", "must be an integer"),
    ("METRICS_SNAPSHOT_INTERVAL_S", "nan", "must be a finite number >= 0"),
    ("METRICS_SNAPSHOT_INTERVAL_S", "inf", "must be a finite number >= 0"),
])
def test_bad_limits_are_refused_at_start(name, value, message):
    result = load_settings(**{name: value})
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and name in result.stderr and message in result.stderr


def test_limits_from_the_environment():
    result = load_settings(TRACE_RETENTION_MAX_RECORDS="7")
    assert result.returncode == 0 and result.stdout.strip() == "7"
