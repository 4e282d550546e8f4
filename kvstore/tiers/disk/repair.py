"""Rebuilding the disk tier's LMDB index from its segment files (LevelDB's RepairDB).

The segments are the log of record: every chunk record carries its key and checksum,
and every committed MetaStore write but the reference counts is logged as a metadata
record with a log sequence number (a deletion as a tombstone; see ``segments.py``).
A repair, run with no writer on the directory:

1. takes the writer and compaction locks (``Busy`` while a server or compaction runs);
2. moves the old environment aside to ``index.corrupt-<time>`` (never deletes it);
3. reads every segment record by record, skipping damaged stretches (it resumes at the
   next record magic), and keeps per chunk key its last copy, per metadata key the
   write with the highest sequence number;
4. builds a new environment: every segment SEALED (the writer starts a fresh one),
   the chunk entries (without TTLs: those lived only in the index), the metadata and
   its log entries, and reference counts recounted from the manifests.

On an encrypted data directory the manifests are sealed (``kvstore.encryption.tiers``):
the references are recounted from them opened with the server's keyring. Without the
keys they name, or with a key of their id that does not open them, repair refuses
before changing anything (every chunk would look unreferenced, and compaction would
collect them).

Chunks no manifest names are kept and reported as orphans: compaction collects them.
A session whose chunks are not all on disk is reported as incomplete (they may live
in another tier).
"""

from __future__ import annotations

import os
import struct
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstore.encryption.census import Census
from kvstore.encryption.seal import MAGIC as SEALED_MAGIC
from kvstore.encryption.seal import Keyring
from kvstore.encryption.tiers import RecordSealer
from kvstore.format.errors import ChunkCorrupt, UnsupportedVersion
from kvstore.placement.refcount import REF_PREFIX
from kvstore.session.manifest import MANIFEST_PREFIX, SessionManifest
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


@dataclass
class RepairReport:
    path: str
    moved_aside: str | None = None  # where the old environment went
    segments: int = 0
    records: int = 0
    damaged_bytes: int = 0  # bytes of segments that held no valid record
    chunks: int = 0
    sessions: list[str] = field(default_factory=list)  # tenant/session recovered
    incomplete: list[str] = field(default_factory=list)  # with chunks not on disk
    orphans: list[str] = field(default_factory=list)  # chunk keys no manifest names
    corrupt_manifests: list[str] = field(default_factory=list)
    meta_keys: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Found:
    chunks: dict[bytes, tuple[int, ScannedRecord]] = field(default_factory=dict)
    meta: dict[bytes, tuple[int, int, ScannedRecord, bytes | None]] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)  # segment id -> file bytes


def repair(path: str | Path, *, keyring: Keyring | None = None, map_size: int = 64 << 30,
           fs: FileSystem = OS) -> RepairReport:
    """Rebuild the index of the disk tier in ``path`` (the directory holding
    ``segments/`` and ``index/``). Raises ``Busy`` while a writer or compaction holds it,
    ``InvalidRequest`` (changing nothing) when manifests are sealed under keys
    ``keyring`` (the server's, for an encrypted directory) does not hold or open."""
    started = time.perf_counter()
    path = Path(path)
    report = RepairReport(str(path))
    writer = DirLock(path / WRITER_LOCK, "the disk tier's writer lock")
    compact = DirLock(path / COMPACT_LOCK, "the compaction lock")
    writer.acquire()
    try:
        compact.acquire()
        try:
            found = _scan(fs, path / "segments", report)
            _check_keys(path, found, keyring)
            report.moved_aside = _move_aside(fs, path)
            _build(path / "index", map_size, found, report, keyring)
        finally:
            compact.release()
    finally:
        writer.release()
    report.seconds = time.perf_counter() - started
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


def _scan(fs: FileSystem, directory: Path, report: RepairReport) -> _Found:
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


def _records(fs: FileSystem, fd: int, size: int, report: RepairReport):
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


def _is_manifest(key: bytes) -> bool:
    return key.decode(errors="replace").startswith(MANIFEST_PREFIX)


def _check_keys(path: Path, found: _Found, keyring: Keyring | None) -> None:
    """Refuse a repair whose sealed manifests ``keyring`` does not open (missing, or a
    wrong key of the right id): their references would go uncounted."""
    census = Census(f"the disk tier in {path}")
    for key, (_, _, _, payload) in found.meta.items():
        if payload is not None and _is_manifest(key):
            census.note(key.decode(errors="replace"), payload)
    census.require(keyring, clear_allowed=True)  # a key on a clear directory does no harm


def _open_manifest(name: str, raw: bytes, keyring: Keyring | None) -> SessionManifest:
    """A manifest record as stored, opened first when sealed (as ``SealedMetaStore``)."""
    if keyring is not None and raw.startswith(SEALED_MAGIC):
        raw = RecordSealer(keyring).open(name, raw)
    return SessionManifest.decode(raw)


def _entry(seg_id: int, record: ScannedRecord) -> IndexEntry:
    return IndexEntry(seg_id, record.offset, record.value_len, record.checksum, 0)


def _build(index_dir: Path, map_size: int, found: _Found, report: RepairReport,
           keyring: Keyring | None) -> None:
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
        report.chunks = len(puts)
        writes = {key: payload for key, (_, _, _, payload) in found.meta.items()
                  if payload is not None}
        records = {key: _entry(seg_id, record)
                   for key, (_, seg_id, record, _) in found.meta.items()}
        refs = _sessions(writes, {key.decode() for key in found.chunks}, report, keyring)
        writes.update({f"{REF_PREFIX}{key}".encode(): str(count).encode()
                       for key, count in refs.items()})
        index.apply([MetaOp(writes, records)])
        report.meta_keys = len(writes) - len(refs)
    finally:
        index.close()


def _sessions(writes: dict[bytes, bytes], on_disk: set[str], report: RepairReport,
              keyring: Keyring | None) -> Counter[str]:
    """Reference counts recounted from the manifests, and the report's session lists."""
    refs: Counter[str] = Counter()
    for key, raw in sorted(writes.items()):
        name = key.decode(errors="replace")
        if not name.startswith(MANIFEST_PREFIX):
            continue
        try:
            manifest = _open_manifest(name, raw, keyring)
        except (ChunkCorrupt, UnsupportedVersion):
            report.corrupt_manifests.append(name[len(MANIFEST_PREFIX):])
            continue
        refs.update(manifest.chunk_keys)  # as the ledger counts: one per key named
        session = f"{manifest.tenant}/{manifest.session_id}"
        missing = any(chunk not in on_disk for chunk in manifest.chunk_keys)
        (report.incomplete if missing else report.sessions).append(session)
    report.orphans = sorted(on_disk - set(refs))
    return refs
