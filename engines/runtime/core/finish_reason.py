"""Why a choice ended: one enum for the engine, the stop rules, the protocol and the history.

Below ``request`` and ``stop_checker`` so that the stop rules can name a reason without
importing the request types that hold a stop checker.
"""
from __future__ import annotations

from enum import StrEnum

__all__ = ["FinishReason"]


class FinishReason(StrEnum):
    """Why a choice ended: OpenAI's ``stop`` and ``length``, MLC's ``abort`` (aborted by the
    client, a reset, or a failure of that request alone) and ``preempt`` (disaggregated mode
    gave the request up; the router retries it). A ``StrEnum``, so it compares and serialises
    as its plain string."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    PREEMPT = "preempt"
