"""OpenAI request and response models: every check, and compatibility with the official client.

The models check types and shapes; the sampling ranges are checked once, by the engine's
``SamplingParams``, when the view maps a request onto it (``make_generation_request``): the
range tests here go through that mapping and pin what a client gets, a 400 naming the field
and the limit. The client tests put the real ``openai`` client in front of a mock transport:
requests are what the client actually sends, and responses go through the client's own parsing.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx2
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk as OpenAIChunk
from pydantic import ValidationError

from engines.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DebugConfig,
    ModelCard,
    ModelList,
    ProtocolError,
    TokenLogprob,
    TopLogprob,
    Usage,
    validation_error_message,
    validation_error_param,
)
from engines.runtime import GenerationRequest
from engines.serving.request_mapping import make_generation_request

USER = [{"role": "user", "content": "Hello"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": USER, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "demo", "prompt": "Once upon a time", **fields}


BODIES: dict[str, Callable[..., dict[str, Any]]] = {"chat": chat, "completion": completion}
MODELS = {"chat": ChatCompletionRequest, "completion": CompletionRequest}


def error_of(cls: type, data: dict[str, Any]) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(data)
    return validation_error_message(info.value), validation_error_param(info.value)


def generation_of(cls: type, data: dict[str, Any]) -> GenerationRequest:
    """What the server hands the engine for this body."""
    return make_generation_request("req-1", [1, 2, 3], cls.model_validate(data), arrival_time=0.0)


def refusal_of(cls: type, data: dict[str, Any]) -> ProtocolError:
    """The server's refusal of a body that parses but asks for values out of range."""
    with pytest.raises(ProtocolError) as info:
        generation_of(cls, data)
    return info.value


# -------------------------------------------------------------------- shared fields


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_defaults(endpoint):
    request = MODELS[endpoint].model_validate(BODIES[endpoint]())
    assert (request.n, request.stream, request.stream_options) == (1, False, None)
    assert request.max_tokens is request.temperature is request.top_p is request.top_k is None
    assert request.stop is request.seed is request.logit_bias is request.debug_config is None
    assert request.is_special_request is False
    assert request.include_usage is False


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("temperature", "hot", "temperature: Input should be a valid number"),
        ("seed", 2**64, "seed: Input should be less than or equal to"),
        ("stream", "maybe", "stream: Input should be a valid boolean"),
        # Strict, as OpenAI: no silent coercion of booleans, strings or fractions.
        ("stream", "true", "stream: Input should be a valid boolean"),
        ("max_tokens", True, "max_tokens: Input should be a valid integer"),
        ("max_tokens", "16", "max_tokens: Input should be a valid integer"),
        ("n", 2.5, "n: Input should be a valid integer"),
        ("seed", "7", "seed: Input should be a valid integer"),
        ("top_k", 2.5, "top_k: Input should be a valid integer"),
        ("stop", ["a", 3], "stop: stop sequences must be strings (got 3)"),
        ("stop", 3, "stop: must be a string or a list of strings"),
        ("logit_bias", {"abc": 1}, "logit_bias: key 'abc' is not a token id"),
        ("logit_bias", {"5": "high"}, "logit_bias: bias for token 5 must be a number (got 'high')"),
        ("logit_bias", {"5": True}, "logit_bias: bias for token 5 must be a number (got True)"),
        ("logit_bias", [5], "logit_bias: must be an object mapping token ids to biases"),
        ("response_format", {"type": "xml"},
         "response_format.type: Input should be 'text', 'json_object' or 'json_schema'"),
        ("debug_config", {"ignore_eos": "yes"}, "debug_config.ignore_eos: Input should be a valid boolean (got 'yes')"),
        ("debug_config", {"ignore_eso": True}, "debug_config: unknown field 'ignore_eso'; DebugConfig accepts:"),
    ],
)
def test_bad_values_are_refused_naming_the_field(endpoint, field, value, expected):
    message, param = error_of(MODELS[endpoint], BODIES[endpoint](**{field: value}))
    assert message.startswith(expected), message
    assert param is not None and param.startswith(field)


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("max_tokens", 0, "max_tokens must be a positive integer, got 0"),
        ("temperature", -0.1, "temperature must be at least 0 and at most 2, got -0.1"),
        ("temperature", 2.5, "temperature must be at least 0 and at most 2, got 2.5"),
        ("top_p", 0, "top_p must be greater than 0 and at most 1, got 0"),
        ("top_p", 1.01, "top_p must be greater than 0 and at most 1, got 1.01"),
        ("n", 0, "n must be an integer from 1 to 16"),
        ("n", 17, "n must be an integer from 1 to 16 (choices per request on this server; "
                  "send several requests for more), got 17"),
        ("frequency_penalty", 2.5, "frequency_penalty must be at least -2 and at most 2, got 2.5"),
        ("presence_penalty", -2.5, "presence_penalty must be at least -2 and at most 2, got -2.5"),
        ("repetition_penalty", 0, "repetition_penalty must be a number greater than 0, got 0"),
        ("top_k", -2, "top_k must be -1 or 0 (off) or a positive integer, got -2"),
        ("stop", ["a", "b", "c", "d", "e"], "stop allows at most 4 sequences, got 5"),
        ("stop", [""], "stop sequences must be non-empty strings"),
        ("logit_bias", {"-5": 1}, "logit_bias token id -5 is negative"),
        ("logit_bias", {"5": 101}, "logit_bias values must be numbers from -100 to 100, got 101.0 for token 5"),
    ],
)
def test_out_of_range_values_are_a_400_naming_the_field_and_the_limit(endpoint, field, value, expected):
    error = refusal_of(MODELS[endpoint], BODIES[endpoint](**{field: value}))
    assert error.status == 400
    assert error.message.startswith(expected), error.message
    assert error.param == field


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_edges_of_ranges_are_accepted(endpoint):
    body = BODIES[endpoint](
        temperature=0, top_p=1, n=16, frequency_penalty=-2, presence_penalty=2, repetition_penalty=0.01,
        max_tokens=1, seed=-1, top_k=50, stop=["a", "b", "c", "d"], logit_bias={"0": -100, "7": 100},
    )
    sampling = generation_of(MODELS[endpoint], body).sampling
    assert (sampling.temperature, sampling.top_p, sampling.n, sampling.top_k, sampling.seed) == (0, 1, 16, 50, -1)
    assert (sampling.frequency_penalty, sampling.presence_penalty, sampling.max_tokens) == (-2, 2, 1)
    assert sampling.stop == ("a", "b", "c", "d") and sampling.logit_bias == {0: -100.0, 7: 100.0}


