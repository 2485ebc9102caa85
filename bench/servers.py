"""``manage.py serve`` subprocesses for the benches: started on a free port, healthy before use."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def launch(args: list[str], var_dir: str | Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """``manage.py serve ARGS`` on a free loopback port; returns the process and its base URL once
    ``/health`` answers (exits the bench with the server's stderr if it dies first)."""
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if k != "API_KEY"} | (env or {})
    full_env["DEBUGSITE_VAR_DIR"] = str(Path(var_dir).resolve())
    server = subprocess.Popen([sys.executable, "manage.py", "serve", *args, "--port", str(port)], cwd=REPO,
                              env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(server, base)
    return server, base


def wait_healthy(server: subprocess.Popen, base: str, timeout: float = 180) -> None:
    """Block until ``base/health`` answers 200."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as http:  # one client: each makes an SSL context, ~50 ms of CPU
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {server.stderr.read() if server.stderr else ''}")
            try:
                if http.get(f"{base}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise SystemExit("the server did not become healthy in time")


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
