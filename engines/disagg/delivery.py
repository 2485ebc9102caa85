"""Delivering a prefilled window's K/V to the engine that reserved it.

An engine of this server process (the metadata's ``server`` is ours) gets the block directly,
as a Python object: no bytes are copied on a thread engine, one pickle on a process engine.
Any other server gets it over HTTP, streamed in the ``kv_wire`` format to its
``/microserving/kv_transfer``, with this server's API key (a cluster shares one).
"""
from __future__ import annotations

import logging

import httpx
import orjson

from engines.protocol import ProtocolError
from engines.protocol.kv_wire import encode_block, wire_size
from engines.protocol.microserving import KVReceiverAddress
from engines.registry import registry
from engines.runtime import KVBlock, KVTransferError

logger = logging.getLogger("engines.disagg")

__all__ = ["RELEASE_PATH", "TRANSFER_PATH", "deliver", "release"]

TRANSFER_PATH = "/microserving/kv_transfer"
RELEASE_PATH = "/microserving/kv_release"
#: Connect, and each read or write, may take this long; a whole transfer has no overall bound
#: (a large window on a slow link is legitimate), a stalled one ends here.
TRANSFER_TIMEOUT = httpx.Timeout(30.0)


async def deliver(block: KVBlock, receiver: KVReceiverAddress) -> None:
    """Hand ``block`` to its receiver; a :class:`ProtocolError` says why it was not taken."""
    if receiver.server == registry.server_id:
        engine = registry.get(receiver.engine)
        if engine is None:
            raise ProtocolError(404, f"the receiving engine {receiver.engine!r} is not served here any more")
        try:
            await engine.receive_kv(block)
        except KVTransferError as exc:
            raise ProtocolError(400, str(exc)) from None
        return
    await _post(block, receiver)


async def release(receiver: KVReceiverAddress) -> None:
    """Tell the receiver its K/V will not come (the prefill failed), so its pages are freed now
    rather than at its timeout. Best effort: a receiver out of reach frees them at the timeout."""
    if receiver.server == registry.server_id:
        engine = registry.get(receiver.engine)
        if engine is not None:
            await engine.release_receive(receiver.request_id, receiver.ticket)
        return
    url = receiver.url.rstrip("/") + RELEASE_PATH
    try:
        async with httpx.AsyncClient(timeout=TRANSFER_TIMEOUT) as client:
            await client.post(url, json=receiver.model_dump(), headers=_auth())
    except httpx.HTTPError as exc:
        logger.warning("could not release the KV reservation of %s at %s: %r", receiver.request_id, url, exc)


def _auth() -> dict[str, str]:
    key = registry.options.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _post(block: KVBlock, receiver: KVReceiverAddress) -> None:
    url = receiver.url.rstrip("/") + TRANSFER_PATH
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(wire_size(block)), **_auth()}

    async def body():  # one layer's K or V at a time, never the whole window as one string
        for chunk in encode_block(block):
            yield chunk

    try:
        async with httpx.AsyncClient(timeout=TRANSFER_TIMEOUT) as client:
            reply = await client.post(url, params={"model": receiver.engine}, content=body(), headers=headers)
    except httpx.HTTPError as exc:
        raise ProtocolError(502, f"the KV could not be sent to {url}: {exc!r}") from None
    if reply.status_code == 200:
        return
    try:
        message = orjson.loads(reply.content)["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = reply.text[:300]
    status = reply.status_code if 400 <= reply.status_code < 500 else 502
    raise ProtocolError(status, f"the receiver at {receiver.url} refused the KV: {message}")
