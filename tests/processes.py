"""Process helpers for the tests that run a real server."""
from __future__ import annotations

from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid`` (from every one of its threads; one that ends meanwhile is skipped)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
    return children
