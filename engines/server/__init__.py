"""The serving process's own health, apart from what it serves (docs/architecture.md, "Server").

This package's ``__init__`` imports nothing: a module here may be unpickled in a spawned worker
before Django is set up.
"""
