"""The engine's error for a request it cannot serve, below every module that raises it.

A module of its own so that the request types, the K/V transfer checks and the sampler can all
raise it without importing one another.
"""
from __future__ import annotations

__all__ = ["EngineRequestError"]


class EngineRequestError(ValueError):
    """A request the engine cannot serve (bad parameters, too long); the message is for the client."""
