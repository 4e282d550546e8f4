"""Metadata writes logged as segment records, so a repair can rebuild them.

Each committed MetaStore write (a session manifest, a demotion or quarantine note) is
appended as a ``META`` record, a deletion as a ``META | TOMBSTONE`` record; the index
names the latest one per key (``metarec``) so it stays live through compactions.
Reference counts are not logged: a repair recounts them from the manifests. Nor are
retention marks (``kvstore.prefix``): each one's deletion would leave a tombstone for
good, and without them the next open still retains every unreferenced chunk, its domain
unknown. A record's
value starts with a log sequence number that orders the writes of a key across
segments (a compaction's copy may sit in a newer segment than a later write).
Tombstones stay live for good (a few dozen bytes each): an older put of their key may
still lie, dead, in some segment.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator

from kvstore.refcount import REF_PREFIX, RETAIN_PREFIX
from kvstore.tiers.base import Buffer
from kvstore.tiers.disk.segments import META, TOMBSTONE, encode_header

_LSN = struct.Struct("<Q")
_DERIVED = (REF_PREFIX.encode(), RETAIN_PREFIX.encode())  # not logged


class SequenceClock:
    """Log sequence numbers: wall-clock nanoseconds, strictly increasing, and above the
    highest one the index holds (so two processes on one directory stay ordered)."""

    def __init__(self, last: int) -> None:
        self.last = last

    def next(self) -> int:
        self.last = max(self.last + 1, time.time_ns())
        return self.last


def records(writes: dict[bytes, bytes | None], lsn: int
            ) -> Iterator[tuple[bytes, list[Buffer], int, int]]:
    """(key, record parts, value length, checksum) of each write to log."""
    for key, value in writes.items():
        if key.startswith(_DERIVED):
            continue
        payload = _LSN.pack(lsn) + (b"" if value is None else value)
        flags = META | (TOMBSTONE if value is None else 0)
        header, checksum = encode_header(key, memoryview(payload), flags)
        yield key, [header, key, payload], len(payload), checksum
