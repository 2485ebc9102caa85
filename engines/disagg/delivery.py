"""Delivering a prefilled window's K/V to the engine that reserved it.

An engine of this server process (the metadata's ``server`` is ours) gets the block directly,
as a Python object: no bytes are copied on a thread engine, one pickle on a process engine;
between two CUDA engines on threads of this process the block stays on the GPU (``on_device``).
An engine of any other server gets it over HTTP at its own K/V listener (the metadata's
``kv_url``), in the ``kv_wire`` format, with this server's API key (a cluster shares one).
"""
from __future__ import annotations

import asyncio
import logging

import httpx

from engines.protocol import ProtocolError
from engines.protocol.microserving import KVReceiverAddress
from engines.registry import registry
from engines.runtime import AsyncEngine, KVBlock, KVPostError, KVTransferError, post_block

logger = logging.getLogger("engines.disagg")

__all__ = ["RELEASE_PATH", "deliver", "on_device", "release"]

RELEASE_PATH = "/microserving/kv_release"
#: Connect, and each read or write, may take this long; a whole transfer has no overall bound
#: (a large window on a slow link is legitimate), a stalled one ends here.
TRANSFER_TIMEOUT = httpx.Timeout(30.0)


def on_device(sender: AsyncEngine, receiver: KVReceiverAddress) -> bool:
    """Whether ``sender`` can hand the K/V to the receiver as device arrays: the receiver is an
    engine of this process, and both run on threads of it (a process engine's device memory
    does not leave its process) on the CUDA backend (one GPU per server process)."""
    target = registry.get(receiver.engine) if receiver.server == registry.server_id else None
    return (target is not None and not sender.process and not target.process
            and sender.backend_name == target.backend_name == "cuda")


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
    if receiver.kv_url is None:
        raise ProtocolError(400, f"the receiving engine {receiver.engine!r} at {receiver.url} has no K/V listener "
                                 "(its server runs without --enable-debug?): it takes K/V from its own server only")
    try:
        await asyncio.to_thread(post_block, receiver.kv_url, block, registry.options.api_key)
    except KVPostError as exc:
        if exc.status is None:
            raise ProtocolError(502, f"the KV could not be sent to {receiver.kv_url}: {exc}") from None
        status = exc.status if 400 <= exc.status < 500 else 502
        raise ProtocolError(status, f"the receiver at {receiver.url} refused the KV: {exc}") from None
