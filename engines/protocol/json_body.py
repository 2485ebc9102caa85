"""Parsing a client's JSON with a bound on its nesting depth.

Django already caps a body's size (``DATA_UPLOAD_MAX_MEMORY_SIZE``, 413 past it); depth is
the other dimension a client controls. A deeply nested value is legal JSON, but everything
downstream that recurses (pydantic, the grammar compiler, pickling a request to the engine
process, which fails near depth 240) would break on it with a 500, or worse inside the engine.
So every JSON a client sends is parsed here, and one nested deeper than :data:`MAX_JSON_DEPTH`
is refused up front with a message that says so.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

__all__ = ["MAX_JSON_DEPTH", "JSONTooDeepError", "json_depth", "loads_bounded"]

#: Deepest nesting accepted (an object or array inside another counts one level). A chat body
#: with content parts is about 5 deep; a JSON Schema in ``response_format`` rarely passes 20.
MAX_JSON_DEPTH = 64


class JSONTooDeepError(ValueError):
    """The JSON nests deeper than allowed; the message is for the client."""


def json_depth(value: Any, limit: int | None = None) -> int:
    """How deep ``value`` nests (a scalar is 0, ``[]`` and ``{}`` are 1), without recursion.

    With ``limit``, stops as soon as the depth passes it and returns ``limit + 1``.
    """
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if limit is not None and deepest > limit:
                return deepest
        stack.extend((child, depth) for child in children if isinstance(child, (dict, list)))
    return deepest


def loads_bounded(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``orjson.loads(raw)``, refused with :class:`JSONTooDeepError` past ``max_depth``.

    Raises ``orjson.JSONDecodeError`` (a ``ValueError``) for text that is not JSON.
    """
    value = orjson.loads(raw)
    if json_depth(value, max_depth) > max_depth:
        raise JSONTooDeepError(f"the JSON nests deeper than {max_depth} levels; flatten it")
    return value
