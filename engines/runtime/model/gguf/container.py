"""The GGUF container: header, metadata and the tensor directory, read without copying the data.

A GGUF file (llama.cpp's format, version 2 or 3) is a little-endian header (``GGUF``, the
version, the tensor and metadata counts), the metadata as typed key/value pairs, one entry per
tensor (name, dimensions innermost first, ggml type, offset into the data section), then the data
section, aligned to ``general.alignment`` (32 by default). :func:`read_gguf` parses everything but
the data and keeps the file mapped; :meth:`GGUFFile.tensor_bytes` hands out a tensor's bytes as a
zero-copy view of that mapping.

String arrays (a vocabulary, its merges) are the bulk of the metadata: they are read with one
``struct`` call per string, and numeric arrays with one ``numpy.frombuffer`` each.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engines.runtime.model.config import CheckpointError
from engines.runtime.model.quant.quant_types import GGML_TYPES, GGMLType

__all__ = ["GGUF_MAGIC", "GGUFFile", "GGUFTensor", "is_gguf_file", "read_gguf"]

GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# Metadata value types -> (struct format, numpy dtype) for the fixed-size ones.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's directory entry. ``shape`` is in numpy order (outermost first): GGUF lists a
    matrix's dimensions innermost first, so its ``[in, out]`` is a ``(out, in)`` array here."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def num_elements(self) -> int:
        """Elements the tensor holds once dequantized."""
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class GGUFFile:
    """A parsed GGUF file: its metadata, its tensors by name, and the mapping their bytes live in."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    _map: mmap.mmap | None = field(default=None, repr=False)

    def tensor_bytes(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's raw bytes (``uint8``), a read-only view of the mapped file."""
        if self._map is None:
            raise ValueError(f"{self.path} is closed")
        return np.frombuffer(self._map, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)

    def close(self) -> None:
        """Unmap the file (views from :meth:`tensor_bytes` must be dropped first)."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still exports it; the mapping goes with the last one
                pass
            self._map = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    file = Path(path)
    if not file.is_file():
        return False
    with open(file, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_gguf(path: str | Path, *, skip_arrays: frozenset[str] = frozenset()) -> GGUFFile:
    """Parse ``path``'s header, metadata and tensor directory; keep the file mapped for the data.

    ``skip_arrays`` names metadata arrays to step over instead of reading (their value becomes
    their length). Raises :class:`CheckpointError` for anything that is not a whole GGUF file.
    """
    file = Path(path)
    try:
        with open(file, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:  # an empty file cannot be mapped
        raise CheckpointError(f"{file} is empty: not a GGUF file") from None
    except OSError as exc:
        raise CheckpointError(f"{file} cannot be read: {exc}") from None
    try:
        return _parse(file, mapped, skip_arrays)
    except CheckpointError:
        mapped.close()
        raise
    except (struct.error, ValueError, UnicodeDecodeError, IndexError, OverflowError, MemoryError):
        mapped.close()
        raise CheckpointError(f"{file} is truncated or corrupt (its GGUF header does not parse): "
                              "re-download it") from None


class _Cursor:
    """A read position in the mapped file."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.pos = 0
        self.size = len(buffer)

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buffer, self.pos)
        start = self.pos + 8
        if start + length > self.size:
            raise ValueError("string runs past the end of the file")
        self.pos = start + length
        return self.buffer[start:self.pos].decode("utf-8")

    def strings(self, count: int) -> list[str]:
        buffer, pos, unpack = self.buffer, self.pos, struct.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (length,) = unpack("<Q", buffer, pos)
            pos += 8
            # Bytes that are not UTF-8 (a byte-level vocabulary never has them; an SPM one may)
            # are kept as escapes rather than failing the whole file.
            append(buffer[pos:pos + length].decode("utf-8", "surrogateescape"))
            pos += length
        if pos > self.size:
            raise ValueError("string array runs past the end of the file")
        self.pos = pos
        return out

    def value(self, kind: int, key: str, skip_arrays: frozenset[str]) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind = self.take("<I")
            count = self.take("<Q")
            if item_kind in _SCALARS:
                dtype = np.dtype(_SCALARS[item_kind][1])
                nbytes = count * dtype.itemsize
                if self.pos + nbytes > self.size:
                    raise ValueError("array runs past the end of the file")
                array = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += nbytes
                return count if key in skip_arrays else array
            if item_kind == _STRING:
                if key in skip_arrays:
                    for _ in range(count):
                        self.pos += 8 + self.take("<Q")
                    return count
                return self.strings(count)
            if item_kind == _ARRAY:
                return [self.value(_ARRAY, key, skip_arrays) for _ in range(count)]
        raise CheckpointError(f"metadata key {key!r} has value type {kind}, which GGUF does not define")


def _parse(file: Path, mapped: mmap.mmap, skip_arrays: frozenset[str]) -> GGUFFile:
    cur = _Cursor(mapped)
    magic = bytes(mapped[:4])
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{file} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.take("<I")
    if version not in _SUPPORTED_VERSIONS:
        raise CheckpointError(f"{file} is GGUF version {version}; this engine reads versions "
                              f"{', '.join(map(str, _SUPPORTED_VERSIONS))}")
    tensor_count, kv_count = cur.take("<Q"), cur.take("<Q")
    # Each entry takes at least a few bytes: counts beyond the file's size are corruption.
    if tensor_count > cur.size or kv_count > cur.size:
        raise ValueError("counts larger than the file")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"), key, skip_arrays)
    entries: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = cur.string()
        dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
        entries.append((name, dims, cur.take("<I"), cur.take("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{file} has general.alignment {alignment}, not a power of two: corrupt")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_id, offset in entries:
        ggml_type = GGML_TYPES.get(type_id)
        if ggml_type is None:
            raise CheckpointError(f"tensor {name} in {file.name} has ggml type id {type_id}, which this "
                                  "engine does not know")
        shape = tuple(reversed(dims))
        count = int(np.prod(shape, dtype=np.int64))
        if dims and dims[0] % ggml_type.block_elements:
            raise CheckpointError(f"tensor {name} in {file.name}: its rows of {dims[0]} are not whole "
                                  f"{ggml_type.name} blocks of {ggml_type.block_elements}: corrupt")
        nbytes = count // ggml_type.block_elements * ggml_type.block_bytes
        start = data_start + offset
        if start + nbytes > cur.size:
            raise CheckpointError(f"{file} is truncated: tensor {name} ends past the end of the file; "
                                  "re-download it")
        tensors[name] = GGUFTensor(name, shape, ggml_type, start, nbytes)
    return GGUFFile(file, version, metadata, tensors, mapped)
