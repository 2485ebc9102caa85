"""Error replies: MLC's flat shape and OpenAI's nested one, one-line validation messages,
and what the official client makes of them."""
from __future__ import annotations

import json

import httpx2
import openai
import pytest
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from engines.protocol import (
    VALIDATION_STATUS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatStreamChoice,
    ErrorResponse,
    ProtocolError,
    error_type_for_status,
    field_error,
    validation_error_message,
    validation_error_param,
)


def validation_error(cls: type[BaseModel], data: object) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(data)
    return info.value


# --------------------------------------------------------------------------- reply shape


def test_reply_has_mlcs_flat_fields_and_openais_nested_error():
    body = ErrorResponse.from_status(400, 'The requested model "x" is not served.', param="model").model_dump()
    assert body == {
        "object": "error",
        "message": 'The requested model "x" is not served.',
        "code": 400,
        "type": "invalid_request_error",
        "param": "model",
        "error": {
            "message": 'The requested model "x" is not served.',
            "type": "invalid_request_error",
            "param": "model",
            "code": 400,
        },
    }
    assert json.loads(ErrorResponse.from_status(400, "m").model_dump_json())["error"]["param"] is None


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (418, "invalid_request_error"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (503, "service_unavailable"),
    ],
)
def test_type_follows_status(status, kind):
    assert error_type_for_status(status) == kind
    assert ErrorResponse.from_status(status, "m").type == kind


def test_protocol_error_carries_status_message_and_param():
    error = ProtocolError(404, "The requested model \"x\" is not served.", param="model")
    assert str(error) == error.message
    assert error.response().model_dump()["code"] == 404
    assert error.response().param == "model"


def test_protocol_error_from_validation_error_is_a_422_naming_the_field():
    exc = validation_error(ChatCompletionRequest,
                           {"messages": [{"role": "user", "content": "x"}], "debug_config": {"ignore_eos": 3}})
    error = ProtocolError.from_validation_error(exc)
    assert VALIDATION_STATUS == 422
    assert error.status == 422
    assert error.message == "debug_config.ignore_eos: Input should be a valid boolean (got 3)"
    assert error.param == "debug_config.ignore_eos"
    assert ProtocolError.from_validation_error(exc, status=400).status == 400


# ------------------------------------------------------------------ validation messages


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    flag: bool = False


class Outer(BaseModel):
    inner: Inner | None = None
    items: list[Inner] = []
    word: str = ""
    mode: str = "a"

    @field_validator("word")
    @classmethod
    def _plain_value_error(cls, word: str) -> str:
        if word == "bad":
            raise ValueError("word must not be 'bad'")
        return word

    @field_validator("mode")
    @classmethod
    def _custom_error(cls, mode: str) -> str:
        if mode == "braces":
            raise field_error("mode {not a template} is {kept}", param="sub")
        return mode


@pytest.mark.parametrize(
    ("data", "message", "param"),
    [
        ({"inner": {"flag": "maybe"}},
         "inner.flag: Input should be a valid boolean, unable to interpret input (got 'maybe')", "inner.flag"),
        ({"items": [{}, {"flag": []}]}, "items[1].flag: Input should be a valid boolean", "items[1].flag"),
        ({"inner": {"flga": True}}, "inner.flga: unknown field; check its spelling", "inner.flga"),
        ({"word": "bad"}, "word: word must not be 'bad'", "word"),
        ({"mode": "braces"}, "mode: mode {not a template} is {kept}", "mode.sub"),
        # long inputs are not echoed back: the message stays one short line
        ({"word": 10**60}, "word: Input should be a valid string", "word"),
    ],
)
def test_message_and_param_name_the_field(data, message, param):
    exc = validation_error(Outer, data)
    assert validation_error_message(exc) == message
    assert validation_error_param(exc) == param


def test_several_errors_share_one_line():
    exc = validation_error(Outer, {"inner": {"flag": "x"}, "word": "bad"})
    assert validation_error_message(exc) == (
        "inner.flag: Input should be a valid boolean, unable to interpret input (got 'x'); word: word must not be 'bad'"
    )
    assert "\n" not in validation_error_message(exc)


def test_union_members_are_not_reported_one_by_one():
    class Prompt(BaseModel):
        prompt: str | list[int]

    exc = validation_error(Prompt, {"prompt": [1, "x"]})
    # only the member that went deepest (the list) is reported, without its type tag
    assert validation_error_message(exc) == (
        "prompt[1]: Input should be a valid integer, unable to parse string as an integer (got 'x')")
    assert validation_error_param(exc) == "prompt[1]"


def test_model_level_message_has_no_path():
    exc = validation_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                   "debug_config": {"special_request": "query_engine_metrics"}})
    assert validation_error_message(exc) == "DebugConfig.special_request requires stream=True"
    assert validation_error_param(exc) == "stream"


# ------------------------------------------------------------ what the official client sees


def client_for(response: httpx2.Response) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="test",
        base_url="http://testserver/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(lambda request: response)),
        max_retries=0,
    )


@pytest.mark.parametrize(
    ("status", "exception"),
    [(400, openai.BadRequestError), (401, openai.AuthenticationError), (404, openai.NotFoundError),
     (422, openai.UnprocessableEntityError)],
)
def test_official_client_reports_our_message_param_and_type(status, exception):
    reply = ErrorResponse.from_status(
        status, "debug_config.ignore_eos: Input should be a valid boolean", "debug_config.ignore_eos")
    client = client_for(httpx2.Response(status, json=reply.model_dump()))
    with pytest.raises(exception) as info:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}])
    assert info.value.message == f"Error code: {status} - debug_config.ignore_eos: Input should be a valid boolean"
    assert info.value.param == "debug_config.ignore_eos"
    assert info.value.code == str(status)
    assert info.value.type == reply.type


def test_official_client_raises_on_an_error_event_mid_stream():
    chunk = ChatCompletionChunk(id="c", model="demo", choices=[ChatStreamChoice(delta=ChatDelta(content="A"))])
    error = ErrorResponse.from_status(500, "engine stopped while generating")
    body = f"data: {chunk.model_dump_json()}\n\ndata: {json.dumps(error.stream_event())}\n\n"
    client = client_for(httpx2.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"}))
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], stream=True)
    received = []
    with pytest.raises(openai.APIError) as info:
        for item in stream:
            received.append(item)
    assert [c.choices[0].delta.content for c in received] == ["A"]
    assert info.value.message == "engine stopped while generating"
    assert info.value.type == "server_error"
