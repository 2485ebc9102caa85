"""What one request may ask for: the one declaration of the request limits.

Who enforces what, each rule once:

* ``SamplingParams`` (``core.sampler``) checks every sampling range below, for every caller:
  the HTTP server (which answers its ``InvalidSamplingParams`` with a 400 naming the field)
  and code that drives an engine directly.
* The HTTP protocol (``engines.protocol``) checks only ``max_completion_logprobs`` and
  ``max_prompts``: rules of the ``/v1/completions`` API shape (its ``logprobs`` becomes the
  engine's ``top_logprobs``; each prompt of a list becomes an engine request).

OpenAI's limits, except ``max_n``: every choice is a full sequence in the batch with its own
KV pages, so one request may not crowd out the rest of the engine (OpenAI allows 128).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REQUEST_LIMITS", "RequestLimits"]


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on sampling parameters; ranges are inclusive unless the name says ``_exclusive``."""

    max_n: int = 16
    #: OpenAI's ``user`` becomes the request id, which names a trace lane and a history row:
    #: OpenAI-style ids are a few dozen characters; a megabyte one would fill both.
    max_user_chars: int = 256
    #: The engine's bound on a request id: ``user``, or ``user`` plus ``-`` and a uuid4 hex
    #: when that id is already streaming.
    max_request_id_chars: int = 320
    max_stop_sequences: int = 4
    max_top_logprobs: int = 20           # chat's top_logprobs (and the engine's)
    max_completion_logprobs: int = 5     # /v1/completions' logprobs
    #: /v1/completions' list of prompts, each an engine request (times n choices): enough for
    #: lm-evaluation-harness's batches, short of one request queueing a flood.
    max_prompts: int = 64
    temperature_min: float = 0.0
    temperature_max: float = 2.0
    top_p_min_exclusive: float = 0.0
    top_p_max: float = 1.0
    penalty_min: float = -2.0            # frequency and presence penalties
    penalty_max: float = 2.0
    logit_bias_min: float = -100.0
    logit_bias_max: float = 100.0


#: The limits in force.
REQUEST_LIMITS = RequestLimits()
