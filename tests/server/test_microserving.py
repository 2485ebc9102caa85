"""MicroServing in one server process: ``demo`` prefills, ``demo-untraced`` (the same checkpoint)
decodes, the K/V goes from one engine to the other directly. Output must be what one engine
gives alone; every refusal must leave the decode engine's KV pool as it was."""
from __future__ import annotations

import base64
import itertools

import httpx
import numpy as np
import pytest

from engines.protocol.microserving import KVAppendMetadata
from engines.registry import registry
from engines.runtime import KVBlock, ModelIdentity, encode_block
from engines.runtime.core.disagg.kv_http import KV_TRANSFER_PATH
from tests.server.conftest import TRACED, UNTRACED, assert_error, sse_payloads

PREFILL, DECODE = TRACED, UNTRACED
PROMPT = list(range(300, 340))  # 40 plain tokens
_ids = itertools.count()


def new_user() -> str:
    return f"ms-{next(_ids)}"


def body(user: str, model: str = DECODE, prompt=PROMPT, **extra) -> dict:
    return {"model": model, "prompt": prompt, "user": user, "max_tokens": 10, "temperature": 0, **extra}


async def kv_pages_used(name: str = DECODE) -> float:
    return (await registry.get(name).metrics())["kv_pages_used"]


async def disaggregated(http: httpx.AsyncClient, user: str, end: int, stream: bool = False,
                        prompt=PROMPT, headers: dict[str, str] | None = None) -> httpx.Response:
    prep = await http.post("/microserving/prep_recv", json=body(user, prompt=prompt, end=end), headers=headers)
    assert prep.status_code == 200, prep.text
    reply = prep.json()
    metadata, matched = reply["kv_append_metadata"], reply["prefix_matched_length"]
    resolved = end % len(prompt)
    if matched < resolved:
        send = await http.post("/microserving/remote_send", json=body(
            user, PREFILL, prompt=prompt, begin=matched, end=end, kv_addr_info=metadata, recv_rank=0),
            headers=headers)
        assert send.status_code == 200 and send.json() == {}, send.text
    return await http.post("/microserving/start_generate", json=body(user, prompt=prompt, begin=resolved,
                                                                     stream=stream), headers=headers)


async def single_engine(http: httpx.AsyncClient, prompt=PROMPT) -> str:
    reply = await http.post("/v1/completions", json=body(new_user(), PREFILL, prompt=prompt))
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.parametrize("end", [1, 16, 23, 39, -1, -17])
async def test_disaggregated_output_is_the_single_engines(client, end):
    await registry.get(DECODE).reset()
    alone = await single_engine(client)
    reply = await disaggregated(client, new_user(), end)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == alone
    assert reply.json()["usage"]["completion_tokens"] == 10
    assert await kv_pages_used(DECODE) == 0 and await kv_pages_used(PREFILL) == 0


