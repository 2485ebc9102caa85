"""ASGI's callables as Django's handlers take them (messages are mappings), so that one of them
may stand where an ``ASGIApp`` goes: the types every ASGI layer of ours (the API-key gate, the
request ids, the arrival stamp, ``debugsite.asgi``) is written in. Imports nothing of ours, so
that a layer below the registry can name them without a circle through ``engines.auth``."""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Mapping

__all__ = ["ASGIApp", "Receive", "Scope", "Send"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
