"""The built-in profiler over HTTP and the dashboard's socket: start, stop and save; a profile
that stops by itself is saved without anyone asking; clear 4xx for wrong states and bodies."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from asgiref.sync import sync_to_async

from engines.models import ProfileRecord
from engines.profiling import profile_state
from engines.registry import registry
from engines.server.server_identity import server_id
from tests.server.conftest import TRACED, UNTRACED, assert_error

pytestmark = pytest.mark.django_db(transaction=True)


async def load(http: httpx.AsyncClient, n: int = 3, max_tokens: int = 12, model: str = TRACED) -> None:
    async def one(i: int) -> None:
        body = {"model": model, "prompt": f"profile me {i}", "max_tokens": max_tokens,
                "debug_config": {"ignore_eos": True}}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text

    await asyncio.gather(*(one(i) for i in range(n)))


async def test_start_load_stop_saves_a_profile_of_every_kernel(client: httpx.AsyncClient) -> None:
    started = await client.post("/debug/profile_start", json={"model": TRACED, "stack_sampling": True})
    assert started.status_code == 200, started.text
    assert started.json() == {"status": "profiling", "model": TRACED, "max_steps": None, "max_seconds": 60.0,
                              "stack_sampling": True, "trigger": None}
    await load(client)
    stopped = await client.post("/debug/profile_stop", json={"model": TRACED, "note": "<b>first</b>"})
    assert stopped.status_code == 200, stopped.text
    reply = stopped.json()
    record = await ProfileRecord.objects.aget(pk=reply["profile_id"])
    assert reply["url"] == f"/dashboard/profiles/{record.pk}/"
    assert reply["admin_url"] == f"/admin/engines/profilerecord/{record.pk}/change/"
    assert record.engine == TRACED and record.backend == "cpu" and record.note == "<b>first</b>"
    assert (record.server, record.fleet) == (server_id(), "default")
    assert record.steps == reply["steps"] > 0 and record.stopped_by == "request" and record.stack_samples > 0
    names = {k["name"] for k in record.kernels}
    assert {"embedding", "add_rmsnorm", "rope_kv_append", "attention", "silu_mul"} <= names
    assert sum(k["calls"] for k in record.kernels) == record.kernel_calls == reply["kernel_calls"]


async def test_wrong_states_and_bodies_are_clear_4xx(client: httpx.AsyncClient) -> None:
    assert_error(await client.post("/debug/profile_stop", json={"model": TRACED}), 409)
    for body, field in (({"max_steps": 0}, "max_steps"), ({"max_steps": "5"}, "max_steps"),
                        ({"stack_sampling": "yes"}, "stack_sampling"), ({"max_seconds": -1}, "max_seconds")):
        error = assert_error(await client.post("/debug/profile_start", json={"model": TRACED, **body}), 400)
        assert f'Invalid "{field}"' in error["message"]
    assert (await client.post("/debug/profile_start", json={"model": TRACED})).status_code == 200
    try:
        error = assert_error(await client.post("/debug/profile_start", json={"model": TRACED}), 409)
        assert "already running" in error["message"]
        assert_error(await client.post("/debug/profile_start", json={"model": "nope"}), 400)
    finally:
        # It saw no step (no request ran): nothing to save, and it says so rather than keep an empty record.
        before = await ProfileRecord.objects.acount()
        error = assert_error(await client.post("/debug/profile_stop", json={"model": TRACED}), 409)
        assert error["message"] == (f"Engine {TRACED}: the profile saw no engine step (no request ran while it was "
                                    "on), so nothing was saved: start it again and send requests "
                                    "(POST /debug/profile_start).")
        assert await ProfileRecord.objects.acount() == before
    error = assert_error(await client.post("/debug/profile_stop", json={"model": TRACED}), 409)
    assert error["message"] == f"Engine {TRACED}: no profile is running: start one first (POST /debug/profile_start)."


async def test_a_note_sent_after_the_profile_stopped_by_itself_goes_on_its_record(client: httpx.AsyncClient) -> None:
    assert (await client.post("/debug/profile_start", json={"model": UNTRACED, "max_steps": 2})).status_code == 200
    await load(client, model=UNTRACED)
    for _ in range(100):  # saved by the watcher, which looks twice a second
        if profile_state(registry.get(UNTRACED)).last_id and not profile_state(registry.get(UNTRACED)).running:
            break
        await asyncio.sleep(0.1)
    stopped = await client.post("/debug/profile_stop", json={"model": UNTRACED, "note": "late note"})
    assert stopped.status_code == 200
    record = await ProfileRecord.objects.aget(pk=stopped.json()["profile_id"])
    assert record.note == "late note" and record.stopped_by == "max_steps"


async def test_a_profile_that_stops_by_itself_is_saved(client: httpx.AsyncClient) -> None:
    before = await ProfileRecord.objects.acount()
    started = await client.post("/debug/profile_start", json={"model": UNTRACED, "max_steps": 3})
    assert started.status_code == 200
    await load(client, model=UNTRACED)
    for _ in range(100):  # the watcher looks twice a second
        if await ProfileRecord.objects.acount() > before:
            break
        await asyncio.sleep(0.1)
    record = await sync_to_async(ProfileRecord.objects.latest)("id")
    assert record.engine == UNTRACED and record.steps == 3 and record.stopped_by == "max_steps"
    # Stop now answers with that record; after that, nothing is running.
    stopped = await client.post("/debug/profile_stop", json={"model": UNTRACED})
    assert stopped.status_code == 200 and stopped.json()["profile_id"] == record.pk
    assert_error(await client.post("/debug/profile_stop", json={"model": UNTRACED}), 409)


def _database_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """The history's database does not answer (as ``_check_database`` finds when PostgreSQL is down)."""
    from engines.history import capture
    from engines.history.outage import HistoryUnavailableError

    def away() -> None:
        raise HistoryUnavailableError("the history's database does not answer (connection refused)")
    monkeypatch.setattr(capture, "_check_database", away)


