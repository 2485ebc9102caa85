"""Plain data crossing the engine's boundary (requests in, outputs out), the check every request
passes first (:func:`validate_request`), and the per-request state inside the engine."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from engines.runtime.core.anatomy import RequestAnatomy
from engines.runtime.core.errors import EngineRequestError
from engines.runtime.core.finish_reason import FinishReason
from engines.runtime.core.limits import REQUEST_LIMITS
from engines.runtime.core.sampler import InvalidSamplingParams

if TYPE_CHECKING:
    from engines.runtime.core.grammar import GrammarMatcher
    from engines.runtime.core.disagg.transfer import KVBlock, KVDelivery, KVSend
    from engines.runtime.core.sampler import SamplingParams, SamplingState, TokenLogprob
    from engines.runtime.core.stop_checker import StopChecker
    from engines.runtime.model.tokenizer import IncrementalDetokenizer

__all__ = ["ChoiceDelta", "EngineRequestError", "FinishReason", "GenerationRequest", "GrammarMode", "RequestOutput",
           "RequestState", "RequestTimes", "Sequence", "validate_request"]


class GrammarMode(StrEnum):
    """How a ``response_format`` grammar is applied (MLC's ``grammar_execution_mode``)."""

    #: Mask the logits and also append the tokens the grammar forces, without running the
    #: model for them (MLC's default; off when logprobs are asked for, as forced tokens have none).
    JUMP_FORWARD = "jump_forward"
    #: Only mask the logits.
    CONSTRAINT = "constraint"


@dataclass
class GenerationRequest:
    """One request as the server hands it to the engine (already tokenized)."""

    request_id: str
    prompt: list[int]
    sampling: "SamplingParams"
    response_format: dict[str, Any] | None = None
    # Tokens of the prompt that form its system prompt (what pin_system_prompt pins).
    system_prompt_tokens: int | None = None
    #: Keep the system prompt (or, without one, the whole prompt) in the prefix cache, never
    #: evicted, until the engine is reset (MLC's ``pinned_system_prompt``).
    pin_system_prompt: bool = False
    grammar_mode: GrammarMode = GrammarMode.JUMP_FORWARD
    #: Disaggregated serving's prefill side (``remote_send``): prefill only, send the K/V.
    kv_send: "KVSend | None" = None
    #: Disaggregated serving's decode side (``start_generation``): generate on the K/V that
    #: ``prepare_receive`` reserved for this request id, from this position on.
    kv_window_begin: int | None = None
    #: When the request reached the server (``time.perf_counter()`` seconds, a clock every
    #: process of a host shares): what its queue time, TTFT and end-to-end latency count from.
    #: None: when the front end (``AsyncEngine.generate``) or the engine took it.
    arrival_time: float | None = None
    #: How old the request already was when it reached this server (seconds): what a router of
    #: ours in front of it says (``X-Request-Age``). Its metrics count from that earlier moment,
    #: the client's; its trace stays on this server's own time.
    age_at_arrival_s: float = 0.0
    #: The client's own ids, shown beside ours in the live table: OpenAI's ``user``, and the
    #: ``X-Request-Id`` header (the seam for it: the server does not read the header yet).
    user: str | None = None
    client_request_id: str | None = None

    def __post_init__(self) -> None:
        self.grammar_mode = GrammarMode(self.grammar_mode)  # a plain "constraint" works too


@dataclass
class ChoiceDelta:
    """What one choice (of ``n``) produced since the last output."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: "list[TokenLogprob] | None"
    finish_reason: FinishReason | None


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """A request's moments in its engine, on the last output: the stamps its ``usage.extra`` figures
    are differences of (docs/metrics.md), for a consumer that needs the moments themselves (the
    OpenTelemetry spans: ``engines.request_spans``). ``time.perf_counter()`` seconds, the clock
    every process of a host shares; None where the moment never came (aborted first)."""

    #: What the request's figures count from: its arrival at the server, less any age a router
    #: of ours reported (``GenerationRequest.age_at_arrival_s``).
    arrival: float
    #: The engine took it (``Engine.add_request``): after the server's tokenizing and the step in flight.
    added: float
    first_scheduled: float | None
    first_token: float | None
    finish: float


@dataclass
class RequestOutput:
    """One step's news for one request; ``usage`` (and ``times``) are set on the last one."""

    request_id: str
    choices: list[ChoiceDelta]
    usage: dict[str, Any] | None = None
    #: On the last output of a ``kv_send`` request: the K/V to deliver to the receiver.
    kv_block: "KVBlock | None" = None
    #: Instead, for a ``kv_send`` with ``post_to``: how posting it to the receiver went.
    kv_delivery: "KVDelivery | None" = None
    #: Prompt tokens the request's first admission found in the KV cache (its prefix cache, or
    #: K/V received from another engine) instead of computing them; 0 before it was admitted.
    cached_prompt_tokens: int = 0
    #: With ``SamplingParams.prompt_logprobs``, once, on the request's first output with a choice
    #: delta (no choice's output goes out before it) or its last: one entry per prompt token,
    #: None for the first (nothing precedes it). Shorter only if the request ended (aborted)
    #: before its prompt was computed.
    prompt_logprobs: "list[TokenLogprob | None] | None" = None
    #: On the last output: the request's moments in the engine (what ``usage.extra`` is computed from).
    times: RequestTimes | None = None

    @property
    def finished(self) -> bool:
        """This is the request's last output."""
        return self.usage is not None


_seq_ids = itertools.count()


class Sequence:
    """One choice of a request: prompt + generated tokens and how far the KV cache has them."""

    def __init__(self, request: "RequestState", index: int, prompt: list[int], sampling: "SamplingState",
                 detokenizer: "IncrementalDetokenizer", stop_checker: "StopChecker",
                 grammar: "GrammarMatcher | None" = None) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.kv_send = request.request.kv_send  # prefill only, never samples (disaggregation)
        self.token_ids: list[int] = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed = 0
        self.num_cached_prefix_tokens = 0  # of the last admission, for its trace event
        self.num_preemptions = 0
        self.preempted = False  # sent back to the queue, not readmitted yet
        self.last_token_time: float | None = None
        self.finish_reason: FinishReason | None = None  # set once, when the choice ends
        self.finish_reported = False  # the output carrying finish_reason has gone out
        self.sampling = sampling
        self.detokenizer = detokenizer
        self.stop_checker = stop_checker
        self.grammar = grammar
        # Output accumulated since the last delivered delta.
        self.pending_ids: list[int] = []
        self.pending_text: str = ""
        self.pending_logprobs: list[TokenLogprob] = []

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (sampled or forced by a grammar)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prefill_only(self) -> bool:
        """It computes its prompt and samples nothing: a ``kv_send`` prefill, or ``max_tokens`` 0."""
        return self.kv_send is not None or self.request.params.max_tokens == 0

    @property
    def gathers_prompt_logprobs(self) -> bool:
        """This choice computes the request's prompt logprobs (choice 0, while some are missing)."""
        return self.index == 0 and self.request.prompt_logprobs_missing

    @property
    def prefix_cache_limit(self) -> int | None:
        """Most leading tokens its admission may take from the prefix cache; None: any.

        Prompt logprobs need the logits of every prompt position, which only a forward pass over
        that position gives: K/V from the cache carries none. Recomputing those positions costs
        the same as computing them, so a choice gathering them skips the cache past the positions
        whose logprobs it already has (all of them, the first time; after a preemption, the ones
        computed before it). Other choices of the request, and every other request, use the
        cache as usual.
        """
        if not self.gathers_prompt_logprobs:
            return None
        got = self.request.prompt_logprobs
        assert got is not None  # gathers_prompt_logprobs: the request asked for them
        return len(got) - 1  # positions 0 .. len - 2 have scored their next token

    @property
    def finished(self) -> bool:
        """The choice has ended (it has a finish reason); it holds no KV pages any more."""
        return self.finish_reason is not None


class RequestState:
    """Everything the engine keeps about a live request."""

    def __init__(self, request: GenerationRequest, arrival_time: float, added_time: float | None = None) -> None:
        self.request = request
        self.request_id = request.request_id
        self.params = request.sampling
        self.arrival_time = arrival_time
        self.added_time = arrival_time if added_time is None else added_time  # the engine took it
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        #: Where its time goes, phase by phase (``core.anatomy``); the engine charges it each step.
        self.anatomy = RequestAnatomy(arrival_time, self.added_time)
        self.prompt_counted = False  # its prompt tokens went into the engine's counter (once)
        self.cached_prompt_tokens = 0  # found in the KV cache at its first admission (usage)
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.jump_forward_tokens = 0
        self.sequences: list[Sequence] = []
        self.kv_block: KVBlock | None = None  # a remote_send request's K/V, on its last output
        #: With ``prompt_logprobs``: the prompt tokens' logprobs so far (choice 0's prefill adds
        #: them chunk by chunk), the first token's None; complete at one per prompt token.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if request.sampling.prompt_logprobs is None else [None])
        self.prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        """Every choice has ended."""
        return all(s.finished for s in self.sequences)

    @property
    def prompt_logprobs_missing(self) -> bool:
        """It asked for prompt logprobs and some are not computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.request.prompt)

    def times(self, finish: float) -> RequestTimes:
        """Its moments, ended at ``finish`` (the stamp its usage was computed with)."""
        return RequestTimes(self.arrival_time, self.added_time, self.first_scheduled_time, self.first_token_time,
                            finish)


def validate_request(request: GenerationRequest, vocab_size: int, max_seq_len: int) -> None:
    """Raise :class:`EngineRequestError` if no engine of this vocabulary and context could serve
    ``request`` (cheap, any thread or process: it reads only the request)."""
    if not request.request_id or len(request.request_id) > REQUEST_LIMITS.max_request_id_chars:
        raise EngineRequestError(f"the request id must be 1 to {REQUEST_LIMITS.max_request_id_chars} characters, "
                                 f"got {len(request.request_id)}")
    if not request.prompt:
        raise EngineRequestError("the prompt is empty: send at least one token")
    bad = [t for t in request.prompt if not 0 <= t < vocab_size]
    if bad:
        raise EngineRequestError(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab_size})")
    try:
        request.sampling.check_vocab(vocab_size)
    except InvalidSamplingParams as e:
        raise EngineRequestError(str(e)) from e
    if request.sampling.prompt_logprobs is not None and (request.kv_send is not None
                                                         or request.kv_window_begin is not None):
        raise EngineRequestError("prompt_logprobs need the whole prompt computed by one engine: not with "
                                 "disaggregated serving's kv_send or kv_window_begin")
    if len(request.prompt) >= max_seq_len:
        raise EngineRequestError(
            f"the prompt has {len(request.prompt)} tokens; this engine's context holds at most "
            f"{max_seq_len} tokens including the output. Shorten the prompt."
        )
    max_tokens = request.sampling.max_tokens
    if max_tokens is not None and len(request.prompt) + max_tokens > max_seq_len:
        # Refused up front, as OpenAI and vLLM do, rather than silently cut short.
        raise EngineRequestError(
            f"this engine's context holds {max_seq_len} tokens, but the request asks for "
            f"{len(request.prompt) + max_tokens} ({len(request.prompt)} in the prompt, {max_tokens} "
            f"for the completion). Lower max_tokens to at most {max_seq_len - len(request.prompt)}, "
            f"or leave it unset to generate until the context is full."
        )
