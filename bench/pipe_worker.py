"""A bench's worker process on its pipes: it answers each JSON line on its stdin with one on its
stdout. The benches that compare engines run each in a process of its own (thread pools never
share one), and only one computes at a time: the others wait on their pipes."""
from __future__ import annotations

import json
import subprocess
from typing import Any, Mapping, Sequence


class WorkerStopped(SystemExit):
    """A worker's pipe closed before its answer: it exited or was killed (uncaught, it ends the bench
    with its message, as any ``SystemExit``)."""


class PipeWorker:
    """``command`` started in ``cwd`` with ``env``; its first line (its "ready" answer) is ``ready``."""

    def __init__(self, command: Sequence[str], name: str, cwd: str, env: Mapping[str, str]) -> None:
        self.name = name
        self.process = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        cwd=cwd, env=dict(env))
        self.ready: dict[str, Any] = self.read()

    def read(self) -> dict[str, Any]:
        """The worker's next answer (a worker that stopped ends the bench, saying so)."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise WorkerStopped(f"the {self.name} worker stopped: exit {self.process.wait()}")
        return json.loads(line)

    def ask(self, **command: Any) -> dict[str, Any]:
        """One command (a JSON line) and its answer."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        """End the worker (its stdin closed: it returns), or kill it if it will not within a minute."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.close()
            self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
