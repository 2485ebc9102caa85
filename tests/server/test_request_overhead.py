"""What an API request costs the server beyond its view: no thread of its own, no form parsing.

Both were measured under load (docs/perf-log/serving-and-tools.md#server): a new executor thread per
request and Twisted's form parsing were a third of the event loop's time per one-token request,
and the queue they built up in bursts of arrivals was most of the HTTP time to first token.
"""
from __future__ import annotations

import threading

import daphne.server  # noqa: F401 - installs Twisted's asyncio reactor before twisted.web loads
import pytest
from daphne import http_protocol
from django.core import signals
from twisted.web.test.requesthelper import DummyChannel

from engines.server import daphne_requests
from tests.server.conftest import TRACED


@pytest.fixture
def thread_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads started while the test runs."""
    started: list[str] = []
    start = threading.Thread.start

    def counting_start(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    return started


async def test_api_requests_start_no_thread_and_still_send_the_request_signals(serve, thread_starts) -> None:
    """Django's handler opened a thread-sensitive context per request, whose executor started a
    thread for the request signals' receivers (and another to join it); the API handler runs them
    on one thread of its own, not asgiref's global one that Channels' websockets use. The signals
    themselves still fire, once each per request (they close stale database connections)."""
    fired: list[tuple[str, str]] = []

    def on_started(**kwargs: object) -> None:
        fired.append(("started", threading.current_thread().name))

    def on_finished(**kwargs: object) -> None:
        fired.append(("finished", threading.current_thread().name))

    signals.request_started.connect(on_started)
    signals.request_finished.connect(on_finished)
    try:
        async with serve(enable_debug=True) as http:
            assert (await http.get("/v1/models")).status_code == 200  # the API's thread starts once
            thread_starts.clear()
            fired.clear()
            for _ in range(4):
                assert (await http.get("/v1/models")).status_code == 200
                body = {"model": TRACED, "prompt": "hi", "max_tokens": 1, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    assert (await response.aread()).endswith(b"data: [DONE]\n\n")
    finally:
        signals.request_started.disconnect(on_started)
        signals.request_finished.disconnect(on_finished)
    # Per-request executors are unnamed ("ThreadPoolExecutor-N_0"), joined by "Thread-N (join)".
    assert [name for name in thread_starts if name.startswith("ThreadPoolExecutor") or "(join)" in name] == []
    assert [signal for signal, _ in fired] == ["started", "finished"] * 8
    assert {thread.split("_")[0] for _, thread in fired} == {"api-sync"}


def posted(request_class: type, content_type: bytes, body: bytes):
    """A Daphne request of ``request_class`` that received ``POST /v1/x`` with this body (not processed)."""
    channel = DummyChannel()

    class Server:
        def protocol_connected(self, protocol: object) -> None:
            pass

    channel.factory = type("Factory", (), {"server": Server()})()
    request = request_class(channel)
    request.process = lambda: None  # what Daphne does next (hand the body to the application) is not under test
    request.requestHeaders.setRawHeaders(b"content-type", [content_type])
    request.requestHeaders.setRawHeaders(b"content-length", [str(len(body)).encode()])
    request.gotLength(len(body))
    request.handleContentChunk(body)
    request.requestReceived(b"POST", b"/v1/x", b"HTTP/1.1")
    return request


@pytest.mark.parametrize("content_type,body", [
    (b"application/x-www-form-urlencoded", b"a=1&b=2"),
    (b"multipart/form-data; boundary=xyz",
     b'--xyz\r\nContent-Disposition: form-data; name="a"\r\n\r\n1\r\n--xyz--\r\n'),
])
def test_daphne_requests_leave_form_bodies_to_the_application(content_type: bytes, body: bytes) -> None:
    """Twisted parses form bodies into ``args`` (Daphne's own request does); ours leaves ``args``
    empty and the body, untouched, for the application."""
    assert posted(http_protocol.WebRequest, content_type, body).args  # what the class saves
    request = posted(daphne_requests.BodyOnlyRequest, content_type, body)
    assert request.args == {}
    request.content.seek(0)
    assert request.content.read() == body


def test_install_makes_daphnes_factory_build_body_only_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve`` calls ``install()``; Daphne's HTTP factory then gives each connection our request class."""
    monkeypatch.setattr(http_protocol, "WebRequest", http_protocol.WebRequest)  # restored after the test
    daphne_requests.install()

    class Server:
        pass

    protocol = http_protocol.HTTPFactory(Server()).buildProtocol(("127.0.0.1", 0))
    assert protocol.requestFactory is daphne_requests.BodyOnlyRequest
