"""The server's secret key when none is configured: generated on first start and kept on disk."""
from __future__ import annotations

import os
import secrets
from pathlib import Path


def kept_secret_key(path: Path) -> str:
    """The key kept at ``path``, made there first if there is none.

    Servers started together on a fresh var folder (a prefill and a decode server) race to make
    it. Each writes its candidate to a private file of its own and hard-links it into place:
    ``link`` never replaces a file, so the first key to land is every server's, and a reader never
    sees a half-written one (writing ``path`` in place let a second server read it empty, and two
    servers keep different keys)."""
    if not path.exists():
        candidate = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}")
        fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(50))
            os.link(candidate, path)
        except FileExistsError:
            pass  # another server's key landed first: it is ours too
        finally:
            candidate.unlink()
    return path.read_text().strip()
