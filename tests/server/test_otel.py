"""OpenTelemetry export (engines.otel): the spans a receiver gets over OTLP/HTTP, parsed from the
protobuf with opentelemetry-proto, against the replies' usage; a dead endpoint; nothing when off."""
from __future__ import annotations

import asyncio
import gzip
import http.server
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from engines import otel
from engines.server import server_identity
from engines.registry import registry
from tests.server.conftest import TRACED
from tests.server.test_openai_api import leave_when, streamed_a_chunk
from tests.server.test_registry_and_serve_command import any_port  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind)


@dataclass
class Received:
    """A span as the receiver parsed it, with its resource's attributes."""

    span: Span
    resource: dict[str, Any]
    attributes: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.attributes = {kv.key: value_of(kv.value) for kv in self.span.attributes}

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def seconds(self) -> float:
        return (self.span.end_time_unix_nano - self.span.start_time_unix_nano) / 1e9


class Receiver:
    """An OTLP/HTTP trace receiver: ``POST /v1/traces`` with an ``ExportTraceServiceRequest``."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, ExportTraceServiceRequest]] = []
        received = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                export = ExportTraceServiceRequest()
                export.ParseFromString(body)
                received.append((self.path, self.headers.get("Content-Type", ""), export))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[Received]:
        out = []
        for _, _, export in self.requests:
            for resource_spans in export.resource_spans:
                resource = {kv.key: value_of(kv.value) for kv in resource_spans.resource.attributes}
                out.extend(Received(span, resource) for scope in resource_spans.scope_spans for span in scope.spans)
        return out

    def trace_of(self, request_id: str) -> dict[str, Received]:
        """The spans of one request by name: its request span (``request``) and its children."""
        spans = self.spans()
        [top] = [s for s in spans if s.attributes.get("gen_ai.request.id") == request_id]
        family = {"request": top}
        for s in spans:
            if s.span.trace_id == top.span.trace_id and s is not top:
                family[s.name] = s
        return family

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    got = Receiver()
    otel.configure(got.url)
    yield got
    otel.shutdown()
    got.close()


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": TRACED, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5,
            "temperature": 0.0, "debug_config": {"ignore_eos": True}, **extra}


def near(seconds: float) -> Any:
    """A span's duration against the engine's figure: the same stamps, each rounded to the ns."""
    return pytest.approx(seconds, abs=3e-9)


async def test_a_chat_request_s_spans_are_the_engine_s_figures_in_the_client_s_trace(client, receiver) -> None:
    before = time.time_ns()
    response = await client.post(CHAT, json=chat(), headers={
        "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": "vendor=opaque,other=1"})
    after = time.time_ns()
    assert response.status_code == 200, response.text
    reply = response.json()
    assert otel.force_flush()
    assert {(path, kind) for path, kind, _ in receiver.requests} == {("/v1/traces", "application/x-protobuf")}
    spans = receiver.trace_of(reply["id"])
    top = spans["request"]
    assert sorted(spans) == ["decode", "prefill", "preprocess", "queue", "request"]
    # Joined to the client's span, its tracestate carried on.
    assert top.name == f"chat {TRACED}" and top.span.kind == Span.SPAN_KIND_SERVER
    assert top.span.trace_id.hex() == TRACE_ID and top.span.parent_span_id.hex() == PARENT_ID
    assert top.span.trace_state == "vendor=opaque,other=1"
    for name in ("queue", "prefill", "decode"):
        assert spans[name].span.parent_span_id == top.span.span_id, name
    assert spans["preprocess"].span.parent_span_id == spans["queue"].span.span_id
    assert top.span.status.code == Status.STATUS_CODE_UNSET
    # The GenAI conventions, and the request id.
    usage = reply["usage"]
    assert top.attributes == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "llm-debugsite",
        "gen_ai.request.model": TRACED, "gen_ai.response.model": TRACED,
        "gen_ai.request.id": reply["id"], "gen_ai.response.id": reply["id"],
        "gen_ai.request.max_tokens": 5, "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0,
        "gen_ai.request.stream": False, "gen_ai.response.finish_reasons": ["length"],
        "gen_ai.usage.input_tokens": usage["prompt_tokens"], "gen_ai.usage.output_tokens": 5,
        **{key: top.attributes[key] for key in top.attributes if key.startswith("gen_ai.latency.")},
    }
    assert top.resource["service.name"] == "llm-debugsite"
    assert top.resource["service.instance.id"] == server_identity.server_id()
    # The engine's own figures: usage.extra's, exactly, and the spans' lengths to the nanosecond.
    extra = usage["extra"]
    assert top.attributes["gen_ai.latency.time_in_queue"] == extra["queue_time_s"]
    assert top.attributes["gen_ai.latency.time_to_first_token"] == extra["ttft_s"]
    assert top.attributes["gen_ai.latency.e2e"] == extra["end_to_end_latency_s"]
    assert top.seconds == near(extra["end_to_end_latency_s"])
    assert spans["queue"].seconds == near(extra["queue_time_s"])
    [first_token] = top.span.events
    assert first_token.name == "first token"
    assert (first_token.time_unix_nano - top.span.start_time_unix_nano) / 1e9 == near(extra["ttft_s"])
    # One timeline: each phase begins where the one before ended.
    assert spans["queue"].span.start_time_unix_nano == top.span.start_time_unix_nano
    assert spans["preprocess"].span.start_time_unix_nano == top.span.start_time_unix_nano
    assert spans["preprocess"].span.end_time_unix_nano <= spans["queue"].span.end_time_unix_nano
    assert spans["prefill"].span.start_time_unix_nano == spans["queue"].span.end_time_unix_nano
    assert spans["prefill"].span.end_time_unix_nano == first_token.time_unix_nano
    assert spans["decode"].span.start_time_unix_nano == first_token.time_unix_nano
    assert spans["decode"].span.end_time_unix_nano == top.span.end_time_unix_nano
    assert spans["decode"].seconds == pytest.approx(top.attributes["gen_ai.latency.time_in_model_decode"], abs=3e-9)
    # On the wall clock: within the request's time as the client saw it (give or take the clocks'
    # drift since the process took its anchor: the Chrome trace's, engines.runtime.epoch_anchor_ns).
    slack = 50_000_000
    assert before - slack <= top.span.start_time_unix_nano < top.span.end_time_unix_nano <= after + slack


async def test_a_text_completion_without_traceparent_is_a_trace_of_its_own(client, receiver) -> None:
    body = {"model": TRACED, "prompt": "Once upon a time", "max_tokens": 3, "n": 2, "seed": 7, "stop": ["zz"],
            "stream": True, "stream_options": {"include_usage": True}, "debug_config": {"ignore_eos": True}}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200
    # A client whose span is not sampled: the server records none either (the SDK's parent-based sampler).
    unsampled = await client.post(COMPLETIONS, json={**body, "user": "unsampled"},
                                  headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"})
    assert unsampled.status_code == 200
    assert otel.force_flush()
    first = next(line for line in response.text.splitlines() if line.startswith("data: {"))
    request_id = json.loads(first[len("data: "):])["id"]
    spans = receiver.trace_of(request_id)
    top = spans["request"]
    assert top.name == f"text_completion {TRACED}" and top.span.parent_span_id == b""
    assert top.attributes["gen_ai.operation.name"] == "text_completion"
    assert top.attributes["gen_ai.request.choice.count"] == 2 and top.attributes["gen_ai.request.seed"] == 7
    assert top.attributes["gen_ai.request.stop_sequences"] == ["zz"]
    assert top.attributes["gen_ai.request.stream"] is True
    assert top.attributes["gen_ai.response.finish_reasons"] == ["length", "length"]
    assert top.attributes["gen_ai.usage.output_tokens"] == 6
    assert not [s for s in receiver.spans() if str(s.attributes.get("gen_ai.request.id", "")).startswith("unsampled")]


async def test_a_refused_request_and_one_whose_client_left_end_in_error(client, receiver) -> None:
    refused = await client.post(CHAT, json=chat(max_tokens=10**6))  # past the context: the engine refuses
    assert refused.status_code == 400
    await leave_when(chat(stream=True, max_tokens=1000, user="left"), streamed_a_chunk)
    assert otel.force_flush()
    spans = receiver.spans()
    [refusal] = [s for s in spans if s.attributes["gen_ai.request.max_tokens"] == 10**6]
    assert refusal.span.status.code == Status.STATUS_CODE_ERROR
    assert refusal.attributes["error.type"] == "EngineRequestError"
    assert "refused" in refusal.span.status.message and refusal.name == f"chat {TRACED}"
    [left] = [s for s in spans if s.attributes.get("gen_ai.request.id") == "left"]
    assert left.span.status.code == Status.STATUS_CODE_ERROR and left.attributes["error.type"] == "cancelled"
    assert left.attributes["gen_ai.usage.output_tokens"] >= 1  # what it had streamed
    assert "gen_ai.response.finish_reasons" not in left.attributes


async def test_a_request_aborted_by_a_reset_ends_in_error_with_its_phases(client, receiver) -> None:
    engine = registry.get(TRACED)

    async def reset_once_running() -> None:
        while not engine.is_streaming("reset-me"):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        await engine.reset()

    reset = asyncio.create_task(reset_once_running())
    response = await client.post(CHAT, json=chat(max_tokens=1000, user="reset-me"))
    await reset
    assert response.json()["choices"][0]["finish_reason"] == "abort"
    assert otel.force_flush()
    spans = receiver.trace_of("reset-me")
    assert spans["request"].span.status.code == Status.STATUS_CODE_ERROR
    assert spans["request"].attributes["error.type"] == "abort"
    assert spans["request"].attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert {"queue", "preprocess"} <= set(spans)


async def test_a_dead_endpoint_fails_no_request_and_is_told_once(client, monkeypatch, caplog) -> None:
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The exporter's retries, short: one, a second after the first attempt (whose reason it logs).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1.5")
    otel.configure(f"http://127.0.0.1:{port}/v1/traces")
    try:
        with caplog.at_level(logging.DEBUG):
            for _ in range(2):
                for _ in range(2):
                    assert (await client.post(CHAT, json=chat(max_tokens=2))).status_code == 200
                assert otel.force_flush()  # an export that fails
    finally:
        otel.shutdown()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings] == ["engines.otel"], [r.getMessage() for r in warnings]
    assert f"127.0.0.1:{port}" in warnings[0].getMessage() and "refused" in warnings[0].getMessage().lower()
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]


def test_the_endpoint_comes_from_the_flag_or_the_standard_variables() -> None:
    traces, base = otel.ENDPOINT_VARIABLES
    assert otel.endpoint_from(None, {}) is None
    assert otel.endpoint_from(None, {base: "http://collector:4318"}) == "http://collector:4318/v1/traces"
    assert otel.endpoint_from(None, {base: "http://collector:4318/"}) == "http://collector:4318/v1/traces"
    assert otel.endpoint_from(None, {traces: "http://c:4318/custom", base: "http://other:4318"}) == \
        "http://c:4318/custom"
    assert otel.endpoint_from("http://flag:4318/v1/traces", {traces: "http://c:4318/x"}) == \
        "http://flag:4318/v1/traces"
    assert otel.endpoint_from(None, {traces: "http://c:4318/x", "OTEL_SDK_DISABLED": "true"}) is None
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_ENDPOINT 'collector:4317/v1/traces' is not an OTLP/HTTP"):
        otel.endpoint_from(None, {base: "collector:4317"})


@pytest.mark.usefixtures("any_port")
def test_serve_takes_the_flag_and_refuses_a_bad_url_before_the_models_load(monkeypatch) -> None:
    from engines.management.commands.serve import Command

    configured: list[str | None] = []
    monkeypatch.setattr(otel, "configure", lambda endpoint, service_name=None: configured.append(endpoint))
    for step in ("_apply_migrations", "_run_daphne"):
        monkeypatch.setattr(Command, step, lambda *args, **kwargs: None)
    monkeypatch.setattr(Command, "_load_engines", lambda self, specs, options: None)
    for name in otel.ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    call_command("serve", "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces")
    call_command("serve")
    assert configured == ["http://127.0.0.1:4318/v1/traces", None]
    monkeypatch.setattr(Command, "_load_engines", lambda *args: pytest.fail("the models loaded"))
    with pytest.raises(CommandError, match="not an OTLP/HTTP URL"):
        call_command("serve", "--otlp-traces-endpoint", "127.0.0.1:4318")


def test_off_nothing_of_the_span_export_is_imported() -> None:
    """No endpoint: the server's modules import no tracing SDK, exporter, propagator or protobuf.
    (redis-py 8 imports the metrics SDK when it is installed, for an instrumentation it runs only
    when initialised: it is idle here, and no span of ours needs it.)"""
    code = """
