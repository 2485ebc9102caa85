"""The K/V listener and sender (``kv_http``) and their format (``kv_wire``): a block sent to an
engine's listener lands in its reservation unchanged; every bad transfer is refused with a
clear status and leaves the engine's KV pool where it was; and so in both engine modes."""
from __future__ import annotations

import asyncio
import io
import socket
import threading
import time

import numpy as np
import pytest

from engines.runtime.core.engine import EngineConfig
from engines.runtime.core.disagg.transfer import KVBlock, KVSend, ModelIdentity
from engines.runtime.frontend import messages as m
from engines.runtime.frontend.async_engine import AsyncEngine
from engines.runtime.frontend.engine_core import EngineCore
from engines.runtime.core.disagg.kv_http import KV_TRANSFER_PATH, KVListenSpec, KVPostError, post_block
from engines.runtime.core.disagg.kv_wire import KVWireError, decode_block, encode_block, wire_size
from tests.runtime.demo_engine import consume, prompts, request

KEY = "kv-secret"
CONFIG = EngineConfig(max_num_seqs=4, num_pages=64, prefill_chunk_size=64)


def random_block(identity: ModelIdentity, tokens: int, ticket: str = "t", request_id: str = "r",
                 dtype: str = "float32", seed: int = 0) -> KVBlock:
    rng = np.random.default_rng(seed)
    shape = (identity.num_layers, identity.num_kv_heads, tokens, identity.head_dim)
    return KVBlock(request_id, ticket, 0, tokens, identity, rng.standard_normal(shape).astype(dtype),
                   rng.standard_normal(shape).astype(dtype))


def as_bytes(block: KVBlock) -> bytes:
    return b"".join(bytes(chunk) for chunk in encode_block(block))


# ------------------------------------------------------------------------------ the format


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_block_survives_the_format(demo, dtype):
    ident = ModelIdentity("w" * 32, dtype, 16, 2, 4, 8)
    block = random_block(ident, 21, dtype=dtype)
    raw = as_bytes(block)
    assert len(raw) == wire_size(block)
    got = decode_block(io.BytesIO(raw).readinto, max_bytes=1 << 30)
    assert got == block and got.k.dtype == np.dtype(dtype)


@pytest.mark.parametrize("damage, message", [
    ("magic", "bad magic"), ("version", "version 1 is not supported"),
    ("checksum", "checksum mismatch in V of layer 1"),
    ("short", "the body ends inside"), ("huge", "more than this engine's pool holds"),
])
def test_the_format_says_what_is_wrong(damage, message):
    ident = ModelIdentity("w" * 32, "float32", 16, 2, 4, 8)
    block = random_block(ident, 5)
    raw = bytearray(as_bytes(block))
    max_bytes = 1 << 30
    if damage == "magic":
        raw[0:6] = b"NOTKV!"
    elif damage == "version":
        raw[6:8] = (1).to_bytes(2, "little")
    elif damage == "checksum":
        raw[-20] ^= 0x01  # inside the last layer's V
    elif damage == "short":
        raw = raw[:-100]
    else:
        max_bytes = block.nbytes - 1
    with pytest.raises(KVWireError, match=message) as caught:
        decode_block(io.BytesIO(bytes(raw)).readinto, max_bytes)
    if damage in ("checksum", "short", "huge"):  # the header was read: the reservation is named
        assert (caught.value.request_id, caught.value.ticket) == ("r", "t")


# ----------------------------------------------------------------------- listener and sender


@pytest.fixture(params=["thread", "process"])
def receiver(request, demo):
    engine = AsyncEngine(demo, "demo", CONFIG, backend="cpu", process=request.param == "process",
                         kv_listen=KVListenSpec("127.0.0.1", 0, KEY))
    engine.start()
    yield engine
    engine.shutdown()


def url(engine: AsyncEngine) -> str:
    assert engine.kv_port
    return f"http://127.0.0.1:{engine.kv_port}"


async def pages_used(engine: AsyncEngine) -> float:
    return (await engine.metrics())["kv_pages_used"]


