"""Disaggregated serving's send side on the engine thread: a ``remote_send`` request's window,
checked when the request arrives and copied out of the pages once it is computed."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from engines.runtime.core.disagg.transfer import KVBlock, KVSend, KVTransferError, ModelIdentity, resolve_window_end

if TYPE_CHECKING:
    from engines.runtime.core.kv_pool import KVCachePool
    from engines.runtime.core.request import GenerationRequest, Sequence
    from engines.runtime.model.kv_storage import PagedKVCache

__all__ = ["KVSender", "describe_half"]


class KVSender:
    """Checks ``kv_send`` windows and builds their blocks. Engine thread only, like the pool.

    Args:
        kv: the engine's K/V storage (``PagedKVCache``), read by :meth:`block`.
        kv_pool: the engine's page allocator (a sequence's pages).
        identity: the engine's :class:`ModelIdentity` (computed when first needed).
        on_gpu: the engine computes on the GPU, so a block may stay there (``KVSend.on_device``).
    """

    def __init__(self, kv: "PagedKVCache", kv_pool: "KVCachePool", identity: Callable[[], ModelIdentity],
                 on_gpu: bool) -> None:
        self.kv = kv
        self.kv_pool = kv_pool
        self._identity = identity
        self.on_gpu = on_gpu

    @staticmethod
    def check(request: "GenerationRequest") -> KVSend | None:
        """A ``remote_send`` request's window with its end resolved (MLC forces ``n = 1`` there);
        None for any other request. Raises :class:`KVTransferError` for a window out of range."""
        send = request.kv_send
        if send is None:
            return None
        end = resolve_window_end(send.end, len(request.prompt))
        if not 0 <= send.begin < end:
            raise KVTransferError(f'"begin >= end" is not supported by remote prefill (begin {send.begin}, '
                                  f"end {end} on a prompt of {len(request.prompt)} tokens)")
        return dataclasses.replace(send, end=end)

    def block(self, seq: "Sequence") -> KVBlock:
        """The K/V of ``seq``'s computed window, copied out of its pages (kept on the GPU when
        the receiver shares it)."""
        send = seq.kv_send
        assert send is not None, "a block of a sequence that sends its K/V"
        k, v = self.kv.read_tokens(self.kv_pool.pages(seq.seq_id), send.begin, send.end,
                                   on_device=send.on_device and self.on_gpu)
        return KVBlock(seq.request.request_id, send.ticket, send.begin, send.end, self._identity(), k, v)


def describe_half(request: "GenerationRequest") -> str | None:
    """Which half of a disaggregated request this is, for the dashboard's table (None: not one)."""
    if request.kv_send is not None:
        end = resolve_window_end(request.kv_send.end, len(request.prompt))
        return f"prefill, sent KV [{request.kv_send.begin}:{end}]"
    if request.kv_window_begin is not None:
        return f"decode, KV [0:{request.kv_window_begin}] received"
    return None
