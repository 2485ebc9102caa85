"""A served engine's process when its server is killed outright (SIGKILL, an OOM kill): it stops
with one line in the console, not a ``BrokenPipeError`` traceback from the step it was sending."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.processes import child_pids, is_running, start_server

pytestmark = pytest.mark.slow


def _stream_until_cut(base: str, streaming: threading.Event) -> None:
    """A long streamed request; ``streaming`` is set at its first chunk. Ends when the server dies."""
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
            "debug_config": {"ignore_eos": True}}
    try:
        with httpx.Client(base_url=base, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    streaming.set()
    except httpx.HTTPError:
        pass


def test_an_engine_whose_server_was_killed_mid_step_stops_with_one_line(tmp_path) -> None:
    srv = start_server(["--model", "demo", "--backend", "cpu", "--enable-debug", "--max-total-tokens", "8192"],
                       tmp_path)
    try:
        streaming = [threading.Event() for _ in range(3)]
        clients = [threading.Thread(target=_stream_until_cut, args=(srv.base, s), daemon=True) for s in streaming]
        for client in clients:
            client.start()
        assert all(s.wait(60) for s in streaming), "the requests did not stream"
        (engine,) = child_pids(srv.process.pid)
        time.sleep(0.2)  # steps under way: the engine is sending outputs when its server dies
        os.kill(srv.process.pid, signal.SIGKILL)
        srv.process.wait(10)
        console = srv.output()  # to its end: the engine process shares the server's console
        assert not is_running(engine), "the engine outlived its server"
    finally:
        srv.stop()
    engine_lines = [line for line in console.splitlines() if "[engine demo" in line]
    assert "Traceback" not in console and "BrokenPipeError" not in console, console[-3000:]
    assert len(engine_lines) == 1 and "went away" in engine_lines[0], engine_lines

