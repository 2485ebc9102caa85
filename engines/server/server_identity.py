"""This server's identity: the name its dashboard snapshots, its fleet card, its jobs and its
history records carry, so that servers sharing a Redis channel layer and a database stay apart.

A server is named ``host:port``, where it listens (``serve`` says, :func:`configure`): readable,
and the same after a restart on the same port, so a server that comes back replaces its ghost in
the fleet and its history reads on as one line. A process that was not told its port (a bare
Daphne without ``ENGINES_PORT``, the tests' in-process servers) is ``host:pid<pid>``. The fleet's
name (``FLEET_NAME``) goes beside it, since one database may hold several fleets. A server that is
not one of ours, known by its URL, is named the same way: its URL's ``host:port``
(:func:`url_server_id`), so that a trace saved from it names the server that recorded it.

Below both the dashboard and the fleet: each names the server the same way and neither imports
the other for it.
"""
from __future__ import annotations

import functools
import os
import socket
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings

__all__ = ["configure", "fleet_name", "host_of", "server_id", "source_commit", "url_server_id"]

_HOST = socket.gethostname()
_port: int | None = int(os.environ["ENGINES_PORT"]) if os.environ.get("ENGINES_PORT", "").isdigit() else None


def configure(port: int) -> None:
    """This process serves on ``port`` (``serve`` calls it before anything names the server)."""
    global _port
    _port = port


def server_id() -> str:
    """This server: ``host:port``, or ``host:pid<pid>`` when no port was configured."""
    return f"{_HOST}:{_port}" if _port is not None else f"{_HOST}:pid{os.getpid()}"


def host_of(server: str) -> str:
    """The host part of a server id (``host`` of ``host:port`` and of ``host:pid<pid>``)."""
    return server.rpartition(":")[0]


def fleet_name() -> str:
    """The fleet this server belongs to (``FLEET_NAME``; one Redis or database may hold several)."""
    return str(getattr(settings, "FLEET_NAME", "default"))


def url_server_id(url: str) -> str:
    """A server known by its URL, named as :func:`server_id` names ours: ``host:port``, with the
    port its scheme implies when the URL gives none."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@functools.cache
def source_commit() -> str:
    """The git commit this server's code is at (``SOURCE_COMMIT`` where set, for an install without
    its ``.git``), with ``-dirty`` for uncommitted changes; empty when neither says. A replay's run
    keeps it (``/stats``), so a regression report names the two commits it compares."""
    if os.environ.get("SOURCE_COMMIT"):
        return os.environ["SOURCE_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{head}-dirty" if dirty else head
