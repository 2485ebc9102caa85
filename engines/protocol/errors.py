"""Error values of the request protocol: the reply shape, the exception views raise, and
the translation of pydantic validation errors into one line a client can act on.

The reply shape serves two kinds of client at once:

* MLC LLM's clients and tests read ``object``, ``message`` and ``code`` at the top level
  (MLC's ``ErrorResponse``; we send it as a JSON object, not MLC's double-encoded string).
* OpenAI clients look for an ``error`` object first: the Python client uses
  ``body.get("error", body)``, so the flat keys alone would do for it, but the Node client
  and most other tools only read ``error.message``. So the reply also carries
  ``error: {message, type, param, code}``, OpenAI's own shape.

Both copies are built from the same fields, so they cannot disagree.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, ValidationError, computed_field
from pydantic_core import PydanticCustomError

__all__ = [
    "VALIDATION_STATUS",
    "ErrorResponse",
    "ProtocolError",
    "error_type_for_status",
    "field_error",
    "validation_error_message",
    "validation_error_param",
]

#: HTTP status for a request body that parses as JSON but fails validation. MLC serves
#: its OpenAI routes with FastAPI, which answers pydantic failures with 422, and MLC's
#: own request checks (the ``special_request`` ones) surface the same way; we keep that
#: status so clients written against MLC see the same class of error. Engine-side
#: refusals (MLC's ``BadRequestError``) stay 400.
VALIDATION_STATUS = HTTPStatus.UNPROCESSABLE_ENTITY

# OpenAI's ``error.type`` strings by status; clients branch on them more than on codes.
_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_type_for_status(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status: other 4xx are ``invalid_request_error``, 5xx ``server_error``."""
    return _ERROR_TYPES.get(int(status), "invalid_request_error" if 400 <= status < 500 else "server_error")


class ErrorResponse(BaseModel):
    """An error reply: MLC's flat ``{"object": "error", "message", "code"}`` plus OpenAI's fields.

    ``model_dump()`` gives the full body, including the nested ``error`` object that
    OpenAI clients read (see the module docstring for why both are sent).
    """

    object: Literal["error"] = "error"
    message: str
    code: int
    type: str
    param: str | None = None

    @classmethod
    def from_status(cls, status: int, message: str, param: str | None = None) -> "ErrorResponse":
        """Build the reply for ``status`` with the matching OpenAI ``type``."""
        return cls(message=message, code=int(status), type=error_type_for_status(status), param=param)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def error(self) -> dict[str, Any]:
        """OpenAI's nested error object, a view of the flat fields."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def stream_event(self) -> dict[str, Any]:
        """The payload of an SSE ``data:`` line reporting an error after a stream has started.

        The status line is already sent by then; the OpenAI client raises ``APIError``
        for a data event holding an ``error`` mapping, so only that key is needed.
        """
        return {"error": self.error}


class ProtocolError(Exception):
    """A request the server refuses, raised by views and turned into an ``ErrorResponse``.

    ``message`` says what was wrong and what to do; ``param`` names the offending field
    (dotted path) when there is one, for OpenAI's ``error.param``.
    """

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param

    @classmethod
    def from_validation_error(
        cls, exc: ValidationError, status: int = VALIDATION_STATUS
    ) -> "ProtocolError":
        """The refusal for a body that failed pydantic validation."""
        return cls(status, validation_error_message(exc), validation_error_param(exc))

    def response(self) -> ErrorResponse:
        """The reply body for this error."""
        return ErrorResponse.from_status(self.status, self.message, self.param)


def field_error(message: str, param: str | None = None) -> PydanticCustomError:
    """An error for validators to raise: its text is shown as is, without pydantic's
    ``"Value error, "`` prefix, and ``param`` (a dotted path relative to where the
    validator runs) feeds ``error.param``. Model-level validators have no field location of
    their own, so their messages name the fields they talk about.
    """
    context: dict[str, Any] = {"message": message}
    if param is not None:
        context["param"] = param
    # The template is only "{message}": the message itself may hold braces (JSON, schemas).
    return PydanticCustomError("invalid_request", "{message}", context)


# pydantic puts the name of the union member it tried into the location ("str",
# "list[int]", "function-after[...]", a class name); they are not fields and only confuse.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _is_type_tag(part: str) -> bool:
    return part in _TYPE_TAGS or "[" in part or "(" in part or part[:1].isupper()


def _location(loc: tuple[int | str, ...]) -> str:
    """``("messages", 1, "content")`` -> ``"messages[1].content"``; union tags dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _is_type_tag(part):
            path += f".{part}" if path else part
    return path


# Inputs shown back in messages must stay short and on one line.
_MAX_SHOWN_INPUT = 40


def _shown_input(err: Any) -> str:
    """``" (got 'fast')"`` for a short scalar input, else nothing.

    Only pydantic's own messages get it: a validator's message is written for its value.
    """
    if err["type"] in ("missing", "extra_forbidden", "invalid_request", "value_error", "assertion_error"):
        return ""
    value = err.get("input")
    if value is None or isinstance(value, (dict, list, tuple, BaseModel)):
        return ""
    shown = repr(value)
    if len(shown) > _MAX_SHOWN_INPUT or "\n" in shown:
        return ""
    return f" (got {shown})"


def _union_member(loc: tuple[int | str, ...]) -> tuple[tuple[int | str, ...], str] | None:
    """``(location of the union, member tag)`` when ``loc`` passes through a union member."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and _is_type_tag(part):
            return tuple(loc[:i]), part
    return None


def _relevant_errors(exc: ValidationError) -> list[Any]:
    """The errors worth reporting. For a value that matched no member of a union, pydantic
    reports every member's failure; keep only the member that got furthest into the value
    (``prompt[1]: ... >= 0``, not also ``prompt: Input should be a valid string``)."""
    errors = exc.errors(include_url=False)
    best: dict[tuple[int | str, ...], tuple[int, str]] = {}
    for err in errors:
        member = _union_member(err["loc"])
        if member is not None:
            union, tag = member
            depth = len(err["loc"])
            if union not in best or depth > best[union][0]:
                best[union] = (depth, tag)
    return [
        err
        for err in errors
        if (member := _union_member(err["loc"])) is None or best[member[0]][1] == member[1]
    ]


def validation_error_message(exc: ValidationError) -> str:
    """One line naming each offending field: ``debug_config.ignore_eos: Input should be a valid boolean``.

    Several errors are joined with ``"; "``, each stated once.
    """
    lines: list[str] = []
    for err in _relevant_errors(exc):
        path = _location(err["loc"])
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check its spelling"
        else:
            msg = err["msg"].removeprefix("Value error, ") + _shown_input(err)
        line = f"{path}: {msg}" if path else msg
        if line not in lines:
            lines.append(line)
    return "; ".join(lines)


def validation_error_param(exc: ValidationError) -> str | None:
    """The dotted path of the first offending field, for OpenAI's ``error.param``."""
    for err in _relevant_errors(exc):
        path = _location(err["loc"])
        relative = (err.get("ctx") or {}).get("param")
        if relative:
            path = f"{path}.{relative}" if path else relative
        if path:
            return path
    return None
