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


def launch(args: list[str], var_dir: str | Path, env: dict[str, str] | None = None,
           timeout: float = 180) -> tuple[subprocess.Popen, str]:
    """``manage.py serve ARGS`` on a free loopback port; returns the process and its base URL once
    ``/health`` answers within ``timeout`` seconds (exits the bench with the server's stderr if it
    dies first, and stops it if it is still starting then)."""
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if k != "API_KEY"} | (env or {})
    full_env["DEBUGSITE_VAR_DIR"] = str(Path(var_dir).resolve())
    server = subprocess.Popen([sys.executable, "manage.py", "serve", *args, "--port", str(port)], cwd=REPO,
                              env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, base, timeout)
    except SystemExit:
        stop(server)  # one still compiling its kernels would outlive the bench
        raise
    return server, base


def wait_healthy(server: subprocess.Popen, base: str, timeout: float = 180, path: str = "/health") -> None:
    """Block until ``base`` + ``path`` answers 200 (another server's readiness route: ``path``)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as http:  # one client: each makes an SSL context, ~50 ms of CPU
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {server.stderr.read() if server.stderr else ''}")
            try:
                if http.get(f"{base}{path}").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"the server did not become healthy in {timeout:.0f} s")


def stop(server: subprocess.Popen, timeout: float = 30) -> None:
    """End a server a bench started (SIGTERM: it stops its engines' processes too), and wait for it;
    killed if it is not gone in ``timeout`` seconds."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
