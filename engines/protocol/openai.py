"""OpenAI-compatible request models for ``/v1/completions`` and ``/v1/chat/completions``, with MLC
LLM's ``debug_config`` extension.

Requests
    Parsed and type-checked here: strict integers and booleans, the shapes of ``stop``,
    ``logit_bias``, ``messages`` and ``response_format``, and the rules of OpenAI's API
    itself (``/v1/completions``' ``logprobs`` of at most
    ``REQUEST_LIMITS.max_completion_logprobs``, refused features). The *ranges* of the
    sampling parameters (temperature, top_p, penalties, ``n``, ``stop`` count,
    ``top_logprobs``, ``logit_bias`` values, ...) are checked once, by the engine's
    ``SamplingParams``, which the view builds from the request and whose
    ``InvalidSamplingParams`` it answers with a 400 naming the field. Messages name the
    offending field; see :mod:`engines.protocol.errors` for how a ``ValidationError``
    becomes one line.

    Unknown top-level fields are accepted and ignored: OpenAI clients and frameworks add
    fields as the API grows (``store``, ``metadata``, ``parallel_tool_calls``,
    ``service_tier``, ``prediction``, ``reasoning_effort``, ...) and none of those change
    what a text model must generate. Fields that *would* change the output and that we
    cannot honour (``tools`` with a tool choice other than ``"none"``, ``functions``,
    audio output, image input, ``suffix``, ``best_of`` > 1) are declared and refused with a
    message saying so, never silently dropped. Inside
    ``debug_config`` unknown fields are errors (see :mod:`engines.protocol.debug`).

    ``null`` for a top-level field means "not given", as in OpenAI's API, so the default
    applies (``"n": null`` is ``n = 1``).

    vLLM's sampling extensions that benchmark tools send are honoured at the top level:
    ``top_k``, ``repetition_penalty``, ``ignore_eos`` (as MLC's ``debug_config.ignore_eos``,
    which works on; either one true is enough) and ``min_tokens``.

The response bodies are in :mod:`engines.protocol.openai_responses`.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engines.runtime import REQUEST_LIMITS

from .debug import DebugConfig
from .errors import field_error
from .json_body import JSONTooDeepError, loads_bounded

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "JSONSchemaFormat",
    "ResponseFormat",
    "StreamOptions",
]


# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage`` and no choices;
    ``continuous_usage_stats`` (vLLM's) puts the usage so far on every chunk.

    vLLM reads ``continuous_usage_stats`` only beside ``include_usage``; here it works alone too
    (a client that asks for it gets it, rather than silence), and with both the stream is vLLM's.
    """

    # Newer OpenAI clients send more options here (e.g. include_obfuscation); they do not
    # change what is generated, so they are ignored like unknown top-level fields.
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = Field(default=None, strict=True)
    continuous_usage_stats: bool | None = Field(default=None, strict=True)


