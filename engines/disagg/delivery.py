"""Delivering a prefilled window's K/V to the engine that reserved it.

An engine of this server process (the metadata's ``server`` is ours) gets the block directly,
as a Python object: no bytes are copied on a thread engine, one pickle on a process engine;
between two CUDA engines on threads of this process the block stays on the GPU (``on_device``).
An engine of any other server gets it over HTTP at its own K/V listener (the metadata's
``kv_url``), in the ``kv_wire`` format, with this server's API key (a cluster shares one),
posted by the prefill engine's own process (:func:`send_spec` says where): the K/V never comes
back through this server. :func:`check_delivery` turns that post's outcome into the answer.
"""
from __future__ import annotations

import logging

import httpx

from engines.protocol import ProtocolError
from engines.protocol.microserving import KVReceiverAddress
from engines.registry import registry
from engines.runtime import AsyncEngine, KVBlock, KVDelivery, KVSend, KVTransferError

logger = logging.getLogger("engines.disagg")

__all__ = ["RELEASE_PATH", "check_delivery", "deliver", "on_device", "release", "send_spec"]

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


def send_spec(sender: AsyncEngine, receiver: KVReceiverAddress, begin: int, end: int) -> KVSend:
    """The ``kv_send`` of a ``remote_send`` request: the window, and where the block goes (back
    here for an engine of this server, straight to the listener of another server's engine).
    A :class:`ProtocolError` when the receiver cannot take K/V from another server."""
    if receiver.server == registry.server_id:
        return KVSend(begin, end, receiver.ticket, on_device(sender, receiver))
    if receiver.kv_url is None:
        raise ProtocolError(400, f"the receiving engine {receiver.engine!r} at {receiver.url} has no K/V listener "
                                 "(its server runs without --enable-debug?): it takes K/V from its own server only")
    return KVSend(begin, end, receiver.ticket, post_to=receiver.kv_url, api_key=registry.options.api_key)


async def deliver(block: KVBlock, receiver: KVReceiverAddress) -> None:
    """Hand ``block`` to its receiver, an engine of this server; a :class:`ProtocolError` says
    why it was not taken."""
    engine = registry.get(receiver.engine)
    if engine is None:
        raise ProtocolError(404, f"the receiving engine {receiver.engine!r} is not served here any more")
    try:
        await engine.receive_kv(block)
    except KVTransferError as exc:
        raise ProtocolError(400, str(exc)) from None


def check_delivery(delivery: KVDelivery, receiver: KVReceiverAddress) -> None:
    """Raise the :class:`ProtocolError` a failed post to another server's listener answers: the
    receiver's own 4xx, else 502."""
    if delivery.ok:
        return
    if delivery.status is None:
        raise ProtocolError(502, f"the KV could not be sent to {delivery.url}: {delivery.error}")
    status = delivery.status if 400 <= delivery.status < 500 else 502
    raise ProtocolError(status, f"the receiver at {receiver.url} refused the KV: {delivery.error}")


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