@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_off_spellings_turn_top_k_off(top_k):
    sampling = generation_of(CompletionRequest, completion(top_k=top_k, temperature=0.7)).sampling
    assert sampling.top_k in (-1, 0) and not sampling.is_greedy


def test_stop_string_becomes_a_list():
    assert CompletionRequest.model_validate(completion(stop="\n")).stop == ["\n"]
    assert ChatCompletionRequest.model_validate(chat(stop=["a", "b", "c", "d"])).stop == ["a", "b", "c", "d"]


def test_logit_bias_keys_become_token_ids():
    request = ChatCompletionRequest.model_validate(chat(logit_bias={"50256": -100, "7": 2.5}))
    assert request.logit_bias == {50256: -100.0, 7: 2.5}


def test_null_means_default():
    request = ChatCompletionRequest.model_validate(
        chat(n=None, stream=None, temperature=None, logprobs=None, stop=None, debug_config=None)
    )
    assert (request.n, request.stream, request.logprobs, request.debug_config) == (1, False, False, None)


def test_unknown_top_level_fields_are_ignored_and_not_kept():
    extra = {"store": True, "metadata": {"a": "b"}, "parallel_tool_calls": False, "service_tier": "auto",
             "reasoning_effort": "low", "prediction": {"type": "content", "content": "x"}}
    request = ChatCompletionRequest.model_validate(chat(**extra))
    assert not set(extra) & set(request.model_dump())