_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _parse_schema(value: Any) -> Any:
    """A JSON Schema given as an object, or (MLC's spelling) as JSON text."""
    if isinstance(value, str):
        try:
            value = loads_bounded(value)
        except JSONTooDeepError as exc:
            raise field_error(f"the schema is too deep: {exc}") from None
        except ValueError as exc:
            raise field_error(f"the schema is not valid JSON: {exc}") from None
    if value is not None and not isinstance(value, dict):
        raise field_error("the schema must be a JSON object (a JSON Schema)")
    return value


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the output must satisfy, and its name."""

    model_config = ConfigDict(extra="ignore", validate_by_name=True, serialize_by_alias=True)

    name: str
    description: str | None = None
    # "schema" would shadow a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not _SCHEMA_NAME.match(name):
            raise field_error("must be 1 to 64 characters among a-z, A-Z, 0-9, '_' and '-'")
        return name

    @field_validator("schema_", mode="before")
    @classmethod
    def _check_schema(cls, value: Any) -> Any:
        return _parse_schema(value)


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (default), ``json_object`` (any JSON object), or
    ``json_schema`` (JSON matching ``json_schema.schema``).

    MLC's own spelling, ``{"type": "json_object", "schema": "<JSON Schema as text>"}``, is
    accepted too; :meth:`as_openai_dict` rewrites it into OpenAI's ``json_schema`` form so
    the engine only ever sees OpenAI's two JSON forms.
    """

    model_config = ConfigDict(extra="ignore", validate_by_name=True, serialize_by_alias=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    @field_validator("schema_", mode="before")
    @classmethod
    def _check_schema(cls, value: Any) -> Any:
        return _parse_schema(value)

    @model_validator(mode="after")
    def _check_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise field_error('type "json_schema" requires json_schema: {"name": ..., "schema": {...}}', "json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise field_error(f'json_schema is only read when type is "json_schema" (type is "{self.type}")', "type")
        if self.schema_ is not None and self.type != "json_object":
            raise field_error(
                'schema (MLC\'s spelling) goes with type "json_object"; with OpenAI\'s spelling use '
                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                "schema",
            )
        return self

    def as_openai_dict(self) -> dict[str, Any] | None:
        """The format for the engine in OpenAI's spelling; ``None`` for plain text."""
        if self.type == "text":
            return None
        if self.type == "json_object" and self.schema_ is None:
            return {"type": "json_object"}
        schema = self.json_schema or JSONSchemaFormat(name="schema", schema=self.schema_)
        return {"type": "json_schema", "json_schema": schema.model_dump(exclude_none=True)}


class _GenerationRequest(BaseModel):
    """Fields shared by completion and chat requests: sampling, stopping, streaming, debug.

    Integer and boolean fields are strict, as OpenAI's API is: ``"max_tokens": true``,
    ``"n": 2.5`` or ``"stream": "yes"`` are errors, not silently 1, 2 or true. The sampling
    fields' ranges are ``SamplingParams``' to check (see the module docstring).
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    #: Upper bound on generated tokens per choice; None = up to the context limit.
    max_tokens: int | None = Field(default=None, strict=True)
    temperature: float | None = None
    top_p: float | None = None
    #: Extension (vLLM's): keep only the k most likely tokens; -1 and 0 (the spellings
    #: vLLM clients send) mean "off".
    top_k: int | None = Field(default=None, strict=True)
    n: int = Field(default=1, strict=True)
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    #: Stop strings; a single string is accepted and becomes a one-element list.
    stop: list[str] | None = None
    #: Any 64-bit integer, signed or not, as clients send them; turning it into an RNG
    #: seed is the sampler's job.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1, strict=True)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    #: Extension: multiplicative penalty on tokens already present (1.0 = off).
    repetition_penalty: float | None = None
    #: Extension (vLLM's): no EOS, stop tokens or stop strings end a choice; only max_tokens
    #: or the context does. The same as ``debug_config.ignore_eos``, which needs --enable-debug.
    ignore_eos: bool = Field(default=False, strict=True)
    #: Extension (vLLM's): no EOS, stop token or stop string ends a choice before it has this
    #: many tokens (at most max_tokens: ``SamplingParams`` checks it).
    min_tokens: int = Field(default=0, strict=True)
    #: Token id -> bias added to its logit. JSON keys are strings; they are parsed to ints here.
    logit_bias: dict[int, float] | None = None
    #: Becomes the request id (MLC's rule), so it is bounded like one.
    user: str | None = None
    response_format: ResponseFormat | None = None
    #: MLC's extension; honoured by the server only with --enable-debug.
    debug_config: DebugConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's API treats an explicit null like an absent field; some clients send
        # every parameter, null included.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("user")
    @classmethod
    def _check_user(cls, user: str | None) -> str | None:
        limit = REQUEST_LIMITS.max_user_chars
        if user is not None and len(user) > limit:
            raise field_error(f"is {len(user)} characters long; it becomes the request id, which holds at most "
                              f"{limit} characters: send a shorter one (an id or a hash, not the user's data)")
        return user

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, stop: Any) -> Any:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise field_error("must be a string or a list of strings")
        for item in stop:
            if not isinstance(item, str):
                raise field_error(f"stop sequences must be strings (got {item!r})")
        return stop

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, logit_bias: Any) -> Any:
        if not isinstance(logit_bias, dict):
            raise field_error('must be an object mapping token ids to biases, e.g. {"50256": -100}')
        parsed: dict[int, float] = {}
        for key, bias in logit_bias.items():
            token_id = key if isinstance(key, int) and not isinstance(key, bool) else None
            if isinstance(key, str) and re.fullmatch(r"-?\d+", key.strip()):
                token_id = int(key)
            if token_id is None:
                raise field_error(f"key {key!r} is not a token id (an integer, as a string in JSON)")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise field_error(f"bias for token {token_id} must be a number (got {bias!r})")
            parsed[token_id] = float(bias)
        return parsed

    def _check_streaming(self) -> None:
        """MLC's checks on special requests (chat-only in MLC, both endpoints here) and
        OpenAI's rule that stream_options needs stream."""
        if self.debug_config is not None and self.debug_config.special_request is not None:
            if not self.stream:
                raise field_error("DebugConfig.special_request requires stream=True", "stream")
            if self.stream_options is None or not self.stream_options.include_usage:
                raise field_error(
                    "DebugConfig.special_request requires include_usage in stream_options", "stream_options"
                )
        if self.stream_options is not None and not self.stream:
            raise field_error("stream must be set to True when stream_options is present", "stream_options")

    @property
    def is_special_request(self) -> bool:
        """True for a debug special request (answered without generating)."""
        return self.debug_config is not None and self.debug_config.special_request is not None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries the usage so far (vLLM's ``continuous_usage_stats``)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


TokenId = Annotated[int, Field(ge=0)]


_PROMPT_FORMS = ("must be a string or a list of token ids (integers), or a list of several prompts "
                 "(strings, or lists of token ids)")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: a prompt (text or token ids), or a list of prompts.

    A list of several strings or token lists is several prompts, as in OpenAI's API: each is an
    engine request of its own (batched on the engine with the others) and gets ``n`` choices,
    prompt ``i``'s at indexes ``i * n .. i * n + n - 1``. A one-element list is unwrapped, so
    after validation ``prompt`` is ``str | list[int]`` for one prompt; :attr:`prompts` lists
    them either way.

    ``echo`` returns each prompt before its completion, and with ``logprobs`` its tokens'
    logprobs too (``null`` for the first), which the engine computes in the prefill
    (``SamplingParams.prompt_logprobs``); with ``max_tokens: 0`` only those, no completion
    (scoring, as lm-evaluation-harness's loglikelihood asks). ``max_tokens: 0`` without
    ``echo`` would return nothing and is refused (``make_generation_request``), as vLLM does.
    """

    #: False where a body must hold one prompt and no echo (MicroServing's calls).
    takes_prompt_lists_and_echo: ClassVar[bool] = True

    prompt: str | list[TokenId] | list[list[TokenId]] | list[str]
    #: 0..5 alternatives per token (``logprobs: 0`` returns only the chosen token's): OpenAI's
    #: rule for this endpoint, narrower than the engine's ``top_logprobs`` it becomes.
    logprobs: int | None = Field(default=None, ge=0, le=REQUEST_LIMITS.max_completion_logprobs, strict=True)
    echo: bool = Field(default=False, strict=True)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_forms(cls, prompt: Any) -> Any:
        if isinstance(prompt, str) or (isinstance(prompt, list) and not prompt) or _is_token_ids(prompt):
            return prompt
        if not isinstance(prompt, list):
            raise field_error(_PROMPT_FORMS)
        texts = all(isinstance(item, str) for item in prompt)
        if not texts and not all(isinstance(item, list) for item in prompt):
            raise field_error(_PROMPT_FORMS)
        for index, item in enumerate(prompt):
            if not texts and not _is_token_ids(item):
                raise field_error(f"prompt {index} of the list must be a list of token ids (integers)")
            if not item and len(prompt) > 1:
                raise field_error(f"prompt {index} of the list is empty")
        most = REQUEST_LIMITS.max_prompts
        if len(prompt) > most:
            raise field_error(f"holds {len(prompt)} prompts; a request takes at most {most}: send the others "
                              "in more requests")
        return prompt[0] if len(prompt) == 1 else prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or several, each a text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [cast("str | list[int]", prompt)]
        return list(prompt)

    @model_validator(mode="after")
    def _check_request(self) -> "CompletionRequest":
        if not self.takes_prompt_lists_and_echo:
            if self.echo:
                raise field_error("echo is not supported here: this call generates on two engines", "echo")
            if len(self.prompts) > 1:
                raise field_error(f"a list of prompts is not supported here (got {len(self.prompts)}): "
                                  "this call serves one prompt", "prompt")
        if self.suffix:
            raise field_error("suffix (insertion) is not supported by this server", "suffix")
        if self.best_of not in (None, 1):
            raise field_error(f"best_of is not supported (got {self.best_of}); use n for several choices", "best_of")
        if not self.prompt and not self.is_special_request:
            raise field_error("prompt must not be empty", "prompt")
        self._check_streaming()
        return self


class ChatMessage(BaseModel):
    """One message of a chat request. List content is joined into text at validation.

    Content parts of type ``text`` are joined with newlines (as vLLM does); any other
    part (images, audio, files) is refused, since the engines serve text-only models.
    Tool calls in assistant messages are refused, as function calling is not supported.
    ``developer`` (OpenAI's newer name for ``system``) is accepted.
    """

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str
    name: str | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_tool_calls(cls, data: Any) -> Any:
        if isinstance(data, dict) and (data.get("tool_calls") or data.get("function_call")):
            raise field_error("tool calls are not supported: this server does no function calling", "tool_calls")
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, content: Any) -> Any:
        if content is None:
            raise field_error("required: a string or a list of text parts")
        if not isinstance(content, list):
            return content
        texts: list[str] = []
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                shown = f"type {kind!r}" if kind else "no type"
                raise field_error(
                    f"part {index} has {shown}: only text parts are supported "
                    '({"type": "text", "text": "..."}); this server serves text-only models'
                )
            if not isinstance(part.get("text"), str):
                raise field_error(f"part {index}: text must be a string")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``; after
    validation ``max_tokens`` holds the effective limit.
    """

    messages: list[ChatMessage]
    logprobs: bool = Field(default=False, strict=True)
    top_logprobs: int | None = Field(default=None, strict=True)
    max_completion_tokens: int | None = Field(default=None, strict=True)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None

    @model_validator(mode="after")
    def _check_request(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        self._check_tools()
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise field_error(f'only the "text" modality is supported (got {self.modalities})', "modalities")
        if self.audio is not None:
            raise field_error("audio output is not supported: this server serves text-only models", "audio")
        if self.top_logprobs and not self.logprobs:
            # MLC's wording, which its clients match (the engine's own check words it its way).
            raise field_error('"logprobs" must be True to support "top_logprobs"', "logprobs")
        if not self.messages and not self.is_special_request:
            raise field_error("messages must hold at least one message", "messages")
        self._check_streaming()
        return self

    def _check_tools(self) -> None:
        if self.functions or self.function_call not in (None, "none"):
            raise field_error(
                "functions / function_call are not supported: this server does no function calling", "functions"
            )
        if self.tool_choice not in (None, "none", "auto"):
            raise field_error(
                f"tool_choice {self.tool_choice!r} is not supported: this server does no function calling; "
                'leave it out or set it to "none"',
                "tool_choice",
            )
        if self.tools and self.tool_choice != "none":
            raise field_error(
                "tools are not supported: this server does no function calling; "
                'remove tools or set tool_choice to "none"',
                "tools",
            )

    def template_messages(self) -> list[dict[str, str]]:
        """The messages for the chat template: ``role`` and ``content`` only, with
        ``developer`` spelt ``system`` (chat templates know only the latter)."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in self.messages
        ]
