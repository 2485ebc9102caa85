"""Disaggregated serving's data: what a window of K/V is, where it goes, and the checks on it.

The names MLC's MicroServing steps pass between engines and servers (:class:`KVReceipt`,
:class:`KVSend`, :class:`KVBlock`, :class:`KVDelivery`), the model identity both ends must
share, and the window arithmetic. Plain data and pure functions: the receive side
(``receiver``), the send side (``sender``), the wire format (``kv_wire``) and the listener
(``kv_http``) build on them.
"""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.runtime.core.errors import EngineRequestError

if TYPE_CHECKING:
    from engines.runtime.model.checkpoint import Checkpoint
    from engines.runtime.model.config import ModelConfig

__all__ = [
    "KVBlock",
    "KVDelivery",
    "KVReceipt",
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
    #: The receiver's K/V listener (``http://host:port``) when it is an engine of another server:
    #: the engine's own process posts the block there (``kv_http.deliver_block``), and the
    #: request's last output carries a :class:`KVDelivery` instead of the block. None: the block
    #: comes back on the last output, for the server to hand to an engine of its own.
    post_to: str | None = None
    #: The API key the receiver's listener requires (the cluster's), with ``post_to``.
    api_key: str | None = field(default=None, repr=False)


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


@dataclass(frozen=True)
class KVDelivery:
    """How a block posted straight from the engine's process to another server's listener fared
    (``KVSend.post_to``); on the request's last output. Times are ``perf_counter_ns``, the clock
    the server's trace events use too."""

    url: str
    nbytes: int
    started_ns: int
    finished_ns: int
    #: The receiver's HTTP status; None when it never answered (out of reach, cut off, timed out).
    status: int | None
    #: What went wrong, in words (the receiver's message when it refused); None when stored.
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The receiver stored the block."""
        return self.error is None


def new_ticket() -> str:
    """A reservation's name: unguessable, so only the holder of the metadata can fill it."""
    return secrets.token_hex(8)
