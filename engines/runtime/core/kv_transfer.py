"""Disaggregated serving, the engine's side: a window of one request's K/V leaves one engine
and lands in pages another engine reserved for it (MLC's MicroServing).

Three steps, tied by the request id (the client's ``user``):

1. ``prepare_receive`` on the decode engine: the prompt's cached prefix is matched, pages are
   reserved up to ``end`` and a :class:`KVReceipt` names them (with a fresh ``ticket``, so
   metadata of an earlier reservation of the same id is refused as stale).
2. ``remote_send`` on the prefill engine: a request with :class:`KVSend` prefills
   ``prompt[:end]`` without sampling; its last output carries a :class:`KVBlock` with the K/V
   of ``[begin:end]``, which the server delivers to the receiver (``Engine.receive_kv``).
3. ``start_generation`` on the decode engine: a request with ``kv_window_begin`` adopts the
   filled reservation and generates on it.

A reservation that never gets its K/V, or whose K/V is refused, releases its pages: the pool
returns to where it was. This module holds the data and the checks; the engine drives it.
"""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.runtime.core.request import EngineRequestError

if TYPE_CHECKING:
    from collections.abc import Callable

    from engines.runtime.core.kv_pool import KVCachePool
    from engines.runtime.model.checkpoint import Checkpoint
    from engines.runtime.model.kv_storage import PagedKVCache
    from engines.runtime.telemetry.trace_recorder import TraceRecorder
    from engines.runtime.model.config import ModelConfig

__all__ = [
    "KVBlock",
    "KVReceipt",
    "KVReceiver",
    "KVReservation",
    "KVSend",
    "KVTransferError",
    "ModelIdentity",
    "new_ticket",
    "resolve_window_end",
    "slot_segments",
]


class KVTransferError(EngineRequestError):
    """A disaggregation step the engine refuses (window, ids, metadata, model); nothing was kept."""


