"""Every thread's Python stack of an engine process read from *outside* it, with py-spy.

From inside, a process that still runs Python can dump its own stacks; a stopped (SIGSTOP, a
hung device driver) or wedged one cannot, and that is exactly when the stacks matter. py-spy
reads another process's memory. Measured here (a SIGSTOPped CPython 3.11 in this container):
the default mode fails ("Failed to suspend process": it stops the target itself and the
already-stopped one confuses its waitpid), and ``--nonblocking`` failed too ("Failed to find
python version"). So a failure is a result: :func:`outside_stacks` returns py-spy's own reason,
which the incident keeps under ``evidence["missing"]``, never an empty stack list.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OutsideStacks", "outside_stacks"]

#: Seconds one py-spy attempt may take: the incident must not wait on a hung reader either.
TIMEOUT_S = 15.0


@dataclass(frozen=True)
class OutsideStacks:
    """py-spy's dump of ``pid`` (``text``) or, when it could not read it, ``missing``: why."""

    pid: int
    text: str | None
    missing: str | None


def _py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")  # the venv's own, pinned in requirements.txt
    return str(beside) if beside.exists() else shutil.which("py-spy")


def outside_stacks(pid: int, timeout_s: float = TIMEOUT_S) -> OutsideStacks:
    """Dump ``pid``'s threads with py-spy, blocking mode first (a consistent snapshot), then
    ``--nonblocking`` (reads without stopping it); the last error when neither worked."""
    exe = _py_spy()
    if exe is None:
        return OutsideStacks(pid, None, "py-spy is not installed (pip install -r requirements.txt)")
    reasons = []
    for extra in ([], ["--nonblocking"]):
        try:
            done = subprocess.run([exe, "dump", "--pid", str(pid), *extra], capture_output=True,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            reasons.append(f"py-spy dump {' '.join(extra)} took over {timeout_s:g} s")
            continue
        if done.returncode == 0 and "Thread" in done.stdout:
            return OutsideStacks(pid, done.stdout, None)
        err = (done.stderr or done.stdout).strip().splitlines()
        reasons.append(f"py-spy dump {' '.join(extra)}: {' / '.join(err[-2:]) or f'exit {done.returncode}'}")
    return OutsideStacks(pid, None, "; ".join(r.replace("  ", " ") for r in reasons))
