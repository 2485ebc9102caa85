"""The KV transfer format between two server processes (``POST /microserving/kv_transfer``).

Version 1, little-endian::

    b"KVXFER" u16 version | u32 header length | header (JSON)
    then per layer: K of the layer | u32 CRC-32 of it | V of the layer | u32 CRC-32 of it

The header names the receiver's reservation (request id, ticket), the window, the model
identity the K/V belongs to, the dtype and the block's shape ``[layers, kv_heads, tokens,
head_dim]``. One layer's K (or V) is one chunk: the sender yields chunk by chunk and the
receiver reads chunk by chunk into the block's arrays, so neither holds the whole body as one
byte string. A damaged chunk fails its CRC and the whole transfer is refused.
"""
from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import orjson

from engines.runtime import KVBlock, ModelIdentity

__all__ = ["KV_WIRE_VERSION", "KVWireError", "decode_block", "encode_block", "wire_size"]

KV_WIRE_VERSION = 1
_MAGIC = b"KVXFER"
_PREFIX = struct.Struct("<6sHI")
_CRC = struct.Struct("<I")
_MAX_HEADER = 64 * 1024
_DTYPES = ("float32", "float16")


class KVWireError(ValueError):
    """A transfer body that is not a valid version-1 block; the message says what is wrong.
    ``request_id`` and ``ticket`` are set once the header was read (the receiver then releases
    that reservation: its K/V will not come)."""

    def __init__(self, message: str, request_id: str | None = None, ticket: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.ticket = ticket


def encode_block(block: KVBlock) -> Iterator[bytes]:
    """The body, in chunks: the prefix and header, then each layer's K and V with their CRCs."""
    yield _head(block)
    for layer in range(block.k.shape[0]):
        for arr in (block.k, block.v):
            chunk = np.ascontiguousarray(arr[layer]).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
            yield chunk + _CRC.pack(zlib.crc32(chunk))


def wire_size(block: KVBlock) -> int:
    """Bytes ``encode_block`` yields in all (the Content-Length)."""
    return len(_head(block)) + block.nbytes + 2 * block.k.shape[0] * _CRC.size


def _head(block: KVBlock) -> bytes:
    header = orjson.dumps({
        "request_id": block.request_id, "ticket": block.ticket, "begin": block.begin, "end": block.end,
        "identity": block.identity.as_dict(), "dtype": str(block.k.dtype), "shape": list(block.k.shape),
    })
    return _PREFIX.pack(_MAGIC, KV_WIRE_VERSION, len(header)) + header


def decode_block(read: Callable[[int], bytes], max_bytes: int) -> KVBlock:
    """Read one block through ``read(n)`` (a file's read: fewer bytes only at the end).

    ``max_bytes`` bounds the K/V a header may announce (the receiver's own pool is the natural
    bound), so a hostile header cannot make the receiver allocate without limit.
    """
    magic, version, header_len = _PREFIX.unpack(_read_exactly(read, _PREFIX.size, "the prefix"))
    if magic != _MAGIC:
        raise KVWireError("not a KV transfer body (bad magic)")
    if version != KV_WIRE_VERSION:
        raise KVWireError(f"KV transfer format version {version} is not supported (this server reads "
                          f"version {KV_WIRE_VERSION})")
    if header_len > _MAX_HEADER:
        raise KVWireError(f"the header announces {header_len} bytes, more than {_MAX_HEADER}")
    try:
        header = orjson.loads(_read_exactly(read, header_len, "the header"))
        identity = ModelIdentity(**header["identity"])
        shape = tuple(int(x) for x in header["shape"])
        dtype = header["dtype"]
        request_id, ticket = str(header["request_id"]), str(header["ticket"])
        begin, end = int(header["begin"]), int(header["end"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise KVWireError(f"the header is not valid: {exc!r}") from None
    try:
        return _read_arrays(read, request_id, ticket, begin, end, identity, dtype, shape, max_bytes)
    except KVWireError as exc:
        raise KVWireError(str(exc), request_id, ticket) from None


def _read_arrays(read: Callable[[int], bytes], request_id: str, ticket: str, begin: int, end: int,
                 identity: ModelIdentity, dtype: str, shape: tuple[int, ...], max_bytes: int) -> KVBlock:
    if dtype not in _DTYPES or len(shape) != 4 or min(shape) < 0:
        raise KVWireError(f"the header announces K/V of dtype {dtype!r} and shape {shape}")
    itemsize = np.dtype(dtype).itemsize
    total = 2 * int(np.prod(shape, dtype=np.int64)) * itemsize
    if total > max_bytes:
        raise KVWireError(f"the block announces {total} bytes of K/V, more than this engine's pool holds "
                          f"({max_bytes})")
    k, v = np.empty(shape, dtype=dtype), np.empty(shape, dtype=dtype)
    layer_bytes = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    wire_dtype = np.dtype(dtype).newbyteorder("<")
    for layer in range(shape[0]):
        for name, arr in (("K", k), ("V", v)):
            chunk = _read_exactly(read, layer_bytes, f"{name} of layer {layer}")
            (crc,) = _CRC.unpack(_read_exactly(read, _CRC.size, f"the checksum of {name} of layer {layer}"))
            if zlib.crc32(chunk) != crc:
                raise KVWireError(f"checksum mismatch in {name} of layer {layer}: the K/V was damaged in transit")
            arr[layer] = np.frombuffer(chunk, dtype=wire_dtype).reshape(shape[1:])
    if read(1):
        raise KVWireError("the body goes on after the last layer")
    return KVBlock(request_id, ticket, begin, end, identity, k, v)


def _read_exactly(read: Callable[[int], bytes], n: int, what: str) -> bytes:
    parts, left = [], n
    while left:
        part = read(left)
        if not part:
            raise KVWireError(f"the body ends inside {what} ({n - left} of {n} bytes)")
        parts.append(part)
        left -= len(part)
    return b"".join(parts) if len(parts) != 1 else parts[0]