def test_stream_options_extra_keys_are_ignored():
    request = ChatCompletionRequest.model_validate(
        chat(stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    )
    assert request.include_usage is True


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_stream_options_need_stream(endpoint):
    message, param = error_of(MODELS[endpoint], BODIES[endpoint](stream_options={"include_usage": True}))
    assert message == "stream must be set to True when stream_options is present"
    assert param == "stream_options"


# -------------------------------------------------------------------- special requests

METRICS = {"special_request": "query_engine_metrics"}


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_special_request_requires_stream(endpoint):
    message, param = error_of(MODELS[endpoint], BODIES[endpoint](debug_config=METRICS))
    assert message == "DebugConfig.special_request requires stream=True"
    assert param == "stream"


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}])
def test_special_request_requires_include_usage(endpoint, options):
    body = BODIES[endpoint](debug_config=METRICS, stream=True, stream_options=options)
    message, param = error_of(MODELS[endpoint], body)
    assert message == "DebugConfig.special_request requires include_usage in stream_options"
    assert param == "stream_options"


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_special_request_with_stream_and_usage_is_accepted(endpoint):
    body = BODIES[endpoint](debug_config=METRICS, stream=True, stream_options={"include_usage": True})
    request = MODELS[endpoint].model_validate(body)
    assert request.is_special_request and request.include_usage
    assert request.debug_config == DebugConfig(special_request="query_engine_metrics")


def test_special_request_may_have_empty_input():
    streaming = {"debug_config": METRICS, "stream": True, "stream_options": {"include_usage": True}}
    assert ChatCompletionRequest.model_validate({"messages": [], **streaming}).messages == []
    assert CompletionRequest.model_validate({"prompt": "", **streaming}).prompt == ""


# ------------------------------------------------------------------------ completions


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", "text"),
        ([1, 2, 3], [1, 2, 3]),
        (["text"], "text"),
        ([[4, 5]], [4, 5]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_forms(prompt, expected):
    request = CompletionRequest.model_validate(completion(prompt=prompt))
    assert request.prompt == expected
    assert request.prompts == (expected if isinstance(expected, list) and isinstance(expected[0], (str, list))
                               else [expected])


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (5, "prompt: must be a string or a list of token ids (integers), or a list of several prompts"),
        ([1, "a"], "prompt: must be a string or a list of token ids (integers)"),
        ([True, False], "prompt: must be a string or a list of token ids (integers)"),
        (["a", [1]], "prompt: must be a string or a list of token ids (integers)"),
        ([1, -2], "prompt[1]: Input should be greater than or equal to 0 (got -2)"),
        ([[1, -2]], "prompt[1]: Input should be greater than or equal to 0 (got -2)"),
        ([[1], [2, -3]], "prompt[1][1]: Input should be greater than or equal to 0 (got -3)"),
        ([[1], [2, "x"]], "prompt: prompt 1 of the list must be a list of token ids (integers)"),
        ([[1], []], "prompt: prompt 1 of the list is empty"),
        (["a", ""], "prompt: prompt 1 of the list is empty"),
        (["a"] * 65, "prompt: holds 65 prompts; a request takes at most 64"),
        ("", "prompt must not be empty"),
        ([], "prompt must not be empty"),
        ([""], "prompt must not be empty"),
    ],
)
def test_bad_prompts(prompt, expected):
    message, _ = error_of(CompletionRequest, completion(prompt=prompt))
    assert message.startswith(expected), message


def test_missing_prompt_is_named():
    message, param = error_of(CompletionRequest, {"model": "demo"})
    assert message == "prompt: Field required"
    assert param == "prompt"


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("logprobs", 6, "logprobs: Input should be less than or equal to 5"),
        ("logprobs", -1, "logprobs: Input should be greater than or equal to 0"),
        ("echo", "yes", "echo: Input should be a valid boolean"),
        ("suffix", "tail", "suffix (insertion) is not supported"),
        ("best_of", 3, "best_of is not supported (got 3); use n for several choices"),
    ],
)
def test_completion_only_checks(field, value, expected):
    message, param = error_of(CompletionRequest, completion(**{field: value}))
    assert message.startswith(expected), message
    assert param == field


def test_completion_harmless_values_of_refused_features():
    request = CompletionRequest.model_validate(completion(echo=False, suffix="", best_of=1, logprobs=0))
    assert request.logprobs == 0


# ------------------------------------------------------------------------------- chat


