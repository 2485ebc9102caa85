"""Child processes that end with the server that started them.

A ``ProcessPoolExecutor`` worker holds both ends of its own task queue, so it never sees its parent
die: a server killed outright (``kill -9``, the OOM killer), whose shutdown never ran, left its
workers waiting for work forever (the digest process, ~95 MB each). This module imports no Django
models, so a spawned worker can unpickle its initializer before Django is set up.
"""
from __future__ import annotations

import os
import signal
import threading
import time

#: How often a child looks whether its parent is still there (seconds).
PARENT_CHECK_S = 1.0


def exit_with_parent(parent: int) -> None:
    """Start a thread that ends this process (``os._exit``) once ``parent``, the pid of the process
    that started it, is no longer its parent: it was re-parented when that one died (before this
    call too, where the parent died while this process started)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def start_django_child(parent: int) -> None:
    """A pool worker's initializer (``initargs=(os.getpid(),)`` in the parent): Django set up
    (``DJANGO_SETTINGS_MODULE`` is inherited), the worker tied to its parent's life, and deaf to
    Ctrl-C, which a terminal sends to the whole process group: the server's own shutdown ends the
    worker (it printed a KeyboardInterrupt traceback over the server's goodbye before)."""
    import django

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    django.setup()
    exit_with_parent(parent)
