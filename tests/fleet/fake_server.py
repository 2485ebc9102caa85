"""A foreign server for the fleet's tests: a real HTTP server on a free port answering as vLLM
0.11 does (``/metrics``, ``/version``, its control POSTs), or redirecting, or with HTML, and
counting its polls and POSTs."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.fleet import foreign_expositions as expo

__all__ = ["FakeServer"]


class FakeServer:
    """A real HTTP server on a free port that answers as ``behaviour`` says and counts polls."""

    def __init__(self, behaviour: str = "vllm") -> None:
        self.behaviour = behaviour  # "vllm", "sglang", "llama.cpp", "redirect" or "html"
        self.polls = 0
        self.posts: list[tuple[str, str]] = []  # (path, Authorization header) of each POST
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/get_server_info" and owner.behaviour == "sglang":
                    self._send(200, b'{"version": "0.5.6", "tp_size": 1}', "application/json")
                    return
                if self.path == "/version" and owner.behaviour == "vllm":
                    self._send(200, b'{"version": "0.11.0"}', "application/json")
                    return
                if self.path != "/metrics":
                    self._send(404, b"", "text/plain")
                    return
                owner.polls += 1
                if owner.behaviour == "redirect":
                    self.send_response(302)
                    self.send_header("Location", "http://elsewhere/metrics")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif owner.behaviour == "sglang":  # the "_" separator of some 2025-26 releases
                    body = expo.sglang("_", running=3, ttfts=[0.15, 0.3]).encode()
                    self._send(200, body, "text/plain; version=0.0.4")
                elif owner.behaviour == "llama.cpp":
                    self._send(200, expo.llama_cpp().encode(), "text/plain; version=0.0.4")
                elif owner.behaviour == "html":
                    self._send(200, b"<html>login</html>", "text/html")
                else:
                    self._send(200, expo.vllm("0.11", running=4, ttfts=[0.01, 0.2], itls=[0.02]).encode(),
                               "text/plain; version=0.0.4")

            def do_POST(self) -> None:
                owner.posts.append((self.path, self.headers.get("Authorization", "")))
                routes = {"vllm": ("/reset_prefix_cache", "/start_profile", "/stop_profile"),
                          "sglang": ("/flush_cache", "/start_profile", "/stop_profile")}
                known = self.path in routes.get(owner.behaviour, ())
                self._send(200 if known else 404, b"" if known else b'{"detail": "Not Found"}', "application/json")

            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
