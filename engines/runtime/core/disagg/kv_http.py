"""K/V between server processes over HTTP: the engine's own listener, and the sender.

The prefill engine's process posts a block for another server's engine itself
(:func:`deliver_block`, on a thread of its own), so the K/V never travels back through its
server first.

A decode engine whose server runs with disaggregation on listens on a port of its own (in its
own process, beside the KV pool) for ``POST /microserving/kv_transfer`` with a ``kv_wire``
body. The server's web stack is left out on purpose: under Daphne and Django a body of tens of
MB is spooled to a temporary file and read back, then pickled over to the engine process,
which together ran at about a tenth of a plain loopback copy. Here the socket is read straight
into the block's arrays, and the block is handed to the engine loop as an object.

HTTP/1.1 with ``Connection: close``, one request a connection; ``h11`` parses the request and
response heads, the body bypasses it (it is read into, and written from, the arrays). The API
key, when the server has one, is required as ``Authorization: Bearer <key>``. Replies are JSON:
``{}``, or the server's error shape (MLC's ``object``/``message``/``code`` and OpenAI's ``error``).
"""
from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
import orjson

from engines.runtime.core.disagg.kv_wire import KVWireError, decode_block, encode_block, wire_size
from engines.runtime.core.disagg.transfer import KVBlock, KVDelivery, KVTransferError

logger = logging.getLogger("engines.runtime")

__all__ = ["KV_TRANSFER_PATH", "KVListenSpec", "KVListener", "KVPostError", "deliver_block", "post_block"]

KV_TRANSFER_PATH = "/microserving/kv_transfer"
#: A read or write that stalls this long ends the transfer (a whole one has no overall bound).
IO_TIMEOUT_S = 30.0
#: Transfers received at once; more get 503 (each holds a block's worth of memory).
MAX_CONCURRENT = 4
_MAX_HEAD = 16 * 1024
_RECV = 256 * 1024


@dataclass(frozen=True)
class KVListenSpec:
    """Where an engine's K/V listener binds (port 0: any free one) and the API key it requires."""

    host: str
    port: int = 0
    api_key: str | None = None


class _Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class KVListener:
    """Accepts K/V transfers for one engine.

    Args:
        spec: where to bind, and the API key to require.
        max_bytes: the most K/V bytes a block may announce (the engine's whole context).
        receive: stores a block in the engine (blocks until the engine loop did; raises
            ``KVTransferError`` when it refuses it).
        release: frees a reservation whose K/V will not come (a body that failed half way).
    """

    def __init__(self, spec: KVListenSpec, max_bytes: int, receive: Callable[[KVBlock], None],
                 release: Callable[[str, str], None]) -> None:
        self.spec = spec
        self.max_bytes = max_bytes
        self.receive = receive
        self.release = release
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        self._sock = socket.create_server((spec.host, spec.port), family=_family(spec.host), backlog=64)
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name=f"kv-listener-{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting (transfers under way finish on their own threads)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-transfer", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT_S)
        http = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        left = 0
        try:
            try:
                request, early, left = _read_request(conn, http)
                self._check(request)
                if not self._slots.acquire(blocking=False):
                    raise _Refusal(503, f"this engine takes {MAX_CONCURRENT} KV transfers at once; send again")
                try:
                    left = self._take(conn, early, left)
                finally:
                    self._slots.release()
            except _Refusal as refusal:
                _reply(conn, http, refusal.status, _error_body(refusal.status, str(refusal)))
                _drain(conn, left)
            else:
                _reply(conn, http, 200, {})
        except (OSError, h11.LocalProtocolError):
            pass  # the sender went away: nothing to answer
        except Exception:  # noqa: BLE001 - a thread of ours must not die silently
            logger.exception("kv listener: a transfer failed")
        finally:
            conn.close()

    def _check(self, request: h11.Request) -> None:
        headers = {name.decode().lower(): value.decode("latin-1") for name, value in request.headers}
        if request.method != b"POST" or urlsplit(request.target.decode("latin-1")).path != KV_TRANSFER_PATH:
            raise _Refusal(404, f"this port takes POST {KV_TRANSFER_PATH} only")
        key = self.spec.api_key
        if key and not hmac.compare_digest(headers.get("authorization", "").encode(), f"Bearer {key}".encode()):
            raise _Refusal(401, "a KV transfer needs the server's API key (Authorization: Bearer <key>)")
        if headers.get("content-type", "").split(";")[0].strip() != "application/octet-stream":
            raise _Refusal(415, "a KV transfer body is application/octet-stream in the kv_wire format")
        if "content-length" not in headers:
            raise _Refusal(411, "a KV transfer body needs a Content-Length")

    def _take(self, conn: socket.socket, early: bytes, left: int) -> int:
        """Read the body into a block and hand it to the engine; returns the bytes left unread."""
        pending = memoryview(early)

        def readinto(view: memoryview) -> int:
            nonlocal pending, left
            if pending:
                n = min(len(view), len(pending))
                view[:n] = pending[:n]
                pending = pending[n:]
                return n
            if left <= 0:
                return 0
            n = conn.recv_into(view[:left])
            left -= n
            return n

        try:
            block = decode_block(readinto, self.max_bytes)
            if pending or left:
                raise KVWireError("the body goes on after the last layer", block.request_id, block.ticket)
        except KVWireError as exc:
            if exc.request_id is not None:
                self.release(exc.request_id, exc.ticket or "")
            raise _Refusal(400, f"the KV transfer body is not valid: {exc}") from None
        try:
            self.receive(block)
        except KVTransferError as exc:
            raise _Refusal(400, str(exc)) from None
        return left


