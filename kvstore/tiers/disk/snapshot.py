"""A consistent copy of a disk-tier directory, taken beside its live writer.

Protocol: hold ``compact.lock`` for the whole copy (waiting up to ``wait_s`` for a running
compaction), so no segment is rewritten or retired meanwhile (the writer's own reclaim
skips its rounds while the lock is held); copy the LMDB index first, as one read
transaction's snapshot (``env.copy(compact=True)``); then copy every segment the
snapshot names up to the committed end it names. Sealed segments never change and the
active one only grows past its committed end, whose bytes were fsynced before the index
named them, so the copy holds every byte the copied index names and nothing it does not.
Segment files the snapshot does not name (retired, or past ``next_segment``) are left out.

The snapshot also states what it holds, read from the copy itself (``Holdings``): each
session manifest record's stored value, a digest of the chunk entries' keys, and the
segments copied. A restore checks what it recovered against this
(``services.cli.backup_census``): recovery drops records whose segment is gone, so only a
statement of what was there can tell a lost segment from an empty store.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from kvstore.format.errors import ChunkCorrupt, DataLoss
from kvstore.tiers.disk.index import IndexEntry, SegmentInfo, SegState
from kvstore.tiers.disk.lock import COMPACT_LOCK, DirLock
from kvstore.tiers.disk.metalog import logged_value
from kvstore.tiers.disk.segments import META, check_record, record_size, segment_path

_COPY_BYTES = 8 << 20
_DBS = 5


def keys_digest(keys: list[bytes]) -> str:
    """BLAKE2b of a set of keys, in any order: how a census states a chunk set."""
    hasher = hashlib.blake2b(digest_size=32)
    for key in sorted(keys):
        hasher.update(len(key).to_bytes(2, "little") + key)
    return hasher.hexdigest()


@dataclass
class Holdings:
    """What a snapshot holds, as a restore must find it again."""

    manifests: list[tuple[str, bytes]] = field(default_factory=list)  # (key, stored value)
    chunk_keys: str = ""  # keys_digest of the chunk entries
    segments: list[int] = field(default_factory=list)  # ids of the segments copied


@dataclass
class DiskSnapshot:
    segments: int = 0
    segment_bytes: int = 0
    chunks: int = 0  # entries of the copied index
    manifests: int = 0  # MetaStore records under "manifest/"
    files: list[Path] = field(default_factory=list)  # every file written, under the target
    holdings: Holdings = field(default_factory=Holdings)


def copy_prefix(source: Path, target: Path, length: int | None = None) -> int:
    """Copy the first ``length`` bytes (all: None) of ``source`` to ``target``, fsynced;
    the bytes copied. ``FileNotFoundError`` when ``source`` is gone."""
    with open(source, "rb") as src, open(target, "wb") as dst:
        left = length
        while left is None or left > 0:
            block = src.read(_COPY_BYTES if left is None else min(left, _COPY_BYTES))
            if not block:
                break
            dst.write(block)
            if left is not None:
                left -= len(block)
        dst.flush()
        os.fsync(dst.fileno())
        return dst.tell()


def _hold(lock: DirLock, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not lock.try_acquire():
        if time.monotonic() >= deadline:
            lock.acquire()  # raises Busy naming the holder
            return
        time.sleep(0.05)


@dataclass
class _Snapshot:
    infos: list[SegmentInfo]
    chunk_keys: list[bytes]
    # each manifest key: its value in the index (legacy, else empty) and its record's entry
    manifests: list[tuple[bytes, bytes, IndexEntry | None]]


def _read_snapshot(index_dir: Path) -> _Snapshot:
    """The copied index's segments, chunk keys and manifest records."""
    env = lmdb.open(str(index_dir), max_dbs=_DBS, subdir=True, readonly=True, lock=False)
    prefix = b"manifest/"  # kvstore.session.manifest.MANIFEST_PREFIX
    try:
        with env.begin() as txn:
            segments_db = env.open_db(b"segments", txn=txn, create=False)
            chunks_db = env.open_db(b"chunks", txn=txn, create=False)
            meta_db = env.open_db(b"meta", txn=txn, create=False)
            metarec_db = env.open_db(b"metarec", txn=txn, create=False)
            infos = [SegmentInfo.unpack(int.from_bytes(key, "big"), raw)
                     for key, raw in txn.cursor(db=segments_db)]
            chunk_keys = list(txn.cursor(db=chunks_db).iternext(values=False))
            cursor = txn.cursor(db=meta_db)
            manifests = []
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    raw = txn.get(key, db=metarec_db)
                    manifests.append((key, value, None if raw is None else IndexEntry.unpack(raw)))
        return _Snapshot(infos, chunk_keys, manifests)
    finally:
        env.close()


def _stored_value(segments: Path, key: bytes, value: bytes, entry: IndexEntry | None
                  ) -> bytes:
    """A manifest record's stored value, read from the copied segment and checked."""
    if value or entry is None:  # kept in the index itself (written before records held it)
        return value
    path = segment_path(segments, entry.seg_id)
    try:
        with open(path, "rb") as file:
            file.seek(entry.offset)
            record = file.read(record_size(len(key), entry.value_len))
        return logged_value(check_record(memoryview(record), key, entry.value_len,
                                         entry.checksum, str(path), META))
    except (OSError, ChunkCorrupt) as exc:
        raise DataLoss(f"the record of {key.decode(errors='replace')} in {path} cannot be "
                       f"read: {exc}: the directory is damaged (kvtier repair)") from exc


def snapshot_disk(source: Path, target: Path, *, wait_s: float = 60.0) -> DiskSnapshot:
    """Copy the disk tier at ``source`` (live or not) into the new directory ``target``.

    ``Busy`` when a compaction holds the lock past ``wait_s``."""
    lock = DirLock(source / COMPACT_LOCK, "the compaction lock")
    if not (source / "index" / "data.mdb").is_file():
        raise FileNotFoundError(f"{source} holds no disk index (index/data.mdb)")
    _hold(lock, wait_s)
    try:
        (target / "index").mkdir(parents=True)
        (target / "segments").mkdir()
        env = lmdb.open(str(source / "index"), max_dbs=_DBS, subdir=True, readonly=True)
        try:
            env.copy(str(target / "index"), compact=True)
        finally:
            env.close()
        out = DiskSnapshot(files=[target / "index" / "data.mdb"])
        snap = _read_snapshot(target / "index")
        out.chunks, out.manifests = len(snap.chunk_keys), len(snap.manifests)
        out.holdings.chunk_keys = keys_digest(snap.chunk_keys)
        for info in snap.infos:
            name = segment_path(source / "segments", info.seg_id)
            copy = segment_path(target / "segments", info.seg_id)
            try:
                copied = copy_prefix(name, copy, info.file_bytes)
            except FileNotFoundError:
                if info.state != SegState.BUILDING:
                    raise
                continue  # a killed compaction's leftover: recovery forgets it
            if copied < info.file_bytes and info.state != SegState.BUILDING:
                raise DataLoss(f"segment {name} is {copied} bytes, shorter than the "
                           f"{info.file_bytes} its index names: the directory is damaged "
                           "(kvtier repair)")
            out.segments += 1
            out.segment_bytes += copied
            out.files.append(copy)
            out.holdings.segments.append(info.seg_id)
        out.holdings.manifests = [
            (key.decode(), _stored_value(target / "segments", key, value, entry))
            for key, value, entry in snap.manifests]
        return out
    finally:
        lock.release()
