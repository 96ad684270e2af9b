"""Streaming safetensors: read headers and byte ranges, write shards tensor by tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape and
`data_offsets` relative to the end of the header, plus an optional `__metadata__` string map) padded
with spaces to 8 bytes, then the tensor bytes, contiguous, in header offset order. So a tool that only
needs to know what a checkpoint holds reads a few kilobytes per shard, and a tool that rewrites a few
tensors of a shard can copy every other tensor as a byte range, through one fixed buffer, without ever
holding the shard (or a tensor) in memory.

Standard library only: `sparkfleet checkpoint inspect` runs on the controller with nothing else.

- ``read_header(path)`` validates and returns a ``ShardHeader`` (tensors with absolute file offsets).
- ``read_tensor_bytes(path, info)`` returns one tensor's bytes (for the few tensors a caller rewrites).
- ``write_shard(path, entries)`` writes a shard from ``ShardEntry`` items whose data is either a byte range
  of another file (copied in chunks) or a callable producing the bytes just when they are written; the
  header is written first, so every entry's size must be known up front. It returns the sha256 and size.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

# Bytes per element of every dtype the safetensors format names.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# A header larger than this is not a safetensors header (the format's own reader refuses > 100 MB).
MAX_HEADER_BYTES = 100_000_000
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024


class SafetensorsError(ValueError):
    """A file that is not a well-formed safetensors shard; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorSpec:
    """What a shard's header says of a tensor, read or to write: its name, dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class TensorInfo(TensorSpec):
    """One tensor of a shard: dtype, shape and its absolute byte range in the file."""

    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class ShardHeader:
    """The parsed header of one shard; tensors in file (offset) order."""

    path: Path
    file_size: int
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


def header_length(prefix: bytes, where: str, file_size: int | None = None) -> int:
    """The JSON header's length from a shard's first 8 bytes (checked against the file size when known)."""
    if len(prefix) != 8:
        raise SafetensorsError(f"{where}: {len(prefix)} bytes, too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or (file_size is not None and 8 + length > file_size):
        raise SafetensorsError(
            f"{where}: header length {length} does not fit a {file_size}-byte file; "
            "the file is truncated or not safetensors"
        )
    return length


def parse_header(raw: bytes, where: str, file_size: int | None = None) -> ShardHeader:
    """Parse and validate a JSON header read from `where` (a path, or a URL for range reads).

    With `file_size` the tensor data must end exactly at the end of the file; without it (a remote shard
    read by ranges) only contiguity is checked.
    """
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SafetensorsError(f"{where}: header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise SafetensorsError(f"{where}: header is a {type(header).__name__}, not a JSON object")
    data_start = 8 + len(raw)
    metadata = header.pop("__metadata__", None) or {}
    entries: list[TensorInfo] = []
    for name, info in header.items():
        try:
            dtype = info["dtype"]
            shape = tuple(int(dim) for dim in info["shape"])
            begin, end = (int(offset) for offset in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise SafetensorsError(f"{where}: tensor {name!r} has a malformed header entry {info!r}") from error
        if dtype not in DTYPE_SIZES:
            raise SafetensorsError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}")
        if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise SafetensorsError(
                f"{where}: tensor {name!r} spans {end - begin} bytes, but {dtype} {list(shape)} needs "
                f"{math.prod(shape) * DTYPE_SIZES[dtype]}"
            )
        entries.append(TensorInfo(name, dtype, shape, data_start + begin, data_start + end))
    entries.sort(key=lambda info: (info.start, info.end))
    cursor = data_start
    for info in entries:
        if info.start != cursor:
            raise SafetensorsError(
                f"{where}: tensor {info.name!r} starts at byte {info.start}, expected {cursor} "
                "(tensor data must be contiguous, without holes or overlaps)"
            )
        cursor = info.end
    if file_size is not None and cursor != file_size:
        raise SafetensorsError(
            f"{where}: tensor data ends at byte {cursor} but the file has {file_size} bytes (truncated download?)"
        )
    return ShardHeader(
        Path(where), file_size if file_size is not None else cursor, data_start, dict(metadata),
        {info.name: info for info in entries},
    )  # fmt: skip


def read_header(path: Path) -> ShardHeader:
    """Read and validate a shard's header (a few KB of I/O, whatever the shard's size)."""
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with path.open("rb") as handle:
            length = header_length(handle.read(8), str(path), file_size)
            raw = handle.read(length)
    except OSError as error:
        raise SafetensorsError(f"{path}: cannot read ({error.strerror})") from error
    header = parse_header(raw, str(path), file_size)
    header.path = path
    return header


def read_tensor_bytes(path: Path, info: TensorInfo) -> bytes:
    """One tensor's raw bytes (read with one positioned read; the caller holds just this tensor)."""
    with Path(path).open("rb") as handle:
        handle.seek(info.start)
        data = handle.read(info.nbytes)
    if len(data) != info.nbytes:
        raise SafetensorsError(f"{path}: tensor {info.name!r} is cut short ({len(data)} of {info.nbytes} bytes)")
    return data


