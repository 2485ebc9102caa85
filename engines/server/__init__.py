"""The serving process itself, apart from what it serves: its name and its own health
(docs/architecture.md, "Server").

This package's ``__init__`` imports nothing: a module here may be unpickled in a spawned worker
before Django is set up.
"""
