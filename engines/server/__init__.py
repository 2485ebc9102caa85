"""The serving process itself, apart from what it serves (docs/architecture.md): its name
(``server_identity``) and its own health: its event loop's lag (``loop_lag``), glibc's allocator
(``malloc_tuning``), database work off the loop (``db_calls``), cancels a library lost
(``cancellation``), pool workers that end with the server (``child_lifetime``), Daphne's request
class (``daphne_requests``), a dependency's outage said once (``outage_log``) and the ASGI
callables' types every ASGI layer of ours is written in (``asgi_types``).

This package's ``__init__`` imports nothing: a module here may be unpickled in a spawned worker
before Django is set up.
"""
