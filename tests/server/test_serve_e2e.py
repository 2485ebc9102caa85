"""End to end: ``manage.py serve`` in a subprocess, driven by the official ``openai`` client.

One server for the module; the tests run in file order and build on each other
(generate, then inspect the trace and metrics, then reset, then SIGTERM).
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.processes import Server, child_pids, start_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
PREFIX = "e2e_"  # serve --metrics-prefix: every /metrics name of ours starts with it
STREAM_USER = "e2e-stream-1"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    srv = start_server(["--model", "demo", "--enable-debug", "--enable-tracing", "--backend", "cpu",
                        "--max-num-seqs", "4",
                        "--max-total-tokens", "2048", "--prefill-chunk-size", "128", "--drain-timeout", "1",
                        "--metrics-prefix", PREFIX, "--metrics-vllm-aliases"],
                       tmp_path_factory.mktemp("var"))
    yield srv
    srv.stop()


def test_openai_client_streaming_chat_returns_exactly_max_tokens(server: Server) -> None:
    assert [m.id for m in server.openai.models.list()] == ["demo"]
    stream = server.openai.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        user=STREAM_USER,
        extra_body={"debug_config": {"ignore_eos": True}},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert all(c.id == STREAM_USER for c in chunks)


def test_openai_client_completions_and_errors(server: Server) -> None:
    completion = server.openai.completions.create(
        model="demo", prompt="The lighthouse keeper", max_tokens=4, extra_body={"debug_config": {"ignore_eos": True}}
    )
    assert completion.usage.completion_tokens == 4 and completion.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError, match="is not served"):
        server.openai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.openai.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                              temperature=7)


def test_trace_holds_the_requests_prefill_and_decode_spans(server: Server) -> None:
    response = server.http.post("/debug/dump_event_trace", json={"model": "demo"})
    assert response.status_code == 200
    events = response.json()["traceEvents"]
    tid = next(e["tid"] for e in events if e["name"] == "thread_name" and e["args"]["name"] == STREAM_USER)
    spans = {(e["name"].rsplit(" (", 1)[0], e["ph"]) for e in events if e.get("tid") == tid}
    assert {("prefill", "B"), ("prefill", "E"), ("decode", "B"), ("decode", "E")} <= spans
    decodes = [e for e in events if e.get("tid") == tid and e["name"].startswith("decode") and e["ph"] == "B"]
    assert len(decodes) == MAX_TOKENS - 1  # the first token comes from the prefill


def _metrics(server: Server) -> dict[str, dict]:
    response = server.http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def _value(family, sample_name: str, **labels: str) -> float:
    for sample in family.samples:
        if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    raise AssertionError(f"no sample {sample_name} {labels} in {family.name}")


def test_metrics_parse_as_prometheus_exposition(server: Server) -> None:
    families = _metrics(server)
    p = PREFIX
    assert _value(families[p + "prefill_time_seconds"], p + "prefill_time_seconds_total", model="demo") > 0
    assert _value(families[p + "finished_completion_tokens"], p + "finished_completion_tokens_total",
                  model="demo") == MAX_TOKENS + 4
    assert _value(families[p + "generation_tokens"], p + "generation_tokens_total", model="demo") == MAX_TOKENS + 4
    assert families[p + "time_to_first_token_seconds"].type == "histogram"
    assert _value(families[p + "time_to_first_token_seconds"], p + "time_to_first_token_seconds_count",
                  model="demo") == 2
    assert _value(families[p + "num_requests_running"], p + "num_requests_running", model="demo") == 0
    # --metrics-vllm-aliases: the same figures again under vLLM's names and model label.
    assert _value(families["vllm:generation_tokens"], "vllm:generation_tokens_total",
                  model_name="demo") == MAX_TOKENS + 4
    assert _value(families["vllm:time_to_first_token_seconds"], "vllm:time_to_first_token_seconds_count",
                  model_name="demo") == 2
    assert {name for name in families if not name.startswith(p)} == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions",
        "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:request_time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds"}
    # The server's own event loop, probed since it started listening (engines.server.loop_lag).
    assert families[p + "event_loop_lag_seconds"].type == "histogram"
    assert _value(families[p + "event_loop_lag_seconds"], p + "event_loop_lag_seconds_count") > 0
    lag = server.http.get("/stats").json()["event_loop_lag"]
    assert lag["probes"] > 0 and 0 <= lag["p50_ms_1m"] <= lag["max_ms_1m"]


def test_reset_brings_metrics_back_to_zero(server: Server) -> None:
    response = server.http.post("/debug/reset_engine", json={"model": "demo"})
    assert response.status_code == 200
    families = _metrics(server)
    p = PREFIX
    assert _value(families[p + "prefill_time_seconds"], p + "prefill_time_seconds_total", model="demo") == 0
    assert _value(families[p + "finished_completion_tokens"], p + "finished_completion_tokens_total",
                  model="demo") == 0
    assert _value(families[p + "generation_tokens"], p + "generation_tokens_total", model="demo") == 0
    assert _value(families[p + "time_to_first_token_seconds"], p + "time_to_first_token_seconds_count",
                  model="demo") == 0


def test_openai_client_sees_the_request_id_and_retrieves_the_model(server: Server) -> None:
    """Under Daphne: openai's ``_request_id`` is the reply's x-request-id, the client's when it sent one."""
    assert server.openai.models.retrieve("demo").id == "demo"
    completion = server.openai.completions.create(model="demo", prompt="Hi", max_tokens=2,
                                                  extra_headers={"X-Request-Id": "e2e-req-1"})
    assert completion._request_id == completion.id == "e2e-req-1"
    generated = server.openai.completions.create(model="demo", prompt="Hi", max_tokens=2)
    assert generated._request_id == generated.id and generated.id.startswith("cmpl-")
    with server.http.stream("POST", "/v1/completions", json={"model": "demo", "prompt": "Hi", "max_tokens": 2,
                                                            "stream": True}) as streamed:
        assert streamed.headers["x-request-id"].startswith("cmpl-")


