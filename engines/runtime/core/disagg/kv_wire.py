"""The KV transfer format between two server processes (the body of a K/V listener's POST).

Version 2, little-endian::

    b"KVXFER" u16 version | u32 header length | header (JSON)
    then per layer: K of the layer | u64 XXH3-64 of it | V of the layer | u64 XXH3-64 of it

The header names the receiver's reservation (request id, ticket), the window, the model
identity the K/V belongs to, the dtype and the block's shape ``[layers, kv_heads, tokens,
head_dim]``. One layer's K (or V) is one chunk: the sender hands out views of its arrays
(nothing is copied into a body) and the receiver reads each chunk straight into the block's
arrays, so neither holds the body as one byte string. A damaged chunk fails its checksum and
the whole transfer is refused. XXH3 (version 1 used CRC-32) runs at tens of GB/s, so the
checksums cost the transfer next to nothing.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Iterator

import numpy as np
import orjson
import xxhash

from engines.runtime.core.disagg.transfer import KVBlock, ModelIdentity

__all__ = ["KV_WIRE_VERSION", "KVWireError", "decode_block", "encode_block", "wire_size"]

KV_WIRE_VERSION = 2
_MAGIC = b"KVXFER"
_PREFIX = struct.Struct("<6sHI")
_SUM = struct.Struct("<Q")
_MAX_HEADER = 64 * 1024
_DTYPES = ("float32", "float16")

#: ``readinto(view)``: fills a prefix of ``view``, returns how many bytes (0 only at the end).
ReadInto = Callable[[memoryview], int]


class KVWireError(ValueError):
    """A transfer body that is not a valid version-2 block; the message says what is wrong.
    ``request_id`` and ``ticket`` are set once the header was read (the receiver then releases
    that reservation: its K/V will not come)."""

    def __init__(self, message: str, request_id: str | None = None, ticket: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.ticket = ticket


def checksum(chunk: memoryview | bytes) -> int:
    """The checksum the format stores after each chunk."""
    return xxhash.xxh3_64_intdigest(chunk)


def encode_block(block: KVBlock) -> Iterator[bytes | memoryview]:
    """The body, in chunks: the prefix and header, then each layer's K and V (views of the
    block's arrays where they are contiguous and little-endian already) with their checksums."""
    yield _head(block)
    for layer in range(block.k.shape[0]):
        for arr in (block.k, block.v):
            chunk = np.ascontiguousarray(arr[layer], dtype=arr.dtype.newbyteorder("<")).data.cast("B")
            yield chunk
            yield _SUM.pack(checksum(chunk))


def wire_size(block: KVBlock) -> int:
    """Bytes ``encode_block`` yields in all (the Content-Length)."""
    return len(_head(block)) + block.nbytes + 2 * block.k.shape[0] * _SUM.size


def _head(block: KVBlock) -> bytes:
    header = orjson.dumps({
        "request_id": block.request_id, "ticket": block.ticket, "begin": block.begin, "end": block.end,
        "identity": block.identity.as_dict(), "dtype": str(block.k.dtype), "shape": list(block.k.shape),
    })
    return _PREFIX.pack(_MAGIC, KV_WIRE_VERSION, len(header)) + header


def decode_block(readinto: ReadInto, max_bytes: int) -> KVBlock:
    """Read one block through ``readinto`` (the rest of the body: a socket's ``recv_into``).

    ``max_bytes`` bounds the K/V a header may announce (the receiver's own pool is the natural
    bound), so a hostile header cannot make the receiver allocate without limit. The caller
    checks that nothing follows the last layer (it knows the body's length).
    """
    magic, version, header_len = _PREFIX.unpack(_read_exactly(readinto, _PREFIX.size, "the prefix"))
    if magic != _MAGIC:
        raise KVWireError("not a KV transfer body (bad magic)")
    if version != KV_WIRE_VERSION:
        raise KVWireError(f"KV transfer format version {version} is not supported (this server reads "
                          f"version {KV_WIRE_VERSION})")
    if header_len > _MAX_HEADER:
        raise KVWireError(f"the header announces {header_len} bytes, more than {_MAX_HEADER}")
    try:
        header = orjson.loads(_read_exactly(readinto, header_len, "the header"))
        identity = ModelIdentity(**header["identity"])
        shape = tuple(int(x) for x in header["shape"])
        dtype = header["dtype"]
        request_id, ticket = str(header["request_id"]), str(header["ticket"])
        begin, end = int(header["begin"]), int(header["end"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise KVWireError(f"the header is not valid: {exc!r}") from None
    try:
        return _read_arrays(readinto, request_id, ticket, begin, end, identity, dtype, shape, max_bytes)
    except KVWireError as exc:
        raise KVWireError(str(exc), request_id, ticket) from None


def _read_arrays(readinto: ReadInto, request_id: str, ticket: str, begin: int, end: int,
                 identity: ModelIdentity, dtype: str, shape: tuple[int, ...], max_bytes: int) -> KVBlock:
    if dtype not in _DTYPES or len(shape) != 4 or min(shape) < 0:
        raise KVWireError(f"the header announces K/V of dtype {dtype!r} and shape {shape}")
    wire_dtype = np.dtype(dtype).newbyteorder("<")
    total = 2 * int(np.prod(shape, dtype=np.int64)) * wire_dtype.itemsize
    if total > max_bytes:
        raise KVWireError(f"the block announces {total} bytes of K/V, more than this engine's pool holds "
                          f"({max_bytes})")
    k, v = np.empty(shape, dtype=wire_dtype), np.empty(shape, dtype=wire_dtype)
    for layer in range(shape[0]):
        for name, arr in (("K", k), ("V", v)):
            chunk = memoryview(arr[layer]).cast("B")
            _fill(readinto, chunk, f"{name} of layer {layer}")
            (expected,) = _SUM.unpack(_read_exactly(readinto, _SUM.size, f"the checksum of {name} of layer {layer}"))
            if checksum(chunk) != expected:
                raise KVWireError(f"checksum mismatch in {name} of layer {layer}: the K/V was damaged in transit")
    native = np.dtype(dtype)
    if wire_dtype != native:  # a big-endian host: the engine computes in its native order
        k, v = k.astype(native), v.astype(native)
    return KVBlock(request_id, ticket, begin, end, identity, k, v)


def _fill(readinto: ReadInto, view: memoryview, what: str) -> None:
    got, n = 0, len(view)
    while got < n:
        part = readinto(view[got:])
        if not part:
            raise KVWireError(f"the body ends inside {what} ({got} of {n} bytes)")
        got += part


def _read_exactly(readinto: ReadInto, n: int, what: str) -> bytes:
    buf = bytearray(n)
    _fill(readinto, memoryview(buf), what)
    return bytes(buf)

