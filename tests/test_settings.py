"""Settings read from the environment: a bad limit stops start-up with a message; the secret key
kept on disk when none is configured; the cookies named after the port."""
from __future__ import annotations

import multiprocessing
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from debugsite import secret_key

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


@pytest.mark.parametrize(("port", "names"), [("8123", "sessionid_8123 csrftoken_8123"), ("", "sessionid csrftoken")])
def test_the_cookies_are_named_after_the_port_from_the_environment(port, names):
    """A bare Daphne told its port (ENGINES_PORT) names its cookies as serve does (--port)."""
    result = subprocess.run(
        [sys.executable, "-c", "import debugsite.settings as s; print(s.SESSION_COOKIE_NAME, s.CSRF_COOKIE_NAME)"],
        cwd=REPO, env={**os.environ, "ENGINES_PORT": port}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == names, result.stderr


def test_a_new_secret_key_is_private_and_kept(tmp_path):
    path = tmp_path / "secret_key"
    key = secret_key.kept_secret_key(path)
    assert len(key) >= 50 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert secret_key.kept_secret_key(path) == key
    assert [p.name for p in tmp_path.iterdir()] == ["secret_key"]  # no candidate file left behind


def test_a_key_another_server_made_meanwhile_wins(tmp_path, monkeypatch):
    """Another server's key lands between this one's look and its write: this one keeps the
    other's (written in place, it overwrote a key the other server already used)."""
    path = tmp_path / "secret_key"
    token = secret_key.secrets.token_urlsafe

    def theirs_lands_first(n: int) -> str:
        path.write_text("their-key")
        return token(n)

    monkeypatch.setattr(secret_key.secrets, "token_urlsafe", theirs_lands_first)
    assert secret_key.kept_secret_key(path) == "their-key"
    assert path.read_text() == "their-key"
    assert [p.name for p in tmp_path.iterdir()] == ["secret_key"]


def _key_after(barrier, path: Path, keys) -> None:
    barrier.wait()
    keys.put(secret_key.kept_secret_key(path))


def test_servers_starting_at_once_agree_on_one_key(tmp_path):
    """Twelve processes released together on a fresh folder: one key, never an empty one."""
    ctx = multiprocessing.get_context("fork")
    barrier, keys, path = ctx.Barrier(12), ctx.Queue(), tmp_path / "secret_key"
    processes = [ctx.Process(target=_key_after, args=(barrier, path, keys)) for _ in range(12)]
    for p in processes:
        p.start()
    got = [keys.get(timeout=60) for _ in processes]
    for p in processes:
        p.join(60)
    assert all(p.exitcode == 0 for p in processes)
    assert len(set(got)) == 1 and got[0] == path.read_text() and len(got[0]) >= 50