import os, sys
os.environ["DJANGO_SETTINGS_MODULE"] = "debugsite.settings"
import debugsite.asgi
from engines.management.commands import serve
from engines import otel
from engines.serving import generation
assert otel.configure(otel.endpoint_from(None)) is None and otel.begin(None, None, None, "m") is None
ours = ("engines.otel.export", "opentelemetry.sdk.trace", "opentelemetry.exporter", "opentelemetry.propagate",
        "opentelemetry.proto", "google.protobuf")
loaded = sorted(m for m in sys.modules if m.startswith(ours))
assert not loaded, loaded
print("clean")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "clean", result.stderr


async def test_the_decode_half_of_a_disaggregated_request_is_a_span_in_the_client_s_trace(client, receiver) -> None:
    """MicroServing's start_generate (what a router calls with the client's traceparent) makes the
    request's span, joined to that trace; prep_recv and remote_send make none."""
    from tests.server.test_microserving import disaggregated, new_user

    user, traced = new_user(), new_user()
    reply = await disaggregated(client, user, -1)
    assert reply.status_code == 200, reply.text
    start = await disaggregated(client, traced, -1, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert start.status_code == 200, start.text
    assert otel.force_flush()
    spans = receiver.trace_of(traced)
    top = spans["request"]
    assert top.span.trace_id.hex() == TRACE_ID and top.span.parent_span_id.hex() == PARENT_ID
    assert top.attributes["gen_ai.usage.output_tokens"] == start.json()["usage"]["completion_tokens"]
    assert {"queue", "prefill", "decode"} <= set(spans)
    # The first disaggregated run (no traceparent) is a trace of its own, from start_generate alone.
    assert len([s for s in receiver.spans() if s.attributes.get("gen_ai.request.id") == user]) == 1
