"""The folder where the runtime keeps what it builds once per machine and user."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_root"]


def default_cache_root() -> Path:
    """Where built artifacts live: ``$ENGINES_CACHE_DIR``, else ``~/.cache/llm-debugsite``."""
    env = os.environ.get("ENGINES_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llm-debugsite"
