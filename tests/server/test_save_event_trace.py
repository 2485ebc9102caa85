"""``POST /debug/save_event_trace`` and the Python API behind it (``asave_engine_trace``), on real demo engines."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from engines.history import TraceUnavailableError, asave_engine_trace, save_engine_trace
from engines.history.payload import decompress_json
from engines.models import RequestSummary, TraceRecord
from engines.registry import registry
from engines.startup import ModelSpec, build_engines
from engines.runtime.core.engine import EngineConfig
from engines.runtime.frontend.async_engine import AsyncEngine
from engines.server.server_identity import server_id
from tests.server.conftest import SMALL_ENGINE, TRACED, UNTRACED, assert_error, assert_invalid_request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("async_db_connections_closed")]

KEY = "s3cret-key"


async def generate(http: httpx.AsyncClient, user: str, max_tokens: int = 4, model: str = TRACED) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "user": user, "debug_config": {"ignore_eos": True}}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


async def stored(pk: int) -> tuple[TraceRecord, list[RequestSummary]]:
    record = await TraceRecord.objects.aget(pk=pk)
    summaries = [s async for s in RequestSummary.objects.filter(trace_id=pk).order_by("request_id")]
    return record, summaries


# ------------------------------------------------------------------------------- saving


async def test_save_stores_exactly_what_dump_event_trace_returns(client: httpx.AsyncClient) -> None:
    await generate(client, "saved-1", max_tokens=3)
    await generate(client, "saved-2", max_tokens=5)
    dumped = await client.post("/debug/dump_event_trace", json={"model": TRACED})
    response = await client.post("/debug/save_event_trace",
                                 json={"model": TRACED, "note": "before the change", "tags": ["ab", " x ", "ab"]})
    assert response.status_code == 200, response.text
    reply = response.json()
    assert set(reply) == {"id", "admin_url", "events", "requests", "dropped_events"}
    assert reply["admin_url"] == f"/admin/engines/tracerecord/{reply['id']}/change/"

    record, summaries = await stored(reply["id"])
    # No traffic in between: the saved payload is the dumped trace, byte for byte.
    assert decompress_json(bytes(record.payload)) == dumped.content
    other = dumped.json()["otherData"]
    assert (reply["events"], reply["requests"], reply["dropped_events"]) == (
        other["event_count"], other["request_count"], other["dropped_events"]) == (
        record.event_count, record.request_count, record.dropped_events)
    assert reply["requests"] == 2 and reply["events"] > 0
    assert (record.engine, record.model, record.backend, record.source) == (TRACED, "demo", "cpu", "api")
    assert (record.note, record.tag_list) == ("before the change", ["ab", "x"])
    assert [(s.request_id, s.completion_tokens) for s in summaries] == [("saved-1", 3), ("saved-2", 5)]
    # This server wrote it, and its summaries name the same server.
    assert {(r.server, r.fleet) for r in (record, *summaries)} == {(server_id(), "default")}
    # Without "clear" the engine keeps its trace.
    assert registry.get(TRACED).engine.tracer.request_ids() == ["saved-1", "saved-2"]


async def test_save_with_clear_empties_the_trace(client: httpx.AsyncClient) -> None:
    await generate(client, "cleared-1")
    response = await client.post("/debug/save_event_trace", json={"model": TRACED, "clear": True})
    assert response.status_code == 200, response.text
    tracer = registry.get(TRACED).engine.tracer
    assert (tracer.event_count, tracer.request_ids()) == (0, [])
    record, summaries = await stored(response.json()["id"])
    assert [s.request_id for s in summaries] == ["cleared-1"] and record.note == ""
    # The next save holds only what came after the first one.
    await generate(client, "cleared-2")
    record, summaries = await stored((await client.post(
        "/debug/save_event_trace", json={"model": TRACED, "clear": True})).json()["id"])
    assert [s.request_id for s in summaries] == ["cleared-2"]


async def test_save_needs_the_api_key_when_one_is_set(serve, engines) -> None:
    async with serve(api_key=KEY) as http:
        assert_error(await http.post("/debug/save_event_trace", json={"model": TRACED}), 401)
        assert_error(await http.post("/debug/save_event_trace", json={"model": TRACED},
                                     headers={"Authorization": "Bearer wrong"}), 401)
        assert not await TraceRecord.objects.aexists()
        auth = {"Authorization": f"Bearer {KEY}"}
        assert (await http.post("/v1/completions", json={"model": TRACED, "prompt": "hi", "max_tokens": 2},
                                headers=auth)).status_code == 200
        response = await http.post("/debug/save_event_trace", json={"model": TRACED}, headers=auth)
    assert response.status_code == 200, response.text
    assert await TraceRecord.objects.filter(pk=response.json()["id"]).aexists()


async def test_save_is_absent_without_enable_debug(serve) -> None:
    async with serve(enable_debug=False) as http:
        error = assert_error(await http.post("/debug/save_event_trace", json={"model": TRACED}), 404)
    assert "--enable-debug" in error["message"]
    assert not await TraceRecord.objects.aexists()


# ------------------------------------------------------------------------------- errors


async def test_an_empty_trace_is_not_saved_and_the_answer_says_why(client: httpx.AsyncClient) -> None:
    """Right after a reset (the fixture's) the engine has recorded nothing: no empty record."""
    error = assert_error(await client.post("/debug/save_event_trace", json={"model": TRACED}), 409)
    assert error["message"] == (f"engine {TRACED} has recorded no event since its trace was last cleared or saved: "
                                "nothing to save (send it a request first).")
    assert not await TraceRecord.objects.aexists()
    await generate(client, "then-one")
    assert (await client.post("/debug/save_event_trace", json={"model": TRACED})).status_code == 200



@pytest.mark.parametrize("raw", [b"{oops", b"[]", b'{"model": 7}'])
async def test_save_invalid_request(client: httpx.AsyncClient, raw: bytes) -> None:
    assert_invalid_request(await client.post("/debug/save_event_trace", content=raw), raw.decode())


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("raw", [b"", b"{}", b'{"note": "x"}'])
async def test_save_without_a_model_saves_the_first_engine_s_trace(client: httpx.AsyncClient, raw: bytes) -> None:
    await generate(client, "first-engine")
    response = await client.post("/debug/save_event_trace", content=raw)
    assert response.status_code == 200, response.text
    record = await TraceRecord.objects.aget(pk=response.json()["id"])
    assert record.engine == TRACED


async def test_save_unknown_model(client: httpx.AsyncClient) -> None:
    response = await client.post("/debug/save_event_trace", json={"model": "nope"})
    assert_error(response, 400, 'The requested model "nope" is not served.')


async def test_save_tracing_off(client: httpx.AsyncClient) -> None:
    response = await client.post("/debug/save_event_trace", json={"model": UNTRACED})
    assert_error(response, 400, f'The requested model "{UNTRACED}" does not enable tracing')


@pytest.mark.parametrize("options, field", [
    ({"note": 5}, '"note"'),
    ({"note": None}, '"note"'),
    ({"tags": "a,b"}, '"tags"'),
    ({"tags": ["ok", 3]}, '"tags.1"'),
    ({"tags": ["t" * 200, "u" * 200]}, '"tags": tags are 401 characters joined; at most 255 fit'),
    ({"clear": "yes"}, '"clear"'),
    ({"note": "a\x00b"}, '"note": note must not contain NUL'),
    ({"tags": ["a\x00b"]}, '"tags": tags must not contain NUL'),
])
async def test_save_refuses_bad_options_and_keeps_the_trace(client: httpx.AsyncClient, options, field) -> None:
    await generate(client, "kept")
    response = await client.post("/debug/save_event_trace", json={"model": TRACED, "clear": True, **options})
    error = assert_error(response, 400)
    assert error["message"].startswith(f"Invalid {field}"), error["message"]
    assert not await TraceRecord.objects.aexists()
    assert registry.get(TRACED).engine.tracer.request_ids() == ["kept"]  # a refused save never clears


@pytest.fixture
def killed_engine() -> Iterator[AsyncEngine]:
    """A traced engine in its own process, SIGKILLed: how a crashed engine (an OOM kill, a segfault
    in a kernel) looks to the server."""
    (engine,) = build_engines([ModelSpec("demo", "killed")], EngineConfig(**SMALL_ENGINE), backend="cpu",
                              enable_tracing=True, process=True, restart=False)
    engine.start()
    os.kill(engine._transport.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.error is None:  # the reader thread notices the closed socket
        assert time.monotonic() < deadline, "the killed engine process was not noticed"
        time.sleep(0.02)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("route", ["save_event_trace", "dump_event_trace"])
async def test_a_killed_engine_process_is_503_not_500(serve, killed_engine: AsyncEngine, route: str) -> None:
    async with serve(enable_debug=True, serving=[killed_engine]) as http:
        error = assert_error(await http.post(f"/debug/{route}", json={"model": "killed"}), 503)
    assert "'killed'" in error["message"]  # the runtime's message, naming the engine
    assert not await TraceRecord.objects.aexists()


async def test_a_request_id_with_nul_does_not_lose_the_cleared_window(client: httpx.AsyncClient) -> None:
    """The client's ``user`` becomes the request id; PostgreSQL text cannot hold NUL."""
    await generate(client, "nul\x00id")
    response = await client.post("/debug/save_event_trace", json={"model": TRACED, "clear": True})
    assert response.status_code == 200, response.text
    _, summaries = await stored(response.json()["id"])
    assert [s.request_id for s in summaries] == ["nul\ufffdid"]


# --------------------------------------------------------------------------- Python API


async def test_python_api_by_name_or_engine(client: httpx.AsyncClient, engines) -> None:
    await generate(client, "api-1")
    record = await asave_engine_trace(TRACED, note="from python", tags="a, b")
    assert (record.source, record.request_count, record.note, record.tags) == ("api", 1, "from python", "a,b")
    record = await asave_engine_trace(engines[TRACED], clear=True, source="dashboard")
    assert (record.source, record.request_count) == ("dashboard", 1)
    assert engines[TRACED].engine.tracer.event_count == 0
    with pytest.raises(TraceUnavailableError, match='"nope" is not served'):
        await asave_engine_trace("nope")
    with pytest.raises(TraceUnavailableError, match="does not enable tracing"):
        await asave_engine_trace(engines[UNTRACED])
    with pytest.raises(ValueError, match="source must be one of"):
        await asave_engine_trace(TRACED, source="cron")
    assert await TraceRecord.objects.acount() == 2


def test_sync_python_api(engines) -> None:
    """For code that drives engines without an event loop; the name lookup needs no registry entry."""
    engine = engines[TRACED]
    engine.engine.tracer.clear()
    engine.engine.tracer.add_event("sync-1", "first token")
    record = save_engine_trace(engine, note="sync", clear=True)
    assert (record.engine, record.request_count, record.event_count, record.note) == (TRACED, 1, 1, "sync")
    assert engine.engine.tracer.event_count == 0
    with pytest.raises(TraceUnavailableError, match='"demo" is not served'):
        save_engine_trace(TRACED)  # nothing registered outside the serve fixture


async def test_a_save_while_the_database_is_away_is_a_503_and_takes_nothing(client: httpx.AsyncClient,
                                                                             monkeypatch) -> None:
    """The database refusing connections (PostgreSQL restarting): a clear 503, and the engine's
    trace is not taken, not even with ``clear``: it is all there for the next save."""
    from django.db import OperationalError
    from django.db.backends.base.base import BaseDatabaseWrapper

    await generate(client, "kept-through-outage")
    before = (await client.post("/debug/dump_event_trace", json={"model": TRACED})).json()["traceEvents"]

    def refused(self, *args, **kwargs) -> None:
        raise OperationalError("connection refused")

    with monkeypatch.context() as patch:
        patch.setattr(BaseDatabaseWrapper, "ensure_connection", refused)
        response = await client.post("/debug/save_event_trace", json={"model": TRACED, "clear": True})
    error = assert_error(response, 503)
    assert "database does not answer" in error["message"] and "nothing was saved or taken" in error["message"]
    after = (await client.post("/debug/dump_event_trace", json={"model": TRACED})).json()["traceEvents"]
    assert len(after) >= len(before)  # nothing was cleared
    saved = await client.post("/debug/save_event_trace", json={"model": TRACED, "clear": True})
    assert saved.status_code == 200 and saved.json()["requests"] >= 1