async def test_a_sent_block_is_what_the_receiver_generates_on(receiver, demo, make_engine):
    """A real prefill's K/V over the listener: the receiver's output is one engine's alone."""
    prompt = prompts(demo, 1, length=40, seed=11)[0]
    alone = await consume(receiver, request("alone", prompt, max_tokens=8))
    await receiver.reset()
    receipt = await receiver.prepare_receive("r", prompt, 30)
    prefill = make_engine()
    req = request("r", prompt)
    req.kv_send = KVSend(receipt.prefix_matched_length, 30, receipt.ticket)
    prefill.add_request(req)
    block = None
    while prefill.has_work:
        block = next((o.kv_block for o in prefill.step() if o.kv_block is not None), block)
    await asyncio.to_thread(post_block, url(receiver), block, KEY)
    gen = request("r", prompt, max_tokens=8)
    gen.kv_window_begin = 30
    got = await consume(receiver, gen)
    assert got.tokens == alone.tokens
    assert got.usage["extra"]["prefill_tokens"] == 10


async def refused(receiver: AsyncEngine, block: KVBlock, key: str | None = KEY) -> KVPostError:
    with pytest.raises(KVPostError) as caught:
        await asyncio.to_thread(post_block, url(receiver), block, key)
    return caught.value


async def test_refusals_free_the_reservation(receiver, demo):
    await receiver.reset()
    before = await pages_used(receiver)
    prompt = prompts(demo, 1, length=40, seed=12)[0]
    receipt = await receiver.prepare_receive("a", prompt, 20)
    assert await pages_used(receiver) > before
    info = receipt.identity
    # Another model's K/V: refused by the engine, and the reservation is gone.
    foreign = ModelIdentity(**{**info.as_dict(), "weights": "f" * 32})
    error = await refused(receiver, random_block(foreign, 20, receipt.ticket, "a"))
    assert error.status == 400 and "another model" in str(error)
    assert await pages_used(receiver) == before
    # A damaged body: refused by the listener, the reservation released.
    receipt = await receiver.prepare_receive("b", prompt, 20)
    raw = bytearray(as_bytes(random_block(info, 20, receipt.ticket, "b")))
    raw[-20] ^= 0xFF
    status, message = await asyncio.to_thread(raw_post, receiver.kv_port, bytes(raw))
    assert status == 400 and "checksum mismatch" in message
    assert await pages_used(receiver) == before
    # A sender cut off half way: the reservation is released too.
    receipt = await receiver.prepare_receive("c", prompt, 20)
    raw = as_bytes(random_block(info, 20, receipt.ticket, "c"))
    await asyncio.to_thread(raw_post, receiver.kv_port, raw[:len(raw) // 2], len(raw))
    for _ in range(100):
        if await pages_used(receiver) == before:
            break
        await asyncio.sleep(0.05)
    assert await pages_used(receiver) == before


async def test_the_listener_checks_the_request_before_the_body(receiver):
    ident = ModelIdentity("w" * 32, "float32", 16, 2, 4, 8)
    block = random_block(ident, 4)
    assert (await refused(receiver, block, key="wrong")).status == 401
    assert (await refused(receiver, block, key=None)).status == 401
    assert (await asyncio.to_thread(raw_post, receiver.kv_port, b"x", path="/elsewhere"))[0] == 404
    assert (await asyncio.to_thread(raw_post, receiver.kv_port, b"{}", content_type="application/json"))[0] == 415
    status, message = await asyncio.to_thread(raw_post, receiver.kv_port, as_bytes(block) + b"more")
    assert status == 400 and "goes on after the last layer" in message
    # No reservation named "r": the engine refuses it, after the checksums passed.
    error = await refused(receiver, block)
    assert error.status == 400 and "no KV reservation" in str(error)


def test_an_unreachable_listener_is_a_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    ident = ModelIdentity("w" * 32, "float32", 16, 2, 4, 8)
    with pytest.raises(KVPostError, match="out of reach") as caught:
        post_block(f"http://127.0.0.1:{port}", random_block(ident, 2))
    assert caught.value.status is None


def raw_post(port: int, body: bytes, length: int | None = None, path: str = KV_TRANSFER_PATH,
             content_type: str = "application/octet-stream") -> tuple[int, str]:
    """POST ``body`` by hand (announcing ``length``); the reply's status and message."""
    import orjson

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body) if length is None else length}\r\nAuthorization: Bearer {KEY}\r\n\r\n")
        sock.sendall(head.encode() + body)
        if length is not None and length > len(body):
            sock.shutdown(socket.SHUT_WR)  # cut off: the listener sees the body end early
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    payload = reply.split(b"\r\n\r\n", 1)[1]
    return status, orjson.loads(payload).get("message", "") if payload else ""