@dataclass(frozen=True)
class ByteRange:
    """Data that is a byte range of an existing file (copied, never loaded whole)."""

    path: Path
    start: int
    end: int


@dataclass(frozen=True)
class ShardEntry(TensorSpec):
    """One tensor of a shard to write: its data is a ``ByteRange`` or a callable returning the bytes."""

    data: ByteRange | Callable[[], bytes]

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class WrittenShard:
    path: Path
    size: int
    sha256: str
    tensors: int


def encode_header(entries: Iterable[ShardEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for `entries` written in the given order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for entry in entries:
        if entry.dtype not in DTYPE_SIZES:
            raise SafetensorsError(f"tensor {entry.name!r}: unknown dtype {entry.dtype!r}")
        if entry.name in header:
            raise SafetensorsError(f"tensor {entry.name!r} appears twice in one shard")
        header[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_shard(
    path: Path,
    entries: list[ShardEntry],
    metadata: dict[str, str] | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    hash_output: bool = True,
) -> WrittenShard:
    """Write a shard to `path` (through `path`.partial, renamed when complete).

    Byte ranges are copied through one reusable buffer of `chunk_bytes`; callables are called one at a
    time, as their tensor is reached. Peak memory is the buffer plus the largest callable's result.
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    digest = hashlib.sha256() if hash_output else None
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    size = 0
    with partial.open("wb") as out:

        def emit(data: bytes | memoryview) -> None:
            nonlocal size
            out.write(data)
            if digest is not None:
                digest.update(data)
            size += len(data)

        emit(encode_header(entries, metadata))
        open_sources: dict[Path, object] = {}
        try:
            for entry in entries:
                if isinstance(entry.data, ByteRange):
                    source = entry.data
                    if source.end - source.start != entry.nbytes:
                        raise SafetensorsError(
                            f"tensor {entry.name!r}: source range has {source.end - source.start} bytes, "
                            f"{entry.dtype} {list(entry.shape)} needs {entry.nbytes}"
                        )
                    handle = open_sources.get(source.path)
                    if handle is None:
                        handle = open_sources[source.path] = source.path.open("rb")
                    handle.seek(source.start)  # type: ignore[attr-defined]
                    remaining = entry.nbytes
                    while remaining:
                        got = handle.readinto(view[: min(remaining, chunk_bytes)])  # type: ignore[attr-defined]
                        if not got:
                            raise SafetensorsError(f"{source.path}: ended inside tensor {entry.name!r}")
                        emit(view[:got])
                        remaining -= got
                else:
                    data = entry.data()
                    if len(data) != entry.nbytes:
                        raise SafetensorsError(
                            f"tensor {entry.name!r}: produced {len(data)} bytes, "
                            f"{entry.dtype} {list(entry.shape)} needs {entry.nbytes}"
                        )
                    emit(data)
                    del data
        finally:
            for handle in open_sources.values():
                handle.close()  # type: ignore[attr-defined]
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
    return WrittenShard(path, size, digest.hexdigest() if digest is not None else "", len(entries))


def copy_file(
    source: Path, dest: Path, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, hash_output: bool = True
) -> WrittenShard:
    """Copy a shard byte for byte (one buffer, sha256 on the way), through `dest`.partial."""
    source, dest = Path(source), Path(dest)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256() if hash_output else None
    view = memoryview(bytearray(chunk_bytes))
    size = 0
    with source.open("rb") as reader, partial.open("wb") as out:
        while got := reader.readinto(view):
            out.write(view[:got])
            if digest is not None:
                digest.update(view[:got])
            size += got
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, dest)
    return WrittenShard(dest, size, digest.hexdigest() if digest is not None else "", len(read_header(dest).tensors))
