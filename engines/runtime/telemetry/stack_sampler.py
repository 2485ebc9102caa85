"""An in-process sampler of one thread's Python stack, for flame graphs.

A daemon thread reads ``sys._current_frames()`` every ``interval_s`` and counts the watched
thread's stacks, folded as ``"file:function;file:function;..."`` from the outermost frame (the
format flame graph tools read). Nothing to install, and nothing runs when no profile asks for
it; each sample costs the engine one GIL hand-over.
"""
from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["StackSampler", "fold"]

#: Frames kept from the outermost: deeper stacks are cut (and marked) rather than unbounded.
MAX_DEPTH = 64


def fold(frame: FrameType | None) -> str:
    """``frame``'s stack as one folded line, outermost first."""
    names = []
    while frame is not None:
        code = frame.f_code
        names.append(f"{Path(code.co_filename).stem}:{code.co_name}")
        frame = frame.f_back
    names.reverse()
    if len(names) > MAX_DEPTH:
        names = names[:MAX_DEPTH] + ["…"]
    return ";".join(names)


class StackSampler:
    """Samples one thread's stack until :meth:`stop`."""

    def __init__(self, interval_s: float = 0.005) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.counts: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    def start(self, thread_id: int) -> None:
        """Sample the thread ``thread_id`` (a ``threading.get_ident()``) from now on."""
        self._thread = threading.Thread(target=self._run, args=(thread_id,), name="stack-sampler", daemon=True)
        self._thread.start()

    def _run(self, thread_id: int) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(thread_id)
            if frame is None:
                return  # the thread ended
            self.counts[fold(frame)] += 1
            self.samples += 1
            del frame

    def stop(self) -> dict[str, Any]:
        """Stop sampling; ``{"interval_ms", "samples", "folded": [[stack, count], ...]}``, most
        sampled first."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return {"interval_ms": self.interval_s * 1000, "samples": self.samples,
                "folded": [[stack, count] for stack, count in self.counts.most_common()]}
