"""vLLM's utility routes in vLLM's shapes: ``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

Scripts written for vLLM count prompt tokens and round-trip ids with these. ``/tokenize`` takes a
completion prompt (``prompt``) or a chat (``messages``, rendered with the checkpoint's chat
template), as vLLM's ``TokenizeCompletionRequest`` and ``TokenizeChatRequest``; which one is
decided by ``messages`` being present. Booleans and token ids are strict, as in the OpenAI routes;
``model`` may be left out (the first engine, as vLLM's one). Fields that would change the tokens
and that this server cannot honour (a request's own ``chat_template``, ``chat_template_kwargs``,
``tools``, ``continue_final_message``) are refused with a message saying so; other unknown fields
are ignored.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import field_error
from .openai import ChatCompletionRequest, ChatMessage

__all__ = ["DetokenizeRequest", "DetokenizeResponse", "TokenizeChatRequest", "TokenizeCompletionRequest",
           "TokenizeResponse", "VersionResponse", "tokenize_request_model"]

StrictBool = Annotated[bool, Field(strict=True)]


class TokenizeCompletionRequest(BaseModel):
    """``/tokenize`` with ``prompt``: its ids, with the checkpoint's BOS unless ``add_special_tokens`` is false."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(BaseModel):
    """``/tokenize`` with ``messages``: the ids of the chat template's rendering, as
    ``/v1/chat/completions`` would prompt the model (``add_generation_prompt``, default true).
    ``add_special_tokens`` (default false: the template writes the BOS it wants) adds the
    tokenizer's own on top."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _check_request(self) -> "TokenizeChatRequest":
        if self.continue_final_message:
            raise field_error("continue_final_message is not supported: the chat routes never continue a message",
                              "continue_final_message")
        for name in ("chat_template", "chat_template_kwargs", "tools"):
            if getattr(self, name):
                raise field_error(f"{name} is not supported: prompts are rendered with the checkpoint's own chat "
                                  "template, as /v1/chat/completions renders them", name)
        return self

    def template_messages(self) -> list[dict[str, str]]:
        """The messages for the chat template, as ``/v1/chat/completions`` gives them."""
        # The chat route's own rule (developer spelt system), on these messages.
        return ChatCompletionRequest.model_construct(messages=self.messages).template_messages()


def tokenize_request_model(data: dict[str, Any]) -> type[TokenizeCompletionRequest | TokenizeChatRequest]:
    """Which ``/tokenize`` request a body is (vLLM's rule: a chat when it has ``messages``)."""
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


class TokenizeResponse(BaseModel):
    """``/tokenize``'s answer; ``max_model_len`` is what prompt and output together may hold."""

    count: int
    max_model_len: int
    tokens: list[int]
    #: The vocabulary strings of ``tokens`` (``"Ġthe"``), with ``return_token_strs``.
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """``/detokenize``: token ids (each in the vocabulary) back to text, special tokens kept."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, strict=True)]]


class DetokenizeResponse(BaseModel):
    """``/detokenize``'s answer."""

    prompt: str


class VersionResponse(BaseModel):
    """``/version``: this server's version (``engines.__version__``)."""

    version: str
