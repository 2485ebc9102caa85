"""Reading a stored payload back, a trace's or a profile's: checked, then sent as a file or as a
page's data.

Whoever reads a ``PayloadRecord``'s payload goes through :func:`read_payload`, which checks the
stored bytes against their size and CRC (one pass over the compressed bytes; a row saved before
checksums is inflated instead) and raises :class:`PayloadError` saying what is wrong. Pages that
only show a record (lists, the admin's detail page) never read the payload, so they never check
it; the admin's "Verify stored payloads" action checks the records it is given, on purpose.

:func:`payload_response` is the one download for both kinds: ``.json.gz`` (the column's bytes),
``.json`` (inflated as it streams), or ``data`` for a page's script (the gzip bytes with
``Content-Encoding: gzip``, inflated by the browser).
"""
from __future__ import annotations

from typing import AsyncIterator, Iterator, Literal

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.utils.http import content_disposition_header

from engines.history.payload import PayloadError, iter_json_chunks, payload_problem
from engines.models import PayloadRecord

__all__ = ["PAYLOAD_ERROR_STATUS", "PayloadForm", "attachment", "gzip_json_response", "payload_response",
           "read_payload"]

#: Status of a read whose stored payload cannot be served: the record exists but its bytes no
#: longer match what was saved; a conflict to report, not a server fault.
PAYLOAD_ERROR_STATUS = 409

#: How a payload goes out: a ``.json.gz`` file, a ``.json`` file, or data for a page's script.
PayloadForm = Literal["json.gz", "json", "data"]


def read_payload(record: PayloadRecord) -> bytes:
    """``record``'s stored bytes, checked; raises :class:`PayloadError` when they are unusable.

    Read by primary key in a query of its own, so ``record`` itself may (and on every page
    should) be loaded with its payload deferred.
    """
    data = record._meta.model._default_manager.filter(pk=record.pk).values_list("payload", flat=True).first()
    problem = payload_problem(data, expected_size=record.compressed_bytes, expected_crc32=record.payload_crc32,
                              kind=record.payload_kind)
    if problem is not None:
        raise PayloadError(problem)
    assert data is not None  # payload_problem names a missing payload
    return bytes(data)


def payload_response(request: HttpRequest, record: PayloadRecord,
                     form: PayloadForm) -> HttpResponse | StreamingHttpResponse:
    """``record``'s payload as ``form``; raises :class:`PayloadError` (nothing sent) when it is damaged."""
    data = read_payload(record)
    if form == "data":
        return gzip_json_response(data)
    filename = record.download_name()
    if form == "json.gz":
        response: HttpResponse | StreamingHttpResponse = HttpResponse(data, content_type="application/gzip")
        filename += ".gz"
    else:
        response = StreamingHttpResponse(_json_stream(request, data), content_type="application/json")
        if record.payload_crc32 is not None:  # the bytes are the ones saved, so the JSON is the size it was
            response["Content-Length"] = str(record.payload_bytes)
    response["Content-Disposition"] = attachment(filename)
    return response


def attachment(filename: str) -> str:
    """The ``Content-Disposition`` of a download saved as ``filename``."""
    header = content_disposition_header(as_attachment=True, filename=filename)
    assert header is not None  # None only for an inline response without a file name
    return header


def gzip_json_response(data: bytes) -> HttpResponse:
    """Gzip JSON for a page's script, sent as it is with ``Content-Encoding: gzip``: the browser
    inflates it natively, so a large trace travels compressed and costs the server no work
    (bench/timeline.py). A saved record never changes, so the browser may keep it."""
    response = HttpResponse(data, content_type="application/json")
    response["Content-Encoding"] = "gzip"
    response["Cache-Control"] = "private, max-age=86400"
    return response


def _json_stream(request: HttpRequest, data: bytes) -> Iterator[bytes] | AsyncIterator[bytes]:
    """Inflate piece by piece; under ASGI asynchronously (Django would otherwise buffer
    the whole sync iterator in memory), with each piece inflated on a worker thread."""
    chunks = iter_json_chunks(data)
    if not isinstance(request, ASGIRequest):
        return chunks

    async def pieces() -> AsyncIterator[bytes]:
        def next_piece() -> bytes | None:
            return next(chunks, None)

        step = sync_to_async(next_piece, thread_sensitive=False)
        while (piece := await step()) is not None:
            yield piece
    return pieces()
