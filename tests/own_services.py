"""A Redis and a PostgreSQL of a test's own, on spare ports, that it can stop and start again: the
outage tests' dependencies (issue 42). Never the machine's shared ones (6379, 5432)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.processes import free_port

PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), None)


def _wait_listening(port: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on port {port}"
            time.sleep(0.05)


class OwnRedis:
    """``redis-server`` on a spare port, in memory only: a restart forgets everything, as a Redis
    without persistence does (the channel layer's groups with it)."""

    def __init__(self, root: Path) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is missing: scripts/services.sh installs it")
        self.root, self.port = root, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.root)], stdout=subprocess.DEVNULL)
        _wait_listening(self.port)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


class OwnPostgres:
    """A PostgreSQL cluster of its own (``initdb`` as the postgres user) on a spare port, in a
    folder of its own under /tmp (pytest's are closed to other users), its socket there too; trust
    authentication, user ``postgres``. :meth:`remove` stops it and deletes the folder."""

    def __init__(self) -> None:
        if PG_BIN is None:
            pytest.fail("PostgreSQL is not installed (/usr/lib/postgresql/*/bin)")
        self.data, self.port = Path(tempfile.mkdtemp(prefix="own-postgres-")), free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/postgres"
        shutil.chown(self.data, "postgres")
        self._as_postgres("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres")

    def _as_postgres(self, tool: str, *args: str) -> None:
        assert PG_BIN is not None
        subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / tool), *args], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        self._as_postgres("pg_ctl", "-D", str(self.data), "-w", "-l", str(self.data / "log"), "-o",
                          f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1", "start")

    def stop(self) -> None:
        """A fast shutdown, as a restart or a failover does it: connections are cut."""
        self._as_postgres("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self.stop()
        shutil.rmtree(self.data, ignore_errors=True)
