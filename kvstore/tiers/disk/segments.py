"""The disk tier's segment files: record format, verification and tail scanning.

A segment is an append-only file of records laid end to end (LevelDB's log idea, with
the LMDB index in place of the memtable):

    magic "KVR1" | checksum u64 | key_len u16 | flags u16 | value_len u32 | key | value

All integers little-endian; the 20-byte header is followed by the utf-8 key and the
value. ``checksum`` is xxh3_64 of everything after it (key_len .. end of value), so one
hash over one contiguous slice verifies the lengths, the key and the value together.
The key is stored so a record can be checked against the index entry that names it and
so compaction can copy records without consulting anything else.

``flags`` tells chunk records (0) from metadata records (``META``, ``metalog.py``): a
logged MetaStore write's value is a u64 log sequence number then the value bytes, a
deletion a ``META | TOMBSTONE`` record with no value bytes. ``ADMITTED`` marks a chunk
record whose value had the digest its block key states when written (``admission.py``).
The segments are thus the log of record and the LMDB index a cache of them
(``rebuild.py``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvstore.format.errors import ChunkCorrupt, ChunkTruncated, InvalidRequest
from kvstore.tiers.disk.fs import OS, FileSystem

MAGIC = b"KVR1"
HEADER = struct.Struct("<4sQHHI")  # magic, checksum, key_len, flags, value_len
HEADER_SIZE = HEADER.size
HASHED_FROM = 12  # the checksum covers bytes [12:] of a record
_LENGTHS = struct.Struct("<HHI")
# LMDB's default maximum key size; chunk keys are far shorter.
MAX_KEY_BYTES = 511
MAX_VALUE_BYTES = 2**32 - 1
SEGMENT_SUFFIX = ".seg"
META = 1  # record flag: a MetaStore write (see the module docstring)
TOMBSTONE = 2  # with META: the key was deleted
ADMITTED = 4  # a chunk record whose value's digest was checked against its key


def key_bytes(key: object) -> bytes:
    """The utf-8 form of a tier key, or ``InvalidRequest`` when it cannot be one."""
    if not isinstance(key, str) or not key:
        raise InvalidRequest(f"tier keys are non-empty strings, got {key!r}")
    encoded = key.encode("utf-8")
    if len(encoded) > MAX_KEY_BYTES:
        raise InvalidRequest(f"key is {len(encoded)} bytes; the disk tier allows "
                             f"{MAX_KEY_BYTES}")
    return encoded


def value_view(value: object) -> memoryview:
    """A flat byte view of a bytes-like value (no copy), or ``InvalidRequest``."""
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError as exc:
        raise InvalidRequest(f"value must be bytes-like, got {type(value).__name__}") from exc
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise InvalidRequest("value must be a C-contiguous buffer")
        view = view.cast("B")
    if view.nbytes > MAX_VALUE_BYTES:
        raise InvalidRequest(f"value is {view.nbytes} bytes; the disk tier allows "
                             f"{MAX_VALUE_BYTES}")
    return view


def record_size(key_len: int, value_len: int) -> int:
    return HEADER_SIZE + key_len + value_len


def record_checksum(key: bytes, value: memoryview, flags: int = 0) -> int:
    hasher = xxhash.xxh3_64(_LENGTHS.pack(len(key), flags, value.nbytes))
    hasher.update(key)
    hasher.update(value)
    return hasher.intdigest()


def encode_header(key: bytes, value: memoryview, flags: int = 0) -> tuple[bytes, int]:
    """The header for a record of ``key`` and ``value`` and its checksum."""
    checksum = record_checksum(key, value, flags)
    return HEADER.pack(MAGIC, checksum, len(key), flags, value.nbytes), checksum


def check_record(record: memoryview, key: bytes, value_len: int, checksum: int,
                 where: str, kind: int | None = 0) -> memoryview:
    """The value slice of one whole record after checking it against its index entry
    (and that it is a record of ``kind``: 0 a chunk, ``META`` a logged write, None any).

    Raises ``ChunkCorrupt`` on any disagreement: a record that fails here is never
    returned, whatever part of it was damaged.
    """
    if record.nbytes < HEADER_SIZE:
        raise ChunkTruncated(f"{where}: record shorter than its header")
    magic, stored_sum, key_len, flags, stored_len = HEADER.unpack_from(record)
    if magic != MAGIC:
        raise ChunkCorrupt(f"{where}: bad record magic {bytes(magic)!r}")
    if kind is not None and flags & (META | TOMBSTONE) != kind:
        raise ChunkCorrupt(f"{where}: record flags {flags:#x} are not of kind {kind:#x}")
    if key_len != len(key) or stored_len != value_len:
        raise ChunkCorrupt(f"{where}: record lengths ({key_len}, {stored_len}) disagree "
                           f"with the index ({len(key)}, {value_len})")
    if record.nbytes != record_size(key_len, value_len):
        raise ChunkTruncated(f"{where}: record is {record.nbytes} bytes, expected "
                             f"{record_size(key_len, value_len)}")
    if stored_sum != checksum:
        raise ChunkCorrupt(f"{where}: record checksum {stored_sum:#018x} disagrees with "
                           f"the index ({checksum:#018x})")
    if xxhash.xxh3_64_intdigest(record[HASHED_FROM:]) != checksum:
        raise ChunkCorrupt(f"{where}: record bytes fail their xxh3 checksum")
    if record[HEADER_SIZE:HEADER_SIZE + key_len] != key:
        raise ChunkCorrupt(f"{where}: record holds a different key")
    return record[HEADER_SIZE + key_len:]


def record_flags(record: memoryview) -> int:
    """The flags of a record ``check_record`` passed."""
    return HEADER.unpack_from(record)[3]


@dataclass(frozen=True)
class ScannedRecord:
    key: bytes
    offset: int
    value_len: int
    checksum: int
    flags: int = 0

    @property
    def end(self) -> int:
        return self.offset + record_size(len(self.key), self.value_len)


def scan_records(fs: FileSystem, fd: int, start: int, end: int
                 ) -> tuple[list[ScannedRecord], int]:
    """Whole, checksum-valid records in ``[start, end)`` of an open segment.

    Stops at the first record that is cut short or fails its checksum (a torn tail) and
    returns the records before it with the offset where the valid part ends.
    """
    records: list[ScannedRecord] = []
    position = start
    while position + HEADER_SIZE <= end:
        header = memoryview(bytearray(HEADER_SIZE))
        if fs.read(fd, header, position) != HEADER_SIZE:
            break
        magic, checksum, key_len, flags, value_len = HEADER.unpack(header)
        size = record_size(key_len, value_len)
        if magic != MAGIC or position + size > end:
            break
        record = memoryview(bytearray(size))
        if (fs.read(fd, record, position) != size
                or xxhash.xxh3_64_intdigest(record[HASHED_FROM:]) != checksum):
            break
        key = bytes(record[HEADER_SIZE:HEADER_SIZE + key_len])
        records.append(ScannedRecord(key, position, value_len, checksum, flags))
        position += size
    return records, position


def starts_with_record(fs: FileSystem, path: Path) -> bool:
    """Whether the file begins with a whole, checksum-valid record."""
    try:
        fd = fs.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        return bool(scan_records(fs, fd, 0, fs.size(path) or 0)[0])
    finally:
        fs.close(fd)


def segment_path(directory: Path, seg_id: int) -> Path:
    return directory / f"{seg_id:010d}{SEGMENT_SUFFIX}"


def segment_files(fs: FileSystem, directory: Path) -> Iterator[tuple[int, Path]]:
    """(segment id, path) of every segment file in ``directory``."""
    for name in fs.listdir(directory):
        stem = name.removesuffix(SEGMENT_SUFFIX)
        if name.endswith(SEGMENT_SUFFIX) and stem.isdigit():
            yield int(stem), directory / name


def fsync_directory(directory: Path) -> None:
    """Make file creations and removals in ``directory`` durable (outside the tier's
    seam: the scrub's quarantine directory)."""
    OS.fsync_dir(directory)