# ------------------------------------------------------- the prefill engine's process posts itself


@pytest.fixture(params=["thread", "process"])
def sender(request, demo):
    engine = AsyncEngine(demo, "prefill", CONFIG, backend="cpu", process=request.param == "process")
    engine.start()
    yield engine
    engine.shutdown()


async def test_a_block_for_another_server_goes_from_the_prefill_engine_to_the_listener(sender, demo):
    """``KVSend.post_to``: the block never comes back to the sender's server; the last output
    says it landed, and the receiver generates exactly what it generates alone."""
    receiver = AsyncEngine(demo, "decode", CONFIG, backend="cpu", kv_listen=KVListenSpec("127.0.0.1", 0, KEY))
    receiver.start()
    try:
        prompt = prompts(demo, 1, length=40, seed=21)[0]
        alone = await consume(receiver, request("alone", prompt, max_tokens=8))
        await receiver.reset()
        receipt = await receiver.prepare_receive("r", prompt, 30)
        req = request("r", prompt)
        req.kv_send = KVSend(receipt.prefix_matched_length, 30, receipt.ticket, post_to=url(receiver), api_key=KEY)
        last = None
        async for out in sender.generate(req):
            last = out
        assert last.finished and last.kv_block is None
        delivered = last.kv_delivery
        assert delivered.ok and delivered.status == 200 and delivered.url == url(receiver)
        assert delivered.nbytes > 0 and delivered.finished_ns >= delivered.started_ns
        gen = request("r", prompt, max_tokens=8)
        gen.kv_window_begin = 30
        assert (await consume(receiver, gen)).tokens == alone.tokens
    finally:
        receiver.shutdown()


async def test_a_post_the_receiver_refuses_or_never_answers_is_reported_on_the_last_output(sender, demo):
    receiver = AsyncEngine(demo, "decode", CONFIG, backend="cpu", kv_listen=KVListenSpec("127.0.0.1", 0, KEY))
    receiver.start()
    try:
        prompt = prompts(demo, 1, length=40, seed=22)[0]
        receipt = await receiver.prepare_receive("r", prompt, 30)
        wrong_key = request("r", prompt)
        wrong_key.kv_send = KVSend(0, 30, receipt.ticket, post_to=url(receiver), api_key="not-the-key")
        last = [out async for out in sender.generate(wrong_key)][-1]
        assert not last.kv_delivery.ok and last.kv_delivery.status == 401 and "API key" in last.kv_delivery.error
        with socket.socket() as closed:  # a port nobody listens on
            closed.bind(("127.0.0.1", 0))
            nowhere = f"http://127.0.0.1:{closed.getsockname()[1]}"
        gone = request("r2", prompt)
        gone.kv_send = KVSend(0, 30, "t", post_to=nowhere)
        last = [out async for out in sender.generate(gone)][-1]
        assert last.kv_delivery.status is None and "out of reach" in last.kv_delivery.error
    finally:
        receiver.shutdown()


def test_an_abort_during_the_post_is_confirmed_after_the_last_output(make_engine, demo):
    """The core holds ``Aborted`` back while the block is on its way, so a request that reuses the
    id can never receive the old request's last output."""
    arrived, release = threading.Event(), threading.Event()
    with socket.socket() as listener:  # a receiver that takes its time to answer
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def slow_receiver() -> None:
            conn, _ = listener.accept()
            with conn:
                arrived.set()
                release.wait(10)
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

        threading.Thread(target=slow_receiver, daemon=True).start()
        core = EngineCore(make_engine(), "prefill")
        sent: list[m.CoreMessage] = []
        req = request("r", prompts(demo, 1, length=20, seed=23)[0])
        req.kv_send = KVSend(0, 10, "t", post_to=f"http://127.0.0.1:{listener.getsockname()[1]}")
        core.handle(m.AddRequest(req), sent.append)
        while core.engine.has_work:
            core._send_outputs(core.engine.step(), sent.append)
        assert arrived.wait(10) and sent == []  # the last output waits for the post
        core.handle(m.AbortRequest("r"), sent.append)
        assert sent == []  # nothing to abort any more, and its confirmation waits too
        release.set()
        deadline = time.monotonic() + 10
        while len(sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    outputs, aborted = sent
    assert isinstance(outputs, m.StepOutputs) and outputs.outputs[0].kv_delivery.status == 503
    assert aborted == m.Aborted("r")
