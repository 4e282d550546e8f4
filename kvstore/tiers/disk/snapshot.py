"""A consistent copy of a disk-tier directory, taken beside its live writer.

Protocol: hold ``compact.lock`` for the whole copy (waiting up to ``wait_s`` for a running
compaction), so no segment is rewritten or retired meanwhile (the writer's own reclaim
skips its rounds while the lock is held); copy the LMDB index first, as one read
transaction's snapshot (``env.copy(compact=True)``); then copy every segment the
snapshot names up to the committed end it names. Sealed segments never change and the
active one only grows past its committed end, whose bytes were fsynced before the index
named them, so the copy holds every byte the copied index names and nothing it does not.
Segment files the snapshot does not name (retired, or past ``next_segment``) are left out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from kvstore.format.errors import DataLoss
from kvstore.tiers.disk.index import SegmentInfo, SegState
from kvstore.tiers.disk.lock import COMPACT_LOCK, DirLock
from kvstore.tiers.disk.segments import segment_path

_COPY_BYTES = 8 << 20
_DBS = 5


@dataclass
class DiskSnapshot:
    segments: int = 0
    segment_bytes: int = 0
    chunks: int = 0  # entries of the copied index
    manifests: int = 0  # MetaStore records under "manifest/"
    files: list[Path] = field(default_factory=list)  # every file written, under the target


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


def _read_snapshot(index_dir: Path) -> tuple[list[SegmentInfo], int, int]:
    """The copied index's segments, chunk entries and manifest records."""
    env = lmdb.open(str(index_dir), max_dbs=_DBS, subdir=True, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            segments_db = env.open_db(b"segments", txn=txn, create=False)
            chunks_db = env.open_db(b"chunks", txn=txn, create=False)
            meta_db = env.open_db(b"meta", txn=txn, create=False)
            infos = [SegmentInfo.unpack(int.from_bytes(key, "big"), raw)
                     for key, raw in txn.cursor(db=segments_db)]
            chunks = txn.stat(chunks_db)["entries"]
            cursor = txn.cursor(db=meta_db)
            manifests = 0
            if cursor.set_range(b"manifest/"):
                for key in cursor.iternext(values=False):
                    if not key.startswith(b"manifest/"):
                        break
                    manifests += 1
        return infos, chunks, manifests
    finally:
        env.close()


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
        infos, out.chunks, out.manifests = _read_snapshot(target / "index")
        for info in infos:
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
        return out
    finally:
        lock.release()
