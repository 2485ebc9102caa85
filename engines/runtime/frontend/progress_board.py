"""An engine loop's progress, readable without asking the engine.

A watchdog cannot ask a stopped or wedged engine how it is doing: the question is what goes
unanswered. So the loop writes three numbers where the server can read them at any time: the
steps it finished, when the step in flight began (NaN between steps) and the requests it held.
For an engine process they live in a 24-byte file under ``/dev/shm`` that both processes map;
for an engine thread, in memory. One ``struct.pack_into`` a step (well under a microsecond).
Times are ``time.monotonic()``: one clock for every process of the machine on Linux.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass

__all__ = ["ProgressBoard", "ProgressCounts"]

_LAYOUT = struct.Struct("=qdq")  # steps finished, step started at (NaN: none in flight), requests held


@dataclass(frozen=True, slots=True)
class ProgressCounts:
    """One read of the board: ``step_started_at`` is None between steps."""

    steps: int
    step_started_at: float | None
    work: int


class ProgressBoard:
    """Written by the engine loop, read by the server's watchdog. ``path``: the file an engine
    process maps (:meth:`create_file` makes one); None: in memory, for an engine thread."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._steps = 0
        if path is None:
            self._buffer: bytearray | mmap.mmap = bytearray(_LAYOUT.size)
        else:
            with open(path, "r+b") as f:
                self._buffer = mmap.mmap(f.fileno(), _LAYOUT.size)
        _LAYOUT.pack_into(self._buffer, 0, 0, math.nan, 0)

    @classmethod
    def create_file(cls, name: str) -> "ProgressBoard":
        """A board in a new file (in ``/dev/shm`` where there is one: memory, not disk)."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix=f"engine-progress-{name}-", dir=folder)
        os.ftruncate(fd, _LAYOUT.size)
        os.close(fd)
        return cls(path)

    def step_started(self, work: int) -> None:
        _LAYOUT.pack_into(self._buffer, 0, self._steps, time.monotonic(), work)

    def step_finished(self, work: int) -> None:
        self._steps += 1
        _LAYOUT.pack_into(self._buffer, 0, self._steps, math.nan, work)

    def idle(self) -> None:
        """Nothing held: said between steps, so a board never shows work that ended."""
        _LAYOUT.pack_into(self._buffer, 0, self._steps, math.nan, 0)

    def read(self) -> ProgressCounts:
        steps, started, work = _LAYOUT.unpack_from(self._buffer, 0)
        return ProgressCounts(steps, None if math.isnan(started) else started, work)

    def remove(self) -> None:
        """Delete the board's file (the parent's, when the engine is shut down)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
