"""Daphne's HTTP request, less Twisted's parsing of form bodies.

Twisted's ``http.Request`` parses the ``Content-Type`` of every POST (through the
``email`` package) and, for form-encoded and multipart bodies, the whole body into
``request.args``. Daphne never reads ``args``: it hands the raw body to the ASGI
application. For the API that work is pure cost, paid on the server's one event loop
per request (docs/perf-log/code-comments.md#twisted-form-parsing), and a multipart upload to
any path was parsed into memory before Django saw it.
Twisted has the switch (``parsePOSTFormSubmission``); Daphne does not pass it, so
``serve`` installs this request class in Daphne's HTTP factory.
"""
from __future__ import annotations

from typing import Any

from daphne import http_protocol


class BodyOnlyRequest(http_protocol.WebRequest):
    """Daphne's request with Twisted's form parsing off; everything else is Daphne's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["parsePOSTFormSubmission"] = False
        super().__init__(*args, **kwargs)


def install() -> None:
    """Make Daphne's HTTP factory build :class:`BodyOnlyRequest` (it reads the class from its
    module each time it builds a connection's protocol)."""
    http_protocol.WebRequest = BodyOnlyRequest