def test_text_parts_are_joined_and_roles_kept():
    request = ChatCompletionRequest.model_validate(
        chat(
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": None},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"},
            ]
        )
    )
    assert request.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "42"},
    ]


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            {"role": "user",
             "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "u"}}]},
            "messages[0].content: part 1 has type 'image_url': only text parts are supported",
        ),
        ({"role": "user", "content": ["plain"]}, "messages[0].content: part 0 has no type"),
        ({"role": "user", "content": [{"type": "text", "text": 3}]},
         "messages[0].content: part 0: text must be a string"),
        ({"role": "user", "content": None}, "messages[0].content: required: a string or a list of text parts"),
        ({"role": "user"}, "messages[0].content: Field required"),
        ({"role": "function", "content": "x"}, "messages[0].role: Input should be 'system', 'developer', 'user'"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
            "messages[0]: tool calls are not supported",
        ),
    ],
)
def test_bad_messages_name_their_position(message, expected):
    text, _ = error_of(ChatCompletionRequest, chat(messages=[message]))
    assert text.startswith(expected), text


def test_messages_are_required():
    assert error_of(ChatCompletionRequest, chat(messages=[]))[0] == "messages must hold at least one message"
    assert error_of(ChatCompletionRequest, {"model": "demo"})[0] == "messages: Field required"


def test_max_completion_tokens_wins():
    request = ChatCompletionRequest.model_validate(chat(max_tokens=50, max_completion_tokens=7))
    assert request.max_tokens == 7
    assert ChatCompletionRequest.model_validate(chat(max_tokens=50)).max_tokens == 50
    # Refused under the name the client used, though it reaches the engine as max_tokens.
    error = refusal_of(ChatCompletionRequest, chat(max_completion_tokens=0))
    assert (error.status, error.param) == (400, "max_completion_tokens")
    assert error.message == "max_completion_tokens must be a positive integer, got 0"


def test_echo_maps_logprobs_to_prompt_logprobs_and_max_tokens_zero_needs_it():
    """echo with logprobs asks the engine for the prompt's logprobs too (the same number of
    alternatives); max_tokens 0 goes with echo only: without it the reply would be empty."""
    sampling = generation_of(CompletionRequest, completion(echo=True, logprobs=2, max_tokens=0)).sampling
    assert (sampling.prompt_logprobs, sampling.top_logprobs, sampling.max_tokens) == (2, 2, 0)
    assert generation_of(CompletionRequest, completion(echo=True)).sampling.prompt_logprobs is None
    assert generation_of(CompletionRequest, completion(logprobs=1)).sampling.prompt_logprobs is None
    error = refusal_of(CompletionRequest, completion(max_tokens=0))
    assert (error.status, error.param) == (400, "max_tokens")
    assert "goes with echo" in error.message
    chat_error = refusal_of(ChatCompletionRequest, chat(max_tokens=0))
    assert chat_error.message == "max_tokens must be a positive integer, got 0"


def test_microserving_bodies_take_one_prompt_and_no_echo():
    from engines.protocol.microserving import PrepRecvRequest, StartGenerateRequest

    base = completion(user="u", begin=0, end=2)
    for cls in (PrepRecvRequest, StartGenerateRequest):
        assert error_of(cls, {**base, "echo": True}) == (
            "echo is not supported here: this call generates on two engines", "echo")
        message, param = error_of(cls, {**base, "prompt": ["a", "b"]})
        assert message.startswith("a list of prompts is not supported here (got 2)") and param == "prompt"
        assert cls.model_validate({**base, "prompt": ["a"]}).prompt == "a"


def test_logprobs_and_top_logprobs():
    sampling = generation_of(ChatCompletionRequest, chat(logprobs=True, top_logprobs=20)).sampling
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 20)
    with pytest.raises(ValidationError, match='"logprobs" must be True to support "top_logprobs"'):
        ChatCompletionRequest.model_validate(chat(top_logprobs=3))  # MLC's wording, at parse time
    error = refusal_of(ChatCompletionRequest, chat(logprobs=True, top_logprobs=21))
    assert (error.status, error.param) == (400, "top_logprobs")
    assert error.message == "top_logprobs must be an integer from 0 to 20, got 21"
    assert error_of(ChatCompletionRequest, chat(logprobs=True, top_logprobs=2.0))[0].startswith(
        "top_logprobs: Input should be a valid integer")


TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


def test_trivial_tool_settings_are_accepted():
    for fields in ({"tools": [TOOL], "tool_choice": "none"}, {"tool_choice": "auto"}, {"tools": []},
                   {"modalities": ["text"]}, {"function_call": "none"}):
        ChatCompletionRequest.model_validate(chat(**fields))


