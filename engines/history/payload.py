"""The stored form of a trace or a profile: its JSON, gzip-compressed, with a checksum of the
stored bytes (the payload of a ``PayloadRecord``). Plain zlib, no Django.

Stored as gzip (not raw deflate or zstd) so that the ``.json.gz`` download is the
column's bytes as they are, and Perfetto opens it directly.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Iterator

# zlib levels 1-3 share the fast deflate strategy; 3 keeps most of level 6's ratio
# on trace JSON in much less time (bench/trace_history.py; docs/perf-log/code-comments.md#gzip-level).
GZIP_LEVEL = 3
_GZIP_WBITS = 31  # 16 + 15: gzip header and trailer around a 32 KiB-window deflate stream
_GZIP_MAGIC = b"\x1f\x8b"
_STREAM_CHUNK = 1 << 20


class PayloadError(Exception):
    """A stored payload cannot be read back; the message says what is wrong and what to do."""


@dataclass(frozen=True, slots=True)
class StoredPayload:
    """A compressed JSON document, ready to store."""

    data: bytes  # gzip bytes
    raw_size: int  # size of the JSON
    crc32: int  # zlib.crc32 of ``data``

    def record_fields(self) -> dict[str, Any]:
        """The ``PayloadRecord`` fields that store it."""
        return {"payload": self.data, "payload_bytes": self.raw_size, "compressed_bytes": len(self.data),
                "payload_crc32": self.crc32}


def compress_json(raw: bytes, level: int = GZIP_LEVEL) -> StoredPayload:
    """Gzip ``raw``; safe to call from a worker thread (zlib releases the GIL)."""
    data = zlib.compress(raw, level, wbits=_GZIP_WBITS)
    return StoredPayload(data=data, raw_size=len(raw), crc32=zlib.crc32(data))


def payload_problem(data: bytes | memoryview | None, *, expected_size: int | None,
                    expected_crc32: int | None, kind: str = "payload") -> str | None:
    """Why the stored bytes are unusable, or ``None`` when they are intact; ``kind`` names the
    payload in the message ("trace", "profile").

    With a recorded checksum this costs one CRC pass over the compressed bytes; an
    older row without one is inflated completely instead.
    """
    if data is None or len(data) == 0:
        return f"No {kind} payload is stored for this record."
    data = bytes(data)
    if data[:2] != _GZIP_MAGIC:
        return f"The stored {kind} payload is not gzip data: it was overwritten or damaged."
    if expected_size is not None and len(data) != expected_size:
        return (f"The stored {kind} payload is {len(data):,} bytes but {expected_size:,} were saved: "
                "it was truncated or overwritten.")
    if expected_crc32 is not None:
        if zlib.crc32(data) != expected_crc32:
            return f"The stored {kind} payload fails its checksum: its bytes were damaged after saving."
        return None
    try:
        for _ in iter_json_chunks(data):
            pass
    except PayloadError as exc:
        return str(exc)
    return None


def iter_json_chunks(data: bytes | memoryview) -> Iterator[bytes]:
    """Inflate the stored gzip bytes piece by piece (for streaming a ``.json`` download)."""
    inflater = zlib.decompressobj(_GZIP_WBITS)
    view = memoryview(data)
    try:
        for start in range(0, len(view), _STREAM_CHUNK):
            piece = inflater.decompress(view[start:start + _STREAM_CHUNK])
            if piece:
                yield piece
        tail = inflater.flush()
    except zlib.error as exc:
        raise PayloadError(f"The stored payload cannot be decompressed ({exc}).") from exc
    if tail:
        yield tail
    if not inflater.eof:
        raise PayloadError("The stored payload ends early: it was truncated.")


def decompress_json(data: bytes | memoryview) -> bytes:
    """The whole JSON document; raises :class:`PayloadError`."""
    return b"".join(iter_json_chunks(data))
