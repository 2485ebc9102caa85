"""Client JSON is parsed with a bound on its depth."""
from __future__ import annotations

import json

import orjson
import pytest
from pydantic import ValidationError

from engines.protocol import ChatCompletionRequest
from engines.protocol.json_body import MAX_JSON_DEPTH, JSONTooDeepError, json_depth, loads_bounded


def nested(depth: int) -> dict:
    """A JSON Schema-like object ``depth`` levels deep."""
    value: dict = {"type": "string"}
    for _ in range(depth - 1):
        value = {"type": "object", "properties": {"a": value}}
    return value


def reference_depth(value) -> int:
    """The plain recursive definition the iterative one must match."""
    if isinstance(value, dict):
        return 1 + max((reference_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((reference_depth(v) for v in value), default=0)
    return 0


@pytest.mark.parametrize("value", [0, "x", [], {}, [[]], {"a": [1, {"b": None}]}, [1, [2, [3, [4]]], {}],
                                   nested(1), nested(7), [{"a": [[], [[[]]]]}, 5]])
def test_depth_matches_the_recursive_definition(value) -> None:
    assert json_depth(value) == reference_depth(value)


def test_depth_stops_early_past_a_limit() -> None:
    assert json_depth(nested(5000) and [[[[[[]]]]]], limit=3) == 4


def test_loads_bounded_accepts_the_limit_and_refuses_past_it() -> None:
    at_limit = json.dumps(nested(MAX_JSON_DEPTH // 2))  # properties add a level each: depth 63
    assert json_depth(loads_bounded(at_limit)) == MAX_JSON_DEPTH - 1
    assert json_depth(loads_bounded("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)) == MAX_JSON_DEPTH
    with pytest.raises(JSONTooDeepError, match=f"deeper than {MAX_JSON_DEPTH} levels"):
        loads_bounded("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    with pytest.raises(JSONTooDeepError):  # far past orjson's own recursion limit too
        loads_bounded(json.dumps(nested(200)))
    with pytest.raises(orjson.JSONDecodeError):
        loads_bounded(b"{not json")


def test_a_schema_given_as_text_is_bounded_too() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    deep = {"type": "json_schema", "json_schema": {"name": "n", "schema": json.dumps(nested(100))}}
    with pytest.raises(ValidationError, match="the schema is too deep"):
        ChatCompletionRequest.model_validate({**base, "response_format": deep})
    fine = {"type": "json_schema", "json_schema": {"name": "n", "schema": json.dumps(nested(10))}}
    assert ChatCompletionRequest.model_validate({**base, "response_format": fine}).response_format is not None