@pytest.mark.parametrize(
    ("fields", "expected", "param"),
    [
        ({"tools": [TOOL]}, "tools are not supported: this server does no function calling", "tools"),
        ({"tools": [TOOL], "tool_choice": "auto"}, "tools are not supported", "tools"),
        ({"tool_choice": "required"}, "tool_choice 'required' is not supported", "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice {", "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions / function_call are not supported", "functions"),
        ({"modalities": ["text", "audio"]}, 'only the "text" modality is supported', "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio output is not supported", "audio"),
    ],
)
def test_unsupported_features_are_refused(fields, expected, param):
    message, got_param = error_of(ChatCompletionRequest, chat(**fields))
    assert message.startswith(expected), message
    assert got_param == param


# -------------------------------------------------------------------- response_format

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "json_object"}),
        (
            {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
            {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
        ),
        # MLC's spelling: the schema as JSON text next to json_object
        (
            {"type": "json_object", "schema": json.dumps(SCHEMA)},
            {"type": "json_schema", "json_schema": {"name": "schema", "schema": SCHEMA}},
        ),
    ],
)
def test_response_formats(response_format, expected):
    request = ChatCompletionRequest.model_validate(chat(response_format=response_format))
    assert request.response_format is not None
    assert request.response_format.as_openai_dict() == expected


def test_response_format_dumps_schema_under_its_wire_name():
    body = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    request = CompletionRequest.model_validate(completion(response_format=body))
    dumped = request.model_dump(exclude_none=True)["response_format"]
    assert dumped == body
    assert CompletionRequest.model_validate(completion(response_format=dumped)) == request


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "json_schema"}, 'response_format: type "json_schema" requires json_schema'),
        ({"type": "json_object", "json_schema": {"name": "p"}},
         'response_format: json_schema is only read when type is "json_schema"'),
        ({"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}},
         "response_format.json_schema.name: must be 1 to 64 characters"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}},
         "response_format.json_schema.name: Field required"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}},
         "response_format.json_schema.schema: the schema must be a JSON object"),
        ({"type": "json_object", "schema": "{not json"}, "response_format.schema: the schema is not valid JSON"),
        # Nested past the JSON parser's recursion limit: a RecursionError, not a ValueError.
        ({"type": "json_object", "schema": "[" * 100_000}, "response_format.schema: the schema is not valid JSON"),
        ({"type": "text", "schema": SCHEMA}, "response_format: schema (MLC's spelling) goes with type \"json_object\""),
    ],
)
def test_bad_response_formats(response_format, expected):
    message, _ = error_of(ChatCompletionRequest, chat(response_format=response_format))
    assert message.startswith(expected), message


# ------------------------------------------------------ requests sent by the official client


class Recorder:
    """A mock transport that keeps the last request body and answers with a fixed reply."""

    def __init__(self, reply: Callable[[], httpx2.Response]):
        self.reply = reply
        self.body: dict[str, Any] | None = None

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.body = json.loads(request.content) if request.content else None
        return self.reply()


def client_for(handler: Callable[[httpx2.Request], httpx2.Response]) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="test",
        base_url="http://testserver/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
        max_retries=0,
    )


def sse(*payloads: object) -> httpx2.Response:
    lines = [f"data: {json.dumps(p)}\n\n" for p in payloads] + ["data: [DONE]\n\n"]
    return httpx2.Response(200, content="".join(lines).encode(), headers={"content-type": "text/event-stream"})


def test_official_client_chat_request_validates():
    chunk = ChatCompletionChunk(id="chatcmpl-1", model="demo", choices=[], usage=Usage()).model_dump()
    recorder = Recorder(lambda: sse(chunk))
    client = client_for(recorder)
    list(
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "u"}]}],
            max_completion_tokens=8,
            temperature=0.5,
            top_p=0.9,
            seed=3,
            stop=["\n"],
            logprobs=True,
            top_logprobs=2,
            logit_bias={"11": -5},
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
            extra_body={"debug_config": {"ignore_eos": True, "grammar_execution_mode": "constraint"}, "top_k": 5},
        )
    )
    request = ChatCompletionRequest.model_validate(recorder.body)
    assert request.max_tokens == 8 and request.n == 2 and request.top_k == 5
    assert request.logit_bias == {11: -5.0}
    assert request.debug_config == DebugConfig(ignore_eos=True, grammar_execution_mode="constraint")
    assert request.template_messages()[1] == {"role": "user", "content": "u"}