def test_a_burst_of_connections_waits_in_the_listen_queue(server: Server) -> None:
    """While the server is not accepting (stopped here; busy in real life), 300 clients connecting
    at once all complete their handshakes: the listen queue holds them (Twisted's default of 50
    dropped the SYNs past 51, and those clients waited a second or more for a retransmission)."""
    clients = 300
    sockets = [socket.socket() for _ in range(clients)]
    selector = selectors.DefaultSelector()
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        for sock in sockets:
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", server.port))
            selector.register(sock, selectors.EVENT_WRITE)
        connected, deadline = 0, time.monotonic() + 0.8  # under the first SYN retransmission (1 s)
        while connected < clients and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.1):
                selector.unregister(key.fileobj)
                connected += key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        selector.close()
        for sock in sockets:
            sock.close()
    assert connected == clients
    assert server.http.get("/health").status_code == 200  # and the server goes on as before


def test_sigterm_drains_then_stops_engines_and_exits_cleanly(server: Server) -> None:
    """SIGTERM with streams in flight: new requests get 503; after the drain timeout every stream
    still running ends as a reset ends it (finish_reason "abort", then [DONE]); the engine (and its
    process) is stopped; the exit status is 0."""
    children = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in child_pids(server.process.pid)}
    engine_processes = [pid for pid, cmdline in children.items() if b"engine=demo" in cmdline]
    assert len(engine_processes) == 1  # serve runs the engine loop in its own process
    # and, with tracing on, digests saved traces in another (engines.history.digest)
    assert sum(b"spawn_main" in cmdline for cmdline in children.values()) == 1
    body = {"model": "demo", "messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 1500,
            "stream": True, "debug_config": {"ignore_eos": True}}
    streams = [server.http.stream("POST", "/v1/chat/completions", json={**body, "user": f"drain-{i}"})
               for i in range(3)]
    responses = [s.__enter__() for s in streams]
    try:
        lines = [r.iter_lines() for r in responses]
        for it in lines:
            assert next(it).startswith("data: ")
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        refused = server.http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
        assert refused.status_code == 503 and "shutting down" in refused.json()["message"]
        for it in lines:
            rest = [line for line in it if line]
            assert rest[-1] == "data: [DONE]"
            last = json.loads(rest[-2].removeprefix("data: "))
            assert last["choices"][0]["finish_reason"] == "abort"
        assert time.monotonic() - signalled < 10
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    assert server.process.wait(30) == 0
    output = server.output()
    assert "Engines stopped." in output and "Ended 3 unfinished request(s)" in output
    assert "Traceback" not in output
    assert "demo: cpu backend, weights float32, tracing on, own process" in output
    # The engine's and the digest's processes stop with the server, not left behind (multiprocessing's
    # resource tracker follows once the server's end of its pipe closes: a moment later).
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in children if Path(f"/proc/{pid}").exists()] == []
