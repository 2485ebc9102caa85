"""Bounds on what a client may say of a record or a profile, one definition for every way in:
the ``/debug/*`` bodies (``debug_bodies``), the dashboard's and the fleet's engine actions
(``engines.engine_actions``), the admin, and the history and the profiler that check them
(``engines.history.validate_note``, ``engines.profiling``). No Django, so the protocol's
models can name them."""
from __future__ import annotations

__all__ = ["DEFAULT_MAX_SECONDS", "MAX_NOTE_CHARS", "MAX_TAGS"]

#: A note is a sentence or a paragraph about the capture, not a document.
MAX_NOTE_CHARS = 4000
#: Tags in one save (their joined text is bounded by the column too).
MAX_TAGS = 32
#: A profile nobody stops ends after this long (seconds), and is saved.
DEFAULT_MAX_SECONDS = 60.0