def test_official_client_completion_request_validates():
    reply = CompletionResponse(id="cmpl-1", model="demo", choices=[CompletionChoice(text="x", finish_reason="stop")])
    recorder = Recorder(lambda: httpx2.Response(200, json=reply.model_dump()))
    client = client_for(recorder)
    client.completions.create(
        model="demo", prompt=[1, 2, 3], max_tokens=4, logprobs=2, frequency_penalty=0.5,
        extra_body={"debug_config": {"pinned_system_prompt": True}},
    )
    request = CompletionRequest.model_validate(recorder.body)
    assert request.prompt == [1, 2, 3] and request.logprobs == 2
    assert request.debug_config == DebugConfig(pinned_system_prompt=True)


# ------------------------------------------------------------------------------ responses


def usage(extra: dict[str, Any] | None = None) -> Usage:
    return Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8, extra=extra)


def test_usage_leaves_out_extra_unless_set():
    assert usage().model_dump() == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                    "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage({"ttft_s": 0.1}).model_dump()["extra"] == {"ttft_s": 0.1}


def test_chat_completion_parses_as_openai_type():
    logprobs = ChatLogprobs(
        content=[TokenLogprob(token="Hi", logprob=-0.1, bytes=[72, 105],
                              top_logprobs=[TopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105])])]
    )
    response = ChatCompletionResponse(
        id="chatcmpl-1",
        model="demo",
        choices=[ChatChoice(message=ChatResponseMessage(content="Hi"), logprobs=logprobs, finish_reason="stop")],
        usage=usage({"prefill_tokens": 5}),
    )
    dumped = response.model_dump()
    parsed = ChatCompletion.model_validate(dumped)
    assert parsed.object == "chat.completion"
    assert parsed.choices[0].message.content == "Hi" and parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].bytes == [72, 105]
    assert parsed.usage.total_tokens == 8
    assert parsed.usage.model_extra == {"extra": {"prefill_tokens": 5}}


def stream_chunks(finish_reason: str = "length") -> list[dict[str, Any]]:
    """A two-choice stream as the server sends it: role, text, finish, then usage."""
    chunks = [
        ChatCompletionChunk(
            id="chatcmpl-1", model="demo",
            choices=[ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(2)],
        ),
        ChatCompletionChunk(id="chatcmpl-1", model="demo",
                            choices=[ChatStreamChoice(index=1, delta=ChatDelta(content="B"))]),
        ChatCompletionChunk(id="chatcmpl-1", model="demo",
                            choices=[ChatStreamChoice(index=0, delta=ChatDelta(content="A"))]),
        ChatCompletionChunk(
            id="chatcmpl-1", model="demo",
            choices=[ChatStreamChoice(index=i, finish_reason=finish_reason) for i in range(2)],  # type: ignore[arg-type]
        ),
        ChatCompletionChunk(id="chatcmpl-1", model="demo", choices=[], usage=usage({"decode_tokens": 3})),
    ]
    return [chunk.model_dump() for chunk in chunks]


def test_chunks_have_the_wire_shape():
    first, middle, _, last, usage_chunk = stream_chunks()
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}
    assert middle["choices"][0]["delta"] == {"content": "B"}
    assert middle["usage"] is None
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == 8


def test_chunks_parse_as_openai_type():
    for chunk in stream_chunks():
        OpenAIChunk.model_validate(chunk)


@pytest.mark.parametrize("finish_reason", ["stop", "length", "abort", "preempt"])
def test_official_client_streams_our_chunks(finish_reason):
    client = client_for(lambda request: sse(*stream_chunks(finish_reason)))
    stream = client.chat.completions.create(
        model="demo", messages=USER, stream=True, stream_options={"include_usage": True}
    )
    received = list(stream)
    text = {0: "", 1: ""}
    for chunk in received[:-1]:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
    assert text == {0: "A", 1: "B"}
    # The client does not validate replies, so MLC's extra reasons arrive as they are.
    assert [c.finish_reason for c in received[-2].choices] == [finish_reason, finish_reason]
    assert received[-1].choices == [] and received[-1].usage.completion_tokens == 3
    assert received[-1].usage.model_extra == {"extra": {"decode_tokens": 3}}


