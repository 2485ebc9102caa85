"""The request protocol: pydantic models of MLC's ``debug_config``, the OpenAI API and error replies.

Pure pydantic, no Django: the views validate bodies with these models and map them onto the
runtime's requests. The runtime's own vocabulary (``FinishReason``, ``REQUEST_LIMITS``) is
used here, not restated: import it from ``engines.runtime``. Import the models from here or
from the submodules: ``openai`` (the OpenAI API's requests),
``openai_responses`` (its responses, whole and streamed, and ``/v1/models``), ``debug`` (MLC's
``debug_config``), ``microserving`` (MicroServing's bodies and ``kv_append_metadata``), ``vllm``
(vLLM's ``/tokenize``, ``/detokenize`` and ``/version``), ``errors`` (the error reply, the exception
views raise, a validation error in one line), ``json_body`` (a client's JSON, its depth bounded),
``debug_routes`` (the ``/debug/*`` bodies besides ``model``) and ``limits`` (the bounds the bodies
and the history share: a note's length, a record's tags, a profile's length).
"""
from .debug import DebugConfig, DisaggConfig, DisaggKind
from .errors import (
    VALIDATION_STATUS,
    ErrorResponse,
    ProtocolError,
    error_type_for_status,
    field_error,
    validation_error_message,
    validation_error_param,
)
from .openai import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    JSONSchemaFormat,
    ResponseFormat,
    StreamOptions,
)
from .openai_responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = [
    "VALIDATION_STATUS",
    "ChatChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatLogprobs",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatStreamChoice",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DebugConfig",
    "DisaggConfig",
    "DisaggKind",
    "ErrorResponse",
    "JSONSchemaFormat",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "ProtocolError",
    "ResponseFormat",
    "StreamOptions",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "error_type_for_status",
    "field_error",
    "validation_error_message",
    "validation_error_param",
]
