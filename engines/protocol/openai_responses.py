"""OpenAI-compatible response models for ``/v1/completions``, ``/v1/chat/completions`` (whole
and streamed) and ``/v1/models``; the requests are in :mod:`engines.protocol.openai`.

Plain ``model_dump()`` (or ``model_dump_json()``) gives the wire shape: streaming
chunks keep ``finish_reason: null`` and every ``delta``, the usage chunk has
``choices: []``, and ``usage.extra`` is left out unless set. The official ``openai``
client parses them; it builds responses without validation, so our extra finish
reasons (``"abort"`` after a reset, ``"preempt"`` in disaggregated mode: the engine's
``FinishReason``) reach the caller as strings instead of failing as they do with MLC's
own schema.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from engines.runtime import FinishReason

__all__ = [
    "ChatChoice",
    "ChatCompletionChunk",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatLogprobs",
    "ChatResponseMessage",
    "ChatStreamChoice",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionResponse",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
]


def _created() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: ``cached_tokens``, the prompt tokens whose K/V the request
    found in the KV cache (the prefix cache, or K/V another server sent) at its first admission."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of a request; ``extra`` (MLC, with --enable-debug) holds its metrics,
    or the engine metrics for a ``query_engine_metrics`` special request.

    ``prompt_tokens_details`` is always there (``cached_tokens: 0`` when none), as OpenAI sends
    it: benchmark tools read their cache metrics from it.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    extra: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if self.extra is None:
            data.pop("extra", None)
        return data


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs, one entry per token of the returned text in each list: the
    generated tokens, after the prompt's with ``echo``.

    ``text_offset`` is each token's character offset in the returned text. The first prompt
    token has ``null`` for its logprob and its alternatives (nothing precedes it), as in
    OpenAI's API and vLLM.
    """

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """A completion choice, or a piece of one in a stream (``finish_reason`` null until the end)."""

    index: int = 0
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """A ``text_completion`` object: the whole reply, or one stream chunk (OpenAI uses the
    same object for both; the closing usage chunk has ``choices: []``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    """One alternative at a generated position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    """A generated token, its logprob and its best alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant message of a non-streaming chat choice."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    """A choice of a ``chat.completion``."""

    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    """A non-streaming ``chat.completion``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatChoice] = Field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    """What a stream chunk adds to a choice: ``role`` on the first chunk, then ``content``.

    Unset fields are left out (``{}`` on the chunk that only carries the finish reason),
    as OpenAI sends them.
    """

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(BaseModel):
    """A choice of a ``chat.completion.chunk``; ``finish_reason`` stays null until its last chunk."""

    index: int = 0
    delta: ChatDelta = Field(default_factory=ChatDelta)
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """A ``chat.completion.chunk``; the closing usage chunk has ``choices: []`` and ``usage``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatStreamChoice] = Field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_created)
    #: MLC answers "MLC-LLM"; clients only display it.
    owned_by: str = "engines"


class ModelList(BaseModel):
    """``GET /v1/models``: ``{"object": "list", "data": [...]}``."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