def completion_response(finish_reason: str | None = "stop") -> CompletionResponse:
    logprobs = CompletionLogprobs(
        tokens=[" a", " b"], token_logprobs=[-0.5, -0.25], top_logprobs=[{" a": -0.5}, {" b": -0.25}],
        text_offset=[0, 2],
    )
    return CompletionResponse(
        id="cmpl-1", model="demo",
        choices=[CompletionChoice(text=" a b", logprobs=logprobs, finish_reason=finish_reason)],  # type: ignore[arg-type]
        usage=usage(),
    )


def test_completion_parses_as_openai_type():
    parsed = Completion.model_validate(completion_response().model_dump())
    assert parsed.object == "text_completion"
    assert parsed.choices[0].logprobs.text_offset == [0, 2]
    assert parsed.choices[0].logprobs.top_logprobs == [{" a": -0.5}, {" b": -0.25}]


def test_official_client_reads_echoed_prompt_logprobs():
    """The first prompt token's null logprob and alternatives (echo, as OpenAI's API and vLLM send
    them; OpenAI's types say float, the client builds its objects without validating)."""
    logprobs = CompletionLogprobs(tokens=["Hi", " there"], token_logprobs=[None, -1.5],
                                  top_logprobs=[None, {" there": -1.5}], text_offset=[0, 2])
    reply = CompletionResponse(id="cmpl-1", model="demo", usage=usage(),
                               choices=[CompletionChoice(text="Hi there", logprobs=logprobs, finish_reason="length")])
    client = client_for(lambda request: httpx2.Response(200, json=reply.model_dump()))
    parsed = client.completions.create(model="demo", prompt="Hi there", echo=True, logprobs=1, max_tokens=0)
    assert parsed.choices[0].text == "Hi there"
    assert parsed.choices[0].logprobs.token_logprobs == [None, -1.5]
    assert parsed.choices[0].logprobs.top_logprobs == [None, {" there": -1.5}]


def test_official_client_streams_completion_chunks():
    chunks = [
        CompletionResponse(id="cmpl-1", model="demo", choices=[CompletionChoice(text=" a")]).model_dump(),
        CompletionResponse(id="cmpl-1", model="demo",
                           choices=[CompletionChoice(text=" b", finish_reason="abort")]).model_dump(),
        CompletionResponse(id="cmpl-1", model="demo", usage=usage()).model_dump(),
    ]
    assert chunks[0]["choices"][0]["finish_reason"] is None
    client = client_for(lambda request: sse(*chunks))
    received = list(client.completions.create(model="demo", prompt="x", stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in received[:2]) == " a b"
    assert received[1].choices[0].finish_reason == "abort"
    assert received[2].choices == [] and received[2].usage.total_tokens == 8


def test_official_client_reads_models_list():
    listing = ModelList(data=[ModelCard(id="demo"), ModelCard(id="llama", owned_by="me")])
    dumped = listing.model_dump()
    assert dumped["object"] == "list" and dumped["data"][0]["object"] == "model"
    Model.model_validate(dumped["data"][0])
    client = client_for(lambda request: httpx2.Response(200, json=dumped))
    assert [m.id for m in client.models.list()] == ["demo", "llama"]


def test_official_client_reads_chat_completion():
    response = ChatCompletionResponse(
        id="chatcmpl-1", model="demo",
        choices=[ChatChoice(message=ChatResponseMessage(content="Hi"), finish_reason="abort")],
        usage=usage(),
    )
    client = client_for(lambda request: httpx2.Response(200, json=response.model_dump()))
    parsed = client.chat.completions.create(model="demo", messages=USER)
    assert parsed.choices[0].message.content == "Hi"
    assert parsed.choices[0].finish_reason == "abort"


def test_responses_round_trip():
    for model in (completion_response(None), ChatCompletionResponse(
        id="c", model="m", choices=[ChatChoice(message=ChatResponseMessage(content="x"))], usage=usage({"a": 1})
    )):
        assert type(model).model_validate_json(model.model_dump_json()) == model
