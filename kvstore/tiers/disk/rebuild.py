"""Rebuilding the disk tier's LMDB index from its segment files (LevelDB's RepairDB).

The segments are the log of record: every chunk record carries its key and checksum,
and every committed MetaStore write but the derived ones (``DERIVED_PREFIXES``) is logged
as a metadata record with a log sequence number (a deletion as a tombstone; see
``metalog.py``). A rebuild, run with no writer on the directory:

1. takes the writer and compaction locks (``Busy`` while a server or compaction runs);
2. reads every segment record by record, skipping damaged stretches (it resumes at the
   next record magic), and keeps per chunk key its last copy, per metadata key the
   write with the highest sequence number;
3. asks ``derive`` for the derived records (it may refuse, changing nothing);
4. moves the old environment aside to ``index.corrupt-<time>`` (never deletes it);
5. builds a new environment: every segment SEALED (the writer starts a fresh one),
   the chunk entries (without TTLs: those lived only in the index), the metadata with
   its log entries, and the derived records.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.tiers.disk.fs import OS, FileSystem
from kvstore.tiers.disk.index import DiskIndex, IndexEntry, MetaOp, PutOp, SegmentInfo, SegState
from kvstore.tiers.disk.lock import COMPACT_LOCK, WRITER_LOCK, DirLock
from kvstore.tiers.disk.segments import (
    HEADER_SIZE,
    MAGIC,
    META,
    TOMBSTONE,
    ScannedRecord,
    scan_records,
    segment_files,
)

_LSN = struct.Struct("<Q")
_BATCH = 4096  # chunk entries per LMDB transaction
_SEEK_BLOCK = 1 << 20


# (logged metadata: key -> value, chunk keys on disk) -> derived records to add
Derive = Callable[[dict[bytes, bytes], set[str]], dict[bytes, bytes]]


@dataclass
class Rebuild:
    path: str
    moved_aside: str | None = None  # where the old environment went
    segments: int = 0
    records: int = 0
    damaged_bytes: int = 0  # bytes of segments that held no valid record
    chunks: int = 0
    meta_keys: int = 0  # logged metadata records kept


@dataclass
class _Found:
    chunks: dict[bytes, tuple[int, ScannedRecord]] = field(default_factory=dict)
    meta: dict[bytes, tuple[int, int, ScannedRecord, bytes | None]] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)  # segment id -> file bytes


def rebuild_index(path: str | Path, *, derive: Derive | None = None,
                  map_size: int = 64 << 30, fs: FileSystem = OS) -> Rebuild:
    """Rebuild the index of the disk tier in ``path`` (the directory holding
    ``segments/`` and ``index/``). Raises ``Busy`` while a writer or compaction holds
    it, and whatever ``derive`` raises (before anything changes)."""
    path = Path(path)
    report = Rebuild(str(path))
    writer = DirLock(path / WRITER_LOCK, "the disk tier's writer lock")
    compact = DirLock(path / COMPACT_LOCK, "the compaction lock")
    writer.acquire()
    try:
        compact.acquire()
        try:
            found = _scan(fs, path / "segments", report)
            logged = {key: payload for key, (_, _, _, payload) in found.meta.items()
                      if payload is not None}
            derived = {} if derive is None else derive(dict(logged), {
                key.decode() for key in found.chunks})
            report.moved_aside = _move_aside(fs, path)
            _build(path / "index", map_size, found, logged, derived)
            report.chunks = len(found.chunks)
            report.meta_keys = len(logged)
        finally:
            compact.release()
    finally:
        writer.release()
    return report


def _move_aside(fs: FileSystem, path: Path) -> str | None:
    index = path / "index"
    if not index.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = path / f"index.corrupt-{stamp}"
    serial = 1
    while target.exists():
        serial += 1
        target = path / f"index.corrupt-{stamp}.{serial}"
    fs.rename(index, target)
    fs.fsync_dir(path)
    return str(target)


def _scan(fs: FileSystem, directory: Path, report: Rebuild) -> _Found:
    found = _Found()
    if not directory.is_dir():
        return found
    for seg_id, seg_path in sorted(segment_files(fs, directory)):
        fd = fs.open(seg_path, os.O_RDONLY)
        try:
            size = fs.size(seg_path) or 0
            found.sizes[seg_id] = size
            for record in _records(fs, fd, size, report):
                report.records += 1
                if record.flags & META:
                    _note_meta(fs, fd, seg_id, record, found)
                else:
                    found.chunks[record.key] = (seg_id, record)  # later copies win
        finally:
            fs.close(fd)
    report.segments = len(found.sizes)
    return found


def _records(fs: FileSystem, fd: int, size: int, report: Rebuild):
    """Every valid record of a segment; a damaged stretch is skipped up to the next
    place where a record checks out."""
    position = 0
    while position + HEADER_SIZE <= size:
        records, end = scan_records(fs, fd, position, size)
        yield from records
        if end + HEADER_SIZE > size:
            report.damaged_bytes += size - end
            return
        following = _next_magic(fs, fd, end + 1, size)
        report.damaged_bytes += (size if following is None else following) - end
        if following is None:
            return
        position = following


def _next_magic(fs: FileSystem, fd: int, start: int, size: int) -> int | None:
    position = start
    while position < size:
        block = memoryview(bytearray(min(_SEEK_BLOCK, size - position)))
        got = fs.read(fd, block, position)
        if got <= 0:
            return None
        at = bytes(block[:got]).find(MAGIC)
        if at >= 0:
            return position + at
        position += max(1, got - len(MAGIC) + 1)
    return None


def _note_meta(fs: FileSystem, fd: int, seg_id: int, record: ScannedRecord,
               found: _Found) -> None:
    value = memoryview(bytearray(record.value_len))
    fs.read(fd, value, record.offset + HEADER_SIZE + len(record.key))
    if record.value_len < _LSN.size:
        return
    (lsn,) = _LSN.unpack_from(value)
    payload = None if record.flags & TOMBSTONE else bytes(value[_LSN.size:])
    old = found.meta.get(record.key)
    if old is None or lsn >= old[0]:
        found.meta[record.key] = (lsn, seg_id, record, payload)


def _entry(seg_id: int, record: ScannedRecord) -> IndexEntry:
    return IndexEntry(seg_id, record.offset, record.value_len, record.checksum, 0)


def _build(index_dir: Path, map_size: int, found: _Found, logged: dict[bytes, bytes],
           derived: dict[bytes, bytes]) -> None:
    index = DiskIndex(index_dir, map_size=map_size)
    try:
        index.set_segments(SegmentInfo(seg_id, SegState.SEALED, size)
                           for seg_id, size in found.sizes.items())
        index.install(max(found.sizes, default=0),
                      max((lsn for lsn, *_ in found.meta.values()), default=0))
        puts = [PutOp(key, _entry(seg_id, record))
                for key, (seg_id, record) in sorted(found.chunks.items())]
        for start in range(0, len(puts), _BATCH):
            index.apply(puts[start:start + _BATCH])
        records = {key: _entry(seg_id, record)
                   for key, (_, seg_id, record, _) in found.meta.items()}
        index.apply([MetaOp({**logged, **derived}, records)])
    finally:
        index.close()
