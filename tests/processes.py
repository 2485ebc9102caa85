"""Process helpers for the tests that run a real server."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from debugsite.cookies import cookie_names

REPO = Path(__file__).resolve().parents[1]


class Server:
    """A ``manage.py serve`` subprocess, with an httpx client and an ``openai`` client on it."""

    def __init__(self, process: subprocess.Popen, port: int, api_key: str | None = None) -> None:
        self.process = process
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base, timeout=60, headers=headers)
        self.openai = openai.OpenAI(base_url=f"{self.base}/v1", api_key=api_key or "not-needed", max_retries=0)

    @property
    def csrf_cookie(self) -> str:
        """The name of this server's CSRF cookie (named after its port: debugsite/cookies.py)."""
        return cookie_names(self.port)[1]

    def output(self) -> str:
        """Everything the server printed (only once it has exited)."""
        return self.process.stdout.read() if self.process.stdout else ""

    def stop(self) -> None:
        """Kill the server if it still runs."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


# One interpreter for both (manage.py migrate, then manage.py createsuperuser, booted Django twice:
# 9 s a site on the Xeon where this takes 2.4).
_MIGRATE_AND_ADD_ADMIN = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
call_command("createsuperuser", interactive=False, username="admin", email="a@example.com", verbosity=0)
"""


def migrate_and_add_admin(env: dict[str, str]) -> None:
    """Migrate the database ``env`` names (``DEBUGSITE_VAR_DIR``'s SQLite, or ``DATABASE_URL``) and
    add the superuser ``admin`` with the password ``env["DJANGO_SUPERUSER_PASSWORD"]``."""
    subprocess.run([sys.executable, "-c", _MIGRATE_AND_ADD_ADMIN], cwd=REPO, check=True,
                   env={**env, "DJANGO_SETTINGS_MODULE": "debugsite.settings"})


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: list[str], var_dir: Path, api_key: str | None = None, timeout_s: float = 180,
                 env: dict[str, str] | None = None) -> Server:
    """``manage.py serve ARGS --port P`` on a free port, once it answers ``/health`` (the test
    fails with the server's output if it exits or stays silent); ``env`` adds to its environment
    (a fleet's ``REDIS_URL``, ``FLEET_NAME`` and shared ``DATABASE_URL``)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")} \
        | {"DEBUGSITE_VAR_DIR": str(var_dir), "PYTHONUNBUFFERED": "1"} | (env or {})
    if api_key:
        env["API_KEY"] = api_key
    process = subprocess.Popen(
        [sys.executable, "manage.py", "serve", *args, "--port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    srv = Server(process, port, api_key)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{srv.output()}")
        try:
            if srv.http.get("/health").status_code == 200:
                return srv
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the server did not answer /health in time:\n{srv.output()}")
        time.sleep(0.2)


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid`` (from every one of its threads; one that ends meanwhile is skipped)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
    return children


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, reparented and waiting to be reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
