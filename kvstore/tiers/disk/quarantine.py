"""What a scrub's quarantine needs of the disk tier.

- ``drop_if_unchanged``: remove an index entry only if it still equals the one a
  scrub read (compare and delete, one LMDB transaction with the accounting), so a
  writer that put the key again meanwhile keeps its new, intact copy.
- ``raw_record``: the bytes a record occupies, read straight from its segment file
  (best effort, for a quarantine copy of a record that fails its checks).
"""

from __future__ import annotations

import os

from kvstore.tiers.disk.index import DiskIndex, IndexEntry, _Accounts
from kvstore.tiers.disk.reader import SegmentFiles
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