def _error_body(status: int, message: str) -> dict:
    """The server's error shape: MLC's flat fields and OpenAI's ``error`` object."""
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "service_unavailable")
    return {"object": "error", "message": message, "code": status,
            "error": {"message": message, "type": kind, "param": None, "code": status}}


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _read_request(conn: socket.socket, http: h11.Connection) -> tuple[h11.Request, bytes, int]:
    """The request head; the body bytes that came with it; how many more the body has."""
    while True:
        try:
            event = http.next_event()
        except h11.RemoteProtocolError as exc:
            raise _Refusal(400, f"not an HTTP/1.1 request: {exc}") from None
        if event is h11.NEED_DATA:
            http.receive_data(conn.recv(_RECV))
            continue
        if not isinstance(event, h11.Request):
            raise OSError("the connection closed before a request")
        break
    length = next((int(v) for k, v in event.headers if k == b"content-length"), 0)
    early = bytearray()
    while True:  # what h11 already holds of the body
        more = http.next_event()
        if not isinstance(more, h11.Data):
            break
        early += more.data
    return event, bytes(early), length - len(early)


def _reply(conn: socket.socket, http: h11.Connection, status: int, body: dict) -> None:
    data = orjson.dumps(body)
    conn.sendall(http.send(h11.Response(status_code=status, headers=[
        ("Content-Type", "application/json"), ("Content-Length", str(len(data))), ("Connection", "close")])))
    conn.sendall(http.send(h11.Data(data=data)) or b"")
    conn.shutdown(socket.SHUT_WR)


def _drain(conn: socket.socket, left: int, limit: float = 2.0) -> None:
    """Read (and drop) what the sender is still sending after an early refusal, so that closing
    with unread data does not reset the connection before the sender reads the reply."""
    conn.settimeout(limit)
    sink = bytearray(_RECV)
    try:
        while left > 0 and (n := conn.recv_into(sink)):
            left -= n
    except OSError:
        pass


# -------------------------------------------------------------------------------- sender


class KVPostError(Exception):
    """A transfer the receiver refused (``status`` its HTTP status) or that never got an answer
    (``status`` None: unreachable, cut off, timed out)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status


def post_block(url: str, block: KVBlock, api_key: str | None = None, timeout: float = IO_TIMEOUT_S) -> None:
    """Send ``block`` to the listener at ``url`` (``http://host:port``); returns once it was
    stored, raises :class:`KVPostError` otherwise. Blocking: run it off an event loop."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise KVPostError(None, f"not a K/V listener URL: {url!r}")
    headers = [("Host", parts.netloc), ("Content-Type", "application/octet-stream"),
               ("Content-Length", str(wire_size(block))), ("Connection", "close")]
    if api_key:
        headers.append(("Authorization", f"Bearer {api_key}"))
    http = h11.Connection(h11.CLIENT)
    try:
        conn = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    except OSError as exc:
        raise KVPostError(None, f"the K/V listener at {url} is out of reach: {exc}") from None
    with conn:
        sent = True
        try:
            conn.sendall(http.send(h11.Request(method="POST", target=KV_TRANSFER_PATH, headers=headers)))
            for chunk in encode_block(block):  # the arrays' own memory, chunk by chunk
                conn.sendall(chunk)
        except OSError:
            sent = False  # a receiver that refused early closes; its reply may still be readable
        status, body = _read_response(conn, http)
    if status is None:
        raise KVPostError(None, f"the K/V listener at {url} {'did not answer' if sent else 'cut the transfer off'}")
    if status != 200:
        try:
            message = orjson.loads(body)["message"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            message = body[:300].decode("utf-8", "replace")
        raise KVPostError(status, message)


def _read_response(conn: socket.socket, http: h11.Connection) -> tuple[int | None, bytes]:
    status, body = None, bytearray()
    try:
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                http.receive_data(conn.recv(_RECV))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
    except (OSError, h11.RemoteProtocolError):
        pass
    return (status if isinstance(status, int) else None), bytes(body)


def deliver_block(block: KVBlock, url: str, api_key: str | None = None) -> KVDelivery:
    """:func:`post_block`, its outcome as a :class:`KVDelivery` instead of an exception (for the
    thread that posts a block on behalf of a request, which hands the outcome on)."""
    started = time.perf_counter_ns()
    status: int | None = 200
    error = None
    try:
        post_block(url, block, api_key)
    except KVPostError as exc:
        status, error = exc.status, str(exc)
    return KVDelivery(url, block.nbytes, started, time.perf_counter_ns(), status, error)