async def test_a_stop_while_the_database_is_away_keeps_the_profile_running(
        client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (await client.post("/debug/profile_start", json={"model": TRACED})).status_code == 200
    await load(client)
    with monkeypatch.context() as patch:
        _database_away(patch)
        refused = await client.post("/debug/profile_stop", json={"model": TRACED})
        assert_error(refused, 503)
        assert "still running" in refused.json()["message"]
        assert profile_state(registry.get(TRACED)).running  # nothing was taken from the engine
    stopped = await client.post("/debug/profile_stop", json={"model": TRACED})
    assert stopped.status_code == 200, stopped.text
    assert (await ProfileRecord.objects.aget(pk=stopped.json()["profile_id"])).steps > 0


async def test_a_profile_that_stops_by_itself_while_the_database_is_away_is_saved_when_it_is_back(
        client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from engines import profiling

    monkeypatch.setattr(profiling, "DATABASE_RETRY_S", 0.1)
    before = await ProfileRecord.objects.acount()
    with monkeypatch.context() as patch:
        _database_away(patch)
        assert (await client.post("/debug/profile_start", json={"model": UNTRACED, "max_steps": 3})).status_code == 200
        await load(client, model=UNTRACED)
        await asyncio.sleep(1.5)  # stopped by itself; waiting for the database
        assert await ProfileRecord.objects.acount() == before
    for _ in range(300):
        if await ProfileRecord.objects.acount() > before:
            break
        await asyncio.sleep(0.1)
    record = await sync_to_async(ProfileRecord.objects.latest)("id")
    assert record.engine == UNTRACED and record.steps == 3 and record.stopped_by == "max_steps"


async def test_a_profile_armed_for_a_request_starts_and_saves_itself(client: httpx.AsyncClient) -> None:
    before = await ProfileRecord.objects.acount()
    started = await client.post("/debug/profile_start", json={
        "model": UNTRACED, "max_steps": 2, "trigger": {"request_id": "slow-one"}})
    assert started.status_code == 200, started.text
    assert started.json()["status"] == "armed" and started.json()["trigger"] == "request 'slow-one' arriving"
    state = profile_state(registry.get(UNTRACED))
    assert state.armed and not state.running and state.trigger == "request 'slow-one' arriving"
    # A second start while armed is refused, as while running.
    assert_error(await client.post("/debug/profile_start", json={"model": UNTRACED}), 409)
    await load(client, model=UNTRACED, n=2)  # other requests: it stays armed
    await asyncio.sleep(0.6)  # the watcher's look
    assert await ProfileRecord.objects.acount() == before and profile_state(registry.get(UNTRACED)).armed
    body = {"model": UNTRACED, "prompt": "the one", "max_tokens": 8, "debug_config": {"ignore_eos": True}}
    response = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "slow-one"})
    assert response.status_code == 200, response.text
    for _ in range(100):
        if await ProfileRecord.objects.acount() > before:
            break
        await asyncio.sleep(0.1)
    record = await sync_to_async(ProfileRecord.objects.latest)("id")
    assert record.engine == UNTRACED and record.steps == 2 and record.stopped_by == "max_steps"
    assert record.trigger == "request 'slow-one' arriving; fired: request 'slow-one' arrived"


async def test_a_stop_disarms_an_armed_profile_and_bad_triggers_are_400(client: httpx.AsyncClient) -> None:
    assert_error(await client.post("/debug/profile_start", json={"model": UNTRACED, "trigger": {}}), 400)
    assert_error(await client.post("/debug/profile_start",
                                   json={"model": UNTRACED, "trigger": {"step_over_ms": -1}}), 400)
    assert_error(await client.post("/debug/profile_start",
                                   json={"model": UNTRACED, "trigger": {"when": "soon"}}), 400)
    assert_error(await client.post("/debug/profile_start", json={"model": UNTRACED, "delay_steps": -2}), 400)
    started = await client.post("/debug/profile_start", json={"model": UNTRACED, "trigger": {"user": "nobody"}})
    assert started.status_code == 200, started.text
    stopped = await client.post("/debug/profile_stop", json={"model": UNTRACED})
    assert stopped.status_code == 409 and "disarmed" in stopped.text
    assert not profile_state(registry.get(UNTRACED)).armed
    again = await client.post("/debug/profile_start", json={"model": UNTRACED, "max_steps": 1})
    assert again.status_code == 200 and again.json()["status"] == "profiling"
    # Leave the shared engine as found: the profile sees no step, so stopping it saves nothing (409).
    assert_error(await client.post("/debug/profile_stop", json={"model": UNTRACED}), 409)
    assert not profile_state(registry.get(UNTRACED)).running