@dataclass(frozen=True)
class ModelIdentity:
    """What two engines must share for K/V to move between them: the same weights (a digest),
    the storage dtype and the K/V geometry. The page size is the receiver's business (blocks
    travel per token), but it is part of the identity so that a mismatch is named, not guessed."""

    weights: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, checkpoint: "Checkpoint", config: "ModelConfig", dtype: str, page_size: int) -> "ModelIdentity":
        """The identity of an engine's model (the digest reads a strided sample of each tensor:
        cheap for a large checkpoint, different for any two trained or random ones)."""
        return cls(weights=weights_digest(checkpoint), dtype=dtype, page_size=page_size,
                   num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                   head_dim=config.head_dim)

    def mismatch(self, other: "ModelIdentity") -> str | None:
        """What differs from ``other`` in words, or None when K/V can move between them."""
        for name in ("weights", "dtype", "page_size", "num_layers", "num_kv_heads", "head_dim"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                what = "the model's weights" if name == "weights" else name
                return f"KV from another model: {what} differ ({theirs!r} sent, {mine!r} here)"
        return None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (metadata and the transfer format's header carry them)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def weights_digest(checkpoint: "Checkpoint", sample_bytes: int = 4096) -> str:
    """A 128-bit digest of every tensor's name, shape, dtype and an evenly strided sample."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(checkpoint.weights):
        w = np.asarray(checkpoint.weights[name])
        flat = w.reshape(-1)
        step = max(1, flat.size // max(1, sample_bytes // w.itemsize))
        h.update(f"{name}:{w.shape}:{w.dtype}".encode())
        h.update(np.ascontiguousarray(flat[::step]).tobytes())
    return h.hexdigest()


def resolve_window_end(end: int, prompt_len: int) -> int:
    """A window end as MLC takes it: negative counts from the prompt's end (Python-style).

    The decode side must compute at least the last prompt token itself (it samples from its
    logits), so the end must fall strictly inside the prompt.
    """
    resolved = end + prompt_len if end < 0 else end
    if resolved >= prompt_len:
        raise KVTransferError("Prefill the full input on the remote machine is not supported. "
                              f"(end {end} on a prompt of {prompt_len} tokens; it must be below {prompt_len})")
    if resolved <= 0:
        raise KVTransferError(f"the KV window end {end} leaves nothing to transfer on a prompt of {prompt_len} tokens")
    return resolved


def slot_segments(pages: tuple[int, ...], page_size: int, begin: int, end: int) -> list[tuple[int, int]]:
    """MLC's ``kv_append_metadata`` segments for positions ``[begin:end]``: runs of consecutive
    slot addresses (``page * page_size + slot``) in the receiver's pool, as ``(start, length)``."""
    runs: list[tuple[int, int]] = []
    for pos in range(begin, end):
        addr = pages[pos // page_size] * page_size + pos % page_size
        if runs and runs[-1][0] + runs[-1][1] == addr:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((addr, 1))
    return runs


@dataclass(frozen=True)
class KVReceipt:
    """``prepare_receive``'s answer: where the window ``[prefix_matched_length:end]`` will land.

    ``ticket`` names this reservation (a reused request id gets a new one); ``segments`` are the
    reserved slots in MLC's form, for the metadata.
    """

    request_id: str
    ticket: str
    prompt_length: int
    prefix_matched_length: int
    end: int
    identity: ModelIdentity
    segments: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class KVSend:
    """On a prefill request: compute ``prompt[:end]``, sample nothing, and send the K/V of
    ``[begin:end]`` to the reservation ``ticket`` of the same request id on the receiver."""

    begin: int
    end: int
    ticket: str
    #: Keep the block on the GPU (device arrays): the receiver is an engine of this process on
    #: the same device, so the K/V goes device to device and never through the host.
    on_device: bool = False


@dataclass
class KVBlock:
    """The K/V of positions ``[begin:end]`` of one request, per token (page layouts need not
    match): ``k`` and ``v`` are ``[num_layers, num_kv_heads, end - begin, head_dim]`` in the
    sender's storage dtype; host arrays, or device arrays for a receiver on the same GPU."""

    request_id: str
    ticket: str
    begin: int
    end: int
    identity: ModelIdentity
    k: np.ndarray
    v: np.ndarray

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVBlock):
            return NotImplemented
        return ((self.request_id, self.ticket, self.begin, self.end, self.identity)
                == (other.request_id, other.ticket, other.begin, other.end, other.identity)
                and np.array_equal(self.k, other.k) and np.array_equal(self.v, other.v))

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together."""
        return int(self.k.nbytes + self.v.nbytes)

    def check_shape(self) -> None:
        """Raise :class:`KVTransferError` unless ``k`` and ``v`` fit the window and the identity."""
        ident = self.identity
        shape = (ident.num_layers, ident.num_kv_heads, self.end - self.begin, ident.head_dim)
        for name, arr in (("k", self.k), ("v", self.v)):
            if tuple(arr.shape) != shape:
                raise KVTransferError(f"the KV block's {name} has shape {tuple(arr.shape)}, expected {shape}")
            if str(arr.dtype) != ident.dtype:
                raise KVTransferError(f"the KV block's {name} is {arr.dtype}, expected {ident.dtype}")


@dataclass
class KVReservation:
    """A receive side's reserved window, until a ``start_generation`` adopts it or it expires."""

    receipt: KVReceipt
    prompt: list[int]
    pool_id: tuple[str, str]
    deadline: float
    received: bool = False


def new_ticket() -> str:
    """A reservation's name: unguessable, so only the holder of the metadata can fill it."""
    return secrets.token_hex(8)


class KVReceiver:
    """The receive side's reservations (one per request id), over the engine's pool and K/V
    storage. Engine thread only, like the pool.

    Args:
        kv_pool: the engine's page allocator; a reservation is a pool sequence of its own.
        kv: the engine's K/V storage (``PagedKVCache``), written by ``receive``.
        identity: the engine's :class:`ModelIdentity` (computed when first needed).
        tracer: the engine's event recorder, or None.
    """

    def __init__(self, kv_pool: "KVCachePool", kv: "PagedKVCache", identity: "Callable[[], ModelIdentity]",
                 tracer: "TraceRecorder | None" = None) -> None:
        self.kv_pool = kv_pool
        self.kv = kv
        self._identity = identity
        self.tracer = tracer
        self.reservations: dict[str, KVReservation] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.reservations

    def prepare(self, request_id: str, prompt: list[int], end: int, timeout_s: float, now: float) -> KVReceipt:
        """Match the prompt's cached prefix and reserve pages up to ``end`` (negative: from the
        prompt's end). Raises :class:`KVTransferError` (nothing reserved) when the window is out
        of range or the pool has no room now."""
        if request_id in self.reservations:
            raise KVTransferError(f"request id {request_id!r} already has a KV reservation on this engine; "
                                  "use a new id (the client's user field) for a new request")
        end = resolve_window_end(end, len(prompt))
        pool_id = ("kv receive", request_id)
        admission = self.kv_pool.reserve(pool_id, prompt, end)
        if admission is None:
            raise KVTransferError(f"the KV cache has no room now for the {end} tokens of request {request_id!r}; "
                                  "retry when running requests have finished")
        matched = admission.cached_tokens
        page_size = self.kv_pool.page_size
        segments = slot_segments(self.kv_pool.pages(pool_id), page_size, matched, end) if end > matched else []
        receipt = KVReceipt(request_id=request_id, ticket=new_ticket(), prompt_length=len(prompt),
                            prefix_matched_length=matched, end=end, identity=self._identity(),
                            segments=tuple(segments))
        # A window the prefix cache already covers needs no transfer (the router skips remote_send).
        self.reservations[request_id] = KVReservation(receipt, list(prompt), pool_id, now + timeout_s,
                                                      received=matched >= end)
        if self.tracer is not None:
            self.tracer.add_event(request_id, "prepare receive", {
                "end": end, "prefix_matched_length": matched, "pages": len(self.kv_pool.pages(pool_id))})
        return receipt

    def receive(self, block: KVBlock) -> None:
        """Store an arriving block in its reservation. Refused (:class:`KVTransferError`) when the
        reservation is unknown or stale; a bad block (another model, wrong window or shape, sent
        twice) also releases the reservation, since its request cannot go on."""
        res = self._get(block.request_id, block.ticket)
        try:
            self._check(res, block)
            matched, end = res.receipt.prefix_matched_length, res.receipt.end
            if end > matched:
                skip = matched - block.begin
                self.kv.write_tokens(self.kv_pool.pages(res.pool_id), matched,
                                     block.k[:, :, skip:], block.v[:, :, skip:])
                self.kv_pool.commit(res.pool_id, res.prompt[matched:end])
        except KVTransferError:
            self.release(block.request_id, "refused KV")
            raise
        res.received = True
        if self.tracer is not None:
            self.tracer.add_event(block.request_id, "receive kv", {
                "begin": block.begin, "end": block.end, "bytes": block.nbytes})

    def _check(self, res: KVReservation, block: KVBlock) -> None:
        mismatch = res.receipt.identity.mismatch(block.identity)
        if mismatch:
            raise KVTransferError(mismatch)
        block.check_shape()
        if res.received:
            raise KVTransferError(f"the KV of request {block.request_id!r} was already received")
        if block.end != res.receipt.end:
            raise KVTransferError(f"the KV block ends at {block.end} but the reservation ends at {res.receipt.end}")
        if block.begin > res.receipt.prefix_matched_length:
            raise KVTransferError(
                f"the KV block starts at {block.begin} but this engine holds only [0:"
                f"{res.receipt.prefix_matched_length}] (prefix_matched_length); send from there")

    def adopt(self, request_id: str, prompt: list[int], begin: int, n: int) -> KVReservation:
        """Check that ``start_generation`` may generate on the reservation of ``request_id`` and
        take it out of the table (the caller renames its pool sequence). Nothing changes when it
        raises."""
        res = self.reservations.get(request_id)
        if res is None:
            raise KVTransferError(f"no KV reservation for request {request_id!r} on this engine: it expired, was "
                                  "used already, or prep_recv was never called with this user")
        if not res.received:
            raise KVTransferError(f"the KV of request {request_id!r} has not arrived yet: call remote_send "
                                  "and wait for its answer before start_generate")
        if prompt != res.prompt:
            raise KVTransferError("the prompt differs from the one prep_recv reserved KV for")
        if begin != res.receipt.end:
            raise KVTransferError(f"kv_window_begin must be {res.receipt.end}, the end of the prep_recv window "
                                  f"(got {begin})")
        if n != 1:
            raise KVTransferError(f"n must be 1 with start_generation (got {n}): one sequence takes the received KV")
        del self.reservations[request_id]
        if self.tracer is not None:
            self.tracer.add_event(request_id, "adopt received kv", {"tokens": self.kv_pool.num_computed_tokens(
                res.pool_id)})
        return res

    def release(self, request_id: str, why: str, ticket: str | None = None) -> bool:
        """Drop a reservation and free its pages; False when there is none (or, given a
        ``ticket``, when the reservation is another one)."""
        res = self.reservations.get(request_id)
        if res is None or (ticket is not None and not secrets.compare_digest(res.receipt.ticket, ticket)):
            return False
        del self.reservations[request_id]
        self.kv_pool.free(res.pool_id)
        if self.tracer is not None:
            self.tracer.add_event(request_id, "release kv reservation", {"why": why})
        return True

    def expire(self, now: float) -> list[str]:
        """Release every reservation past its deadline; returns their request ids."""
        late = [rid for rid, res in self.reservations.items() if res.deadline <= now]
        for rid in late:
            self.release(rid, "expired")
        return late

    def clear(self) -> None:
        """Forget every reservation (engine reset; the caller resets the pool)."""
        self.reservations.clear()

    def _get(self, request_id: str, ticket: str) -> KVReservation:
        res = self.reservations.get(request_id)
        if res is None:
            raise KVTransferError(f"no KV reservation for request {request_id!r} on this engine: it expired, was "
                                  "used already, or was never made (stale kv_append_metadata?)")
        if not secrets.compare_digest(res.receipt.ticket, ticket):
            raise KVTransferError(f"stale kv_append_metadata: request {request_id!r} has a newer KV reservation")
        return res