async def test_streaming_and_a_prefix_hit_on_the_decode_side(client):
    await registry.get(DECODE).reset()
    alone = await single_engine(client)
    first = await disaggregated(client, new_user(), -1)
    assert first.status_code == 200
    user = new_user()
    prep = await client.post("/microserving/prep_recv", json=body(user, end=-1))
    assert prep.json()["prefix_matched_length"] == 32  # the first request's two full pages
    reply = await disaggregated(client, new_user(), -1, stream=True)
    events = sse_payloads(reply.text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == alone


async def test_a_router_s_x_request_id_goes_on_both_halves_requests(client, monkeypatch):
    """What a router sends (its client's X-Request-Id) is each engine request's client id (the live
    row's), beside the ``user`` the engines run it under; each call's reply echoes it."""
    seen: dict[str, list[str | None]] = {}
    for name in (PREFILL, DECODE):
        engine = registry.get(name)

        def spy(request, _name=name, _generate=engine.generate):
            seen.setdefault(_name, []).append(request.client_request_id)
            return _generate(request)

        monkeypatch.setattr(engine, "generate", spy)
    user = new_user()
    reply = await disaggregated(client, user, -1, headers={"X-Request-Id": "req_7f3a"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "req_7f3a"
    assert reply.json()["id"] == user
    assert seen == {PREFILL: ["req_7f3a"], DECODE: ["req_7f3a"]}


async def test_metadata_names_the_receiver_and_keeps_mlcs_segments(client):
    await registry.get(DECODE).reset()
    user = new_user()
    prep = await client.post("/microserving/prep_recv", json=body(user, end=30))
    metadata = KVAppendMetadata.decode(prep.json()["kv_append_metadata"])
    assert metadata.receiver.request_id == user and metadata.receiver.engine == DECODE
    assert metadata.receiver.server == registry.server_id
    num_segments = metadata.segments[0]
    assert len(metadata.segments) == 1 + 2 * num_segments
    assert prep.json()["prefix_matched_length"] == 0 and sum(metadata.segments[2::2]) == 30
    assert metadata.identity["num_layers"] >= 1
    await registry.get(DECODE).release_receive(user)


async def test_routes_need_enable_debug_and_unknown_ones_answer_json(serve):
    async with serve(enable_debug=False) as http:
        assert_error(await http.post("/microserving/prep_recv", json=body("x", end=3)), 404)
    async with serve(enable_debug=True) as http:
        assert_error(await http.post("/microserving/nothing", json={}), 404)
        assert_error(await http.get("/microserving/prep_recv"), 405)


@pytest.mark.parametrize("case", ["bad window", "begin >= end", "stale metadata", "another user", "bare mlc array",
                                  "no user", "start before send", "unknown request"])
async def test_bad_calls_are_4xx_and_free_the_reserved_pages(client, case):
    await registry.get(DECODE).reset()
    before = await kv_pages_used()
    user = new_user()
    if case == "bad window":
        reply = await client.post("/microserving/prep_recv", json=body(user, end=40))
        assert_error(reply, 400)
        assert "Prefill the full input on the remote machine is not supported." in reply.json()["message"]
    elif case == "no user":
        b = body(user, end=3)
        del b["user"]
        assert_error(await client.post("/microserving/prep_recv", json=b), 400)
    elif case == "unknown request":
        assert_error(await client.post("/microserving/start_generate", json=body(user, begin=30)), 400)
    else:
        prep = await client.post("/microserving/prep_recv", json=body(user, end=30))
        metadata = prep.json()["kv_append_metadata"]
        assert await kv_pages_used() > before
        send = body(user, PREFILL, begin=0, end=30, kv_addr_info=metadata)
        if case == "begin >= end":
            send["begin"] = 30
        elif case == "stale metadata":
            await registry.get(DECODE).release_receive(user)
            fresh = await client.post("/microserving/prep_recv", json=body(user, end=30))
            assert fresh.status_code == 200
        elif case == "another user":
            send["user"] = new_user()
        elif case == "bare mlc array":
            send["kv_addr_info"] = base64.b64encode(b"[1, 0, 30]").decode()
        if case == "start before send":
            reply = await client.post("/microserving/start_generate", json=body(user, begin=30))
            assert "has not arrived" in assert_error(reply, 400)["message"]
            await registry.get(DECODE).release_receive(user)
        else:
            reply = await client.post("/microserving/remote_send", json=send)
            message = assert_error(reply, 400)["message"]
            assert {"begin >= end": "begin >= end", "stale metadata": "stale", "another user": "was made for request",
                    "bare mlc array": "names no receiver"}[case] in message
            if case in ("stale metadata", "another user", "bare mlc array"):
                await registry.get(DECODE).release_receive(user)
    assert await kv_pages_used() == before


async def test_kv_from_another_server_goes_through_the_engines_listener(client):
    """The metadata names the decode engine's K/V listener; a prefill server that is not this
    one (here: the metadata claims another server id) sends there over HTTP, same output."""
    await registry.get(DECODE).reset()
    alone = await single_engine(client)
    user = new_user()
    prep = await client.post("/microserving/prep_recv", json=body(user, end=30))
    metadata = KVAppendMetadata.decode(prep.json()["kv_append_metadata"])
    assert metadata.receiver.kv_url == f"http://127.0.0.1:{registry.get(DECODE).kv_port}"
    elsewhere = metadata.model_copy(update={"receiver": metadata.receiver.model_copy(update={"server": "elsewhere"})})
    send = await client.post("/microserving/remote_send", json=body(
        user, PREFILL, begin=0, end=30, kv_addr_info=elsewhere.encode(), recv_rank=0))
    assert send.status_code == 200 and send.json() == {}, send.text
    reply = await client.post("/microserving/start_generate", json=body(user, begin=30))
    assert reply.json()["choices"][0]["text"] == alone


async def test_a_damaged_or_foreign_transfer_is_refused_and_frees_the_pages(client):
    await registry.get(DECODE).reset()
    before = await kv_pages_used()
    for damage in ("checksum", "identity"):
        user = new_user()
        prep = await client.post("/microserving/prep_recv", json=body(user, end=20))
        metadata = KVAppendMetadata.decode(prep.json()["kv_append_metadata"])
        identity = ModelIdentity(**metadata.identity)
        if damage == "identity":
            identity = ModelIdentity(**{**metadata.identity, "weights": "f" * 32})
        shape = (identity.num_layers, identity.num_kv_heads, 20, identity.head_dim)
        block = KVBlock(user, metadata.receiver.ticket, 0, 20, identity, np.zeros(shape, np.float32),
                        np.zeros(shape, np.float32))
        raw = bytearray(b"".join(bytes(chunk) for chunk in encode_block(block)))
        if damage == "checksum":
            raw[-20] ^= 0xFF
        async with httpx.AsyncClient() as http:
            reply = await http.post(metadata.receiver.kv_url + KV_TRANSFER_PATH, content=bytes(raw),
                                    headers={"Content-Type": "application/octet-stream"})
        message = assert_error(reply, 400)["message"]
        assert ("checksum mismatch" if damage == "checksum" else "another model") in message
        assert await kv_pages_used() == before
    async with httpx.AsyncClient() as http:
        reply = await http.post(metadata.receiver.kv_url + KV_TRANSFER_PATH, content=b"{}",
                                headers={"Content-Type": "application/json"})
    assert_error(reply, 415)


def test_the_kv_stays_on_the_gpu_only_between_cuda_engines_on_threads_of_this_process(monkeypatch):
    """``on_device``: both engines CUDA, both on threads of this server process; anything else
    (a process engine, a CPU engine, another server) goes through the host."""
    from types import SimpleNamespace

    from engines.disagg.delivery import on_device
    from engines.protocol.microserving import KVReceiverAddress

    def eng(backend: str = "cuda", process: bool = False) -> SimpleNamespace:
        return SimpleNamespace(backend_name=backend, process=process)

    here = KVReceiverAddress(url="http://x/", server=registry.server_id, engine="decode", request_id="r", ticket="t")
    elsewhere = here.model_copy(update={"server": "another"})
    for receiver_engine, sender, address, expected in [
        (eng(), eng(), here, True),
        (eng(), eng(), elsewhere, False),
        (eng(process=True), eng(), here, False),
        (eng(), eng(process=True), here, False),
        (eng("cpu"), eng(), here, False),
        (eng(), eng("cpu"), here, False),
    ]:
        monkeypatch.setattr(registry, "get", lambda name, target=receiver_engine: target if name == "decode" else None)
        assert on_device(sender, address) is expected
