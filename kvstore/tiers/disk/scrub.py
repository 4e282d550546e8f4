"""Scrub and seal primitives of the disk tier, for the offline compaction job.

- ``drop_if_unchanged``: remove an index entry only if it still equals the one a
  scrub read (compare and delete, one LMDB transaction with the accounting), so a
  writer that put the key again meanwhile keeps its new, intact copy.
- ``raw_record``: the bytes a record occupies, read straight from its segment file
  (best effort, for a quarantine copy of a record that fails its checks).
- ``seal_dead_writer``: when no writer is live, run the writer's recovery and seal the
  segment it would resume, so a compaction can rewrite the last segment too. The next
  writer then starts a new segment. The caller must hold the writer lock.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.tiers.disk.index import DiskIndex, IndexEntry, SegState, _Accounts
from kvstore.tiers.disk.lock import COMPACT_LOCK, DirLock
from kvstore.tiers.disk.reader import SegmentFiles
from kvstore.tiers.disk.recovery import recover
from kvstore.tiers.disk.segments import record_size, segment_path


def drop_if_unchanged(index: DiskIndex, key: str, entry: IndexEntry) -> bool:
    """Delete ``key``'s index entry if it is still ``entry``; True when it was deleted."""
    kb = key.encode()
    with index.write() as txn:
        if txn.get(kb, db=index.chunks) != entry.pack():
            return False
        accounts = _Accounts(txn, index)
        txn.delete(kb, db=index.chunks)
        accounts.count(kb, entry, -1)
        accounts.save()
    return True


def raw_record(files: SegmentFiles, key: str, entry: IndexEntry) -> bytes:
    """Whatever the segment file holds where ``entry``'s record should be."""
    fs = files.fs
    size = record_size(len(key.encode()), entry.value_len)
    try:
        fd = fs.open(segment_path(files.directory, entry.seg_id), os.O_RDONLY)
    except FileNotFoundError:
        return b""
    try:
        buffer = bytearray(size)
        return bytes(buffer[:fs.read(fd, memoryview(buffer), entry.offset)])
    finally:
        fs.close(fd)


def seal_dead_writer(index: DiskIndex, path: Path) -> int | None:
    """Recover like a writer open, then seal the segment appends would resume in, for
    the disk tier in ``path`` whose index is ``index``.

    Call only while holding ``writer.lock`` (no writer is live) and ``compact.lock``.
    Returns the sealed segment id, or None.
    """
    segment_dir = path / "segments"
    # A second lock object on compact.lock: recover() takes it only when it is free, and
    # it is not (this compaction holds it), so recover() leaves BUILDING segments to us.
    report = recover(index, segment_dir, DirLock(path / COMPACT_LOCK, "the compaction lock"))
    if report.active is None:
        return None
    seg_id, end = report.active
    info = index.segment(seg_id)
    if info is None or info.state != SegState.ACTIVE:
        return None
    if end == 0:  # an empty segment: forget it rather than keep an empty sealed one
        if index.drop_segment(seg_id):
            index.fs.unlink(segment_path(segment_dir, seg_id))
        return None
    info.state = SegState.SEALED
    index.set_segments([info])
    return seg_id

