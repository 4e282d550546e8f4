"""Metadata writes logged as segment records: the one copy of their values (``meta.py``
reads them there), which an index rebuild (``rebuild.py``) restores.

Each committed MetaStore write (a session manifest, a demotion or quarantine note) is
appended as a ``META`` record, a deletion as a ``META | TOMBSTONE`` record; the index
names the latest one per key (``metarec``), so it stays live through compactions.
Derived records (``kvstore.tiers.base.DERIVED_PREFIXES``: reference counts, retention
marks) are not logged. A record's value starts with a log sequence number ordering the
writes of a key across segments (a compaction's copy may sit in a newer segment than a
later write). Tombstones stay live for good: an older put of their key may still lie,
dead, in some segment. A commit that only deletes may use the medium's reserve; one that
stores a value must leave it (``room_needed``, ``headroom.py``).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator

from kvstore.format.errors import ChunkCorrupt
from kvstore.tiers.base import DERIVED_PREFIXES, Buffer
from kvstore.tiers.disk.headroom import index_growth
from kvstore.tiers.disk.index import EndOp, IndexEntry, MetaOp
from kvstore.tiers.disk.log import SegmentAppender
from kvstore.tiers.disk.segments import META, TOMBSTONE, encode_header, record_size

_LSN = struct.Struct("<Q")
_DERIVED = tuple(prefix.encode() for prefix in DERIVED_PREFIXES)  # not logged


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


def logged_value(value: memoryview) -> bytes:
    """The value a logged write's record value holds (past its sequence number)."""
    if value.nbytes < _LSN.size:
        raise ChunkCorrupt("disk tier: a metadata record is shorter than its sequence number")
    return bytes(value[_LSN.size:])


def room_needed(writes: dict[bytes, bytes | None]) -> int:
    """What a commit of ``writes`` may take on the medium: its log records and the index
    pages and values of its transaction when it stores a logged value, 0 when it only
    deletes (it may use the reserve: deletes free space)."""
    logged = {key: value for key, value in writes.items() if not key.startswith(_DERIVED)}
    if all(value is None for value in logged.values()):
        return 0
    records = sum(record_size(len(key), _LSN.size + len(value or b""))
                  for key, value in logged.items())
    stored = sum(len(key) + len(value or b"") for key, value in writes.items())
    return records + index_growth(len(writes), stored)


async def logged_aside(appender: SegmentAppender, encoded: dict[bytes, bytes | None],
                       logged: list, lsn: int) -> list[tuple]:
    """Enqueue arguments logging ``logged`` (``records``) through a BUILDING ``appender``
    in segments sealed by the same commit: an attached tier's (it has no active one)."""
    entries: dict[bytes, IndexEntry] = {}
    try:
        for key, parts, value_len, checksum in logged:
            seg_id, offset = await appender.append(parts, record_size(len(key), value_len))
            entries[key] = IndexEntry(seg_id, offset, value_len, checksum, 0)
        built = await appender.finish()
    except BaseException:
        await appender.abort()
        raise
    seals = [(EndOp(seg_id, end, True),) for seg_id, end in built.items()]
    return [*seals, (MetaOp(encoded, entries, lsn),)]
