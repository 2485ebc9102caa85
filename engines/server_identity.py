"""This server process's identity: the name its dashboard snapshots, its fleet card and its jobs
carry, so that servers sharing a Redis channel layer (and a database) stay apart.

Below both the dashboard and the fleet: each names the server the same way and neither imports
the other for it.
"""
from __future__ import annotations

import os
import socket

__all__ = ["SERVER_ID"]

#: This server process, as snapshots name it: host and process id.
SERVER_ID = f"{socket.gethostname()}:{os.getpid()}"
