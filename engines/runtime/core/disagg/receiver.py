"""Disaggregated serving's receive side: pages reserved for K/V another engine computes.

A reservation is made by ``prepare_receive`` (the prompt's cached prefix matched, pages reserved
up to the window's end), filled by an arriving :class:`KVBlock`, and taken by the
``start_generation`` request that generates on it; one that never gets its K/V, or whose K/V is
refused, releases its pages, and the pool returns to where it was.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engines.runtime.core.disagg.transfer import (
    KVBlock,
    KVReceipt,
    KVTransferError,
    ModelIdentity,
    new_ticket,
    resolve_window_end,
    slot_segments,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from engines.runtime.core.kv_pool import KVCachePool
    from engines.runtime.model.kv_storage import PagedKVCache
    from engines.runtime.telemetry.trace_recorder import TraceRecorder

__all__ = ["KVReceiver", "KVReservation"]


@dataclass
class KVReservation:
    """A receive side's reserved window, until a ``start_generation`` adopts it or it expires."""

    receipt: KVReceipt
    prompt: list[int]
    pool_id: tuple[str, str]
    deadline: float
    received: bool = False
    #: ``time.perf_counter()`` when it was made (the live table's age).
    reserved_at: float | None = None


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
                                                      received=matched >= end, reserved_at=time.perf_counter())
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
