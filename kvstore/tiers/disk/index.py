"""The disk tier's LMDB index: the only record of which bytes of which segment are live.

One LMDB environment, five named databases:

- ``chunks``: key (utf-8) -> IndexEntry (segment id, offset, value length, checksum,
  expiry). An entry is written only after its record's bytes were fsynced.
- ``segments``: segment id (u32 big-endian, so keys sort by id) -> SegmentInfo (state,
  committed end, live record bytes, live value bytes, live record count).
- ``meta``: the MetaStore keys: a logged one (session manifests) with an empty value,
  its bytes being in its record alone; a derived one (reference counts) with its value.
- ``metarec``: meta key -> IndexEntry of the segment record that logs its latest write
  (or deletion); these records count as live bytes of their segment, so compaction
  copies them, but not in the tier's used bytes or items.
- ``state``: counters: next segment id, total live value bytes, total live items, the
  highest metadata log sequence number.

The environment is a cache of the segments: ``rebuild.py`` rebuilds it from them. Opening
it checks it first (``index_check``); damage raises ``IndexCorrupt`` naming the repair.

Every change to ``chunks`` updates the accounting in ``segments`` and ``state`` inside
the same write transaction, so the figures are exact and visible to every process that
opens the directory (the server and an offline compactor). Methods here are
synchronous; the tier runs write transactions in a worker thread.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import lmdb

from kvstore.format.errors import Busy
from kvstore.tiers.disk import index_check
from kvstore.tiers.disk.fs import OS, FileSystem
from kvstore.tiers.disk.index_check import index_corrupt
from kvstore.tiers.disk.segments import record_size

log = logging.getLogger(__name__)

_ENTRY = struct.Struct("<IQIQQ")
_SEGMENT = struct.Struct("<BQQQQ")
_U64 = struct.Struct("<Q")
_SEG_KEY = struct.Struct(">I")


def _u64(txn: lmdb.Transaction, key: bytes, db: lmdb._Database | None = None) -> int:
    """A counter of the state table (set to 0 on open: missing, the index is damaged)."""
    raw = txn.get(key, db=db)
    if raw is None:
        raise struct.error(f"the index lost its {key.decode()} counter")
    value: int = _U64.unpack(raw)[0]
    return value
_NEXT_SEG, _USED, _ITEMS = b"next_segment", b"used_bytes", b"items"
_EPOCH = b"segment_epoch"  # bumped whenever a segment is forgotten
_LSN = b"meta_lsn"  # highest log sequence number of a metadata record committed


class SegState(enum.IntEnum):
    ACTIVE = 1  # the writer appends to it; bytes past the committed end are uncommitted
    SEALED = 2  # immutable; a compaction candidate
    BUILDING = 3  # being filled by a compaction; no index entry names it yet


class IndexEntry(NamedTuple):
    seg_id: int
    offset: int
    value_len: int
    checksum: int
    expires_ms: int  # unix milliseconds; 0 = never

    def pack(self) -> bytes:
        return _ENTRY.pack(*self)

    def expired(self, now: float) -> bool:
        """Past its TTL at ``now`` (wall-clock seconds)."""
        return self.expires_ms != 0 and self.expires_ms <= now * 1000

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> IndexEntry:
        return cls(*_ENTRY.unpack(raw))


@dataclass
class SegmentInfo:
    """Accounting of one segment; ``live_bytes`` counts whole records (header + key +
    value) so ``dead_bytes`` is exactly what a rewrite of the segment would reclaim."""

    seg_id: int
    state: SegState
    file_bytes: int  # committed end: bytes at or past it are not part of the segment
    live_bytes: int = 0
    live_value_bytes: int = 0
    live_records: int = 0

    @property
    def dead_bytes(self) -> int:
        return self.file_bytes - self.live_bytes

    @property
    def dead_fraction(self) -> float:
        return self.dead_bytes / self.file_bytes if self.file_bytes else 0.0

    def pack(self) -> bytes:
        return _SEGMENT.pack(self.state, self.file_bytes, self.live_bytes,
                             self.live_value_bytes, self.live_records)

    @classmethod
    def unpack(cls, seg_id: int, raw: bytes | memoryview) -> SegmentInfo:
        state, end, live, live_values, records = _SEGMENT.unpack(raw)
        return cls(seg_id, SegState(state), end, live, live_values, records)


class PutOp(NamedTuple):
    key: bytes
    entry: IndexEntry


class DeleteOp(NamedTuple):
    key: bytes


class MetaOp(NamedTuple):
    writes: dict[bytes, bytes | None]
    records: dict[bytes, IndexEntry] | None = None  # the segment records logging them
    lsn: int = 0  # their highest log sequence number


class EndOp(NamedTuple):
    """The committed end of a segment moves to ``end``; ``seal`` marks it immutable."""

    seg_id: int
    end: int
    seal: bool


IndexOp = PutOp | DeleteOp | MetaOp | EndOp


class _Accounts:
    """Segment records and totals loaded lazily inside one write transaction."""

    def __init__(self, txn: lmdb.Transaction, index: DiskIndex) -> None:
        self.txn, self.index = txn, index
        self.segments: dict[int, SegmentInfo | None] = {}
        self.used = _u64(txn, _USED, index.state)
        self.items = _u64(txn, _ITEMS, index.state)

    def segment(self, seg_id: int) -> SegmentInfo | None:
        if seg_id not in self.segments:
            raw = self.txn.get(_SEG_KEY.pack(seg_id), db=self.index.segments)
            self.segments[seg_id] = None if raw is None else SegmentInfo.unpack(seg_id, raw)
        return self.segments[seg_id]

    def count(self, key: bytes, entry: IndexEntry, sign: int, totals: bool = True) -> None:
        """``totals`` False: a metadata record (its segment's bytes, not the tier's)."""
        info = self.segment(entry.seg_id)
        if info is None:
            log.error("index entry %r names unknown segment %d", key, entry.seg_id)
        else:
            info.live_bytes += sign * record_size(len(key), entry.value_len)
            info.live_records += sign
        if totals:
            if info is not None:
                info.live_value_bytes += sign * entry.value_len
            self.used += sign * entry.value_len
            self.items += sign

    def save(self) -> None:
        for seg_id, info in self.segments.items():
            if info is not None:
                self.txn.put(_SEG_KEY.pack(seg_id), info.pack(), db=self.index.segments)
        self.txn.put(_USED, _U64.pack(self.used), db=self.index.state)
        self.txn.put(_ITEMS, _U64.pack(self.items), db=self.index.state)


@dataclass(frozen=True)
class SwitchOutcome:
    moved: int
    skipped: int  # entries changed by a writer meanwhile: their copies are dead bytes
    emptied: list[int]  # source segments no index entry names any more (now unnamed)


_OPEN: set[str] = set()  # LMDB forbids opening one environment twice in a process


class DiskIndex:
    def __init__(self, path: Path, *, map_size: int, check: bool = False,
                 report_as: Path | None = None, fs: FileSystem = OS) -> None:
        """``check``: walk the environment in a child process first (an mdb.c assertion
        aborts the process that meets it); any damage found raises ``IndexCorrupt``
        naming ``report_as`` (default ``path``)."""
        path.mkdir(parents=True, exist_ok=True)
        self.fs = fs  # hears of every commit (``write``)
        self._name = str(path.resolve())
        if self._name in _OPEN:
            raise Busy(f"the disk index {path} is already open in this process; share "
                       "that DiskTier instead of opening the directory again")
        if check and (reason := index_check.problem(path)):
            raise index_corrupt(report_as or path, reason)
        try:
            self._open(path, map_size)
        except (lmdb.Error, struct.error, ValueError) as exc:
            if hasattr(self, "env"):
                self.env.close()
            raise index_corrupt(report_as or path, f"{type(exc).__name__}: {exc}") from exc
        _OPEN.add(self._name)

    def _open(self, path: Path, map_size: int) -> None:
        # LMDB's safe mode, on which durability rests: sync=True (a commit fsyncs the data
        # pages), metasync=True (then the meta page), writemap=False (pages reach the file
        # by pwrite, never through a writable map) and map_async=False. A crash then leaves
        # exactly the last committed transaction, which names only fsynced bytes.
        self.env = lmdb.open(str(path), map_size=map_size, max_dbs=5, subdir=True,
                             sync=True, metasync=True, writemap=False, map_async=False)
        with self.write() as txn:
            self.chunks, self.segments, self.meta, self.metarec, self.state = (
                self.env.open_db(name, txn=txn)
                for name in (b"chunks", b"segments", b"meta", b"metarec", b"state"))
            for name in (_NEXT_SEG, _USED, _ITEMS, _EPOCH, _LSN):
                txn.put(name, _U64.pack(0), db=self.state, overwrite=False)
                _u64(txn, name, self.state)  # struct.error when damaged

    def close(self) -> None:
        self.env.close()
        _OPEN.discard(self._name)

    @contextlib.contextmanager
    def write(self, db: lmdb._Database | None = None) -> Iterator[lmdb.Transaction]:
        """One write transaction; the seam hears of it once it committed."""
        with self.env.begin(write=True, db=db) as txn:
            yield txn
        self.fs.commit_index(self.env)

    # reads: short read transactions, safe on the event loop thread

    def lookup(self, key: bytes) -> IndexEntry | None:
        return self.lookup_many((key,))[0]

    def lookup_many(self, keys: Sequence[bytes]) -> list[IndexEntry | None]:
        with self.env.begin(db=self.chunks, buffers=True) as txn:  # one for them all
            return [None if raw is None else IndexEntry.unpack(raw) for raw in map(txn.get, keys)]

    def totals(self) -> tuple[int, int]:
        """(live value bytes, live items) as last committed by any process."""
        with self.env.begin(db=self.state) as txn:
            return _u64(txn, _USED), _u64(txn, _ITEMS)

    def next_segment(self) -> int:
        """The id the next registered segment gets, less one: no segment file may be
        named above it."""
        with self.env.begin(db=self.state) as txn:
            return _u64(txn, _NEXT_SEG)

    def meta_lsn(self) -> int:
        with self.env.begin(db=self.state) as txn:
            return _u64(txn, _LSN)

    def meta_records(self) -> list[tuple[bytes, IndexEntry]]:
        """Every meta key with the entry of its logging record (or tombstone)."""
        with self.env.begin(db=self.metarec) as txn:
            return [(bytes(k), IndexEntry.unpack(v)) for k, v in txn.cursor()]

    def segment_epoch(self) -> int:
        """Changes whenever any process forgets a segment: a cue to drop its handles."""
        with self.env.begin(db=self.state) as txn:
            return _u64(txn, _EPOCH)

    def _bump_epoch(self, txn: lmdb.Transaction) -> None:
        epoch = _u64(txn, _EPOCH, self.state)
        txn.put(_EPOCH, _U64.pack(epoch + 1), db=self.state)

    def segment(self, seg_id: int) -> SegmentInfo | None:
        with self.env.begin(db=self.segments) as txn:
            raw = txn.get(_SEG_KEY.pack(seg_id))
            return None if raw is None else SegmentInfo.unpack(seg_id, raw)

    def all_segments(self) -> list[SegmentInfo]:
        with self.env.begin(db=self.segments) as txn:
            return [SegmentInfo.unpack(_SEG_KEY.unpack(k)[0], v) for k, v in txn.cursor()]

    def entries_after(self, start: bytes | None, limit: int) -> list[tuple[bytes, IndexEntry]]:
        """Up to ``limit`` entries with keys strictly after ``start``, in key order."""
        out: list[tuple[bytes, IndexEntry]] = []
        with self.env.begin(db=self.chunks) as txn:
            cursor = txn.cursor()
            found = cursor.set_range(start) if start is not None else cursor.first()
            while found and len(out) < limit:
                key = cursor.key()
                if key != start:
                    out.append((key, IndexEntry.unpack(cursor.value())))
                found = cursor.next()
        return out

    def live_entries(self, seg_ids: set[int]) -> dict[int, list[tuple[bytes, IndexEntry]]]:
        """Entries naming each of ``seg_ids``, in offset order (one pass over the index)."""
        out: dict[int, list[tuple[bytes, IndexEntry]]] = {seg_id: [] for seg_id in seg_ids}
        with self.env.begin(db=self.chunks) as txn:
            for key, raw in txn.cursor():
                entry = IndexEntry.unpack(raw)
                if entry.seg_id in out:
                    out[entry.seg_id].append((key, entry))
        for entries in out.values():
            entries.sort(key=lambda item: item[1].offset)
        return out

    def live_meta_records(self, seg_ids: set[int]) -> dict[int, list[tuple[bytes, IndexEntry]]]:
        """``live_entries`` for the metadata records (``metarec``)."""
        out: dict[int, list[tuple[bytes, IndexEntry]]] = {seg_id: [] for seg_id in seg_ids}
        for key, entry in self.meta_records():
            if entry.seg_id in out:
                out[entry.seg_id].append((key, entry))
        return out

    def meta_scan(self, prefix: bytes, *, exact: bool = False) -> list[tuple]:
        """(key, value, entry of its record or None) of each meta key starting with
        ``prefix`` (``exact``: that key only); an empty value names its record's bytes."""
        out = []
        with self.env.begin(db=self.meta) as txn:
            cursor = txn.cursor()
            found = cursor.set_key(prefix) if exact else cursor.set_range(prefix)
            while found and cursor.key().startswith(prefix):
                raw = txn.get(cursor.key(), db=self.metarec)
                out.append((cursor.key(), cursor.value(), raw and IndexEntry.unpack(raw)))
                found = not exact and cursor.next()
        return out

    # writes: each one LMDB write transaction

    def register_segment(self, state: SegState) -> int:
        """Allocate the next segment id and name it in the index, before its file exists,
        so a segment file on disk is always either named or safe to remove."""
        with self.write() as txn:
            seg_id = _u64(txn, _NEXT_SEG, self.state) + 1
            txn.put(_NEXT_SEG, _U64.pack(seg_id), db=self.state)
            txn.put(_SEG_KEY.pack(seg_id), SegmentInfo(seg_id, state, 0).pack(),
                    db=self.segments)
        return seg_id

    def apply(self, ops: Iterable[IndexOp]) -> None:
        """Apply a batch of writer operations, in order, in one transaction."""
        with self.write() as txn:
            accounts = _Accounts(txn, self)
            for op in ops:
                if isinstance(op, PutOp):
                    old = txn.get(op.key, db=self.chunks)
                    if old is not None:
                        accounts.count(op.key, IndexEntry.unpack(old), -1)
                    txn.put(op.key, op.entry.pack(), db=self.chunks)
                    accounts.count(op.key, op.entry, +1)
                    self._extend(accounts, op.entry.seg_id,
                                 op.entry.offset + record_size(len(op.key), op.entry.value_len))
                elif isinstance(op, DeleteOp):
                    old = txn.pop(op.key, db=self.chunks)
                    if old is not None:
                        accounts.count(op.key, IndexEntry.unpack(old), -1)
                elif isinstance(op, EndOp):
                    info = self._extend(accounts, op.seg_id, op.end)
                    if op.seal and info is not None:
                        info.state = SegState.SEALED
                else:
                    logged = op.records or {}
                    for key, value in op.writes.items():
                        if value is None:
                            txn.delete(key, db=self.meta)
                        else:  # a logged value is kept once: in its record
                            txn.put(key, b"" if key in logged else value, db=self.meta)
                    self._log_meta(txn, accounts, op)
            accounts.save()

    def _log_meta(self, txn: lmdb.Transaction, accounts: _Accounts, op: MetaOp) -> None:
        for key, entry in (op.records or {}).items():
            old = txn.get(key, db=self.metarec)
            if old is not None:
                accounts.count(key, IndexEntry.unpack(old), -1, totals=False)
            txn.put(key, entry.pack(), db=self.metarec)
            accounts.count(key, entry, +1, totals=False)
            self._extend(accounts, entry.seg_id,
                         entry.offset + record_size(len(key), entry.value_len))
        if op.lsn > _u64(txn, _LSN, self.state):
            txn.put(_LSN, _U64.pack(op.lsn), db=self.state)

    def install(self, next_segment: int, lsn: int) -> None:
        """Set the counters a rebuild derived from the segments it found."""
        with self.write(self.state) as txn:
            txn.put(_NEXT_SEG, _U64.pack(next_segment))
            txn.put(_LSN, _U64.pack(lsn))

    @staticmethod
    def _extend(accounts: _Accounts, seg_id: int, end: int) -> SegmentInfo | None:
        info = accounts.segment(seg_id)
        if info is not None:
            info.file_bytes = max(info.file_bytes, end)
        return info

    def set_segments(self, infos: Iterable[SegmentInfo]) -> None:
        with self.write(self.segments) as txn:
            for info in infos:
                txn.put(_SEG_KEY.pack(info.seg_id), info.pack())

    def drop_segment(self, seg_id: int) -> bool:
        """Forget a segment no entry names; False (and no change) while one still does."""
        with self.write(self.segments) as txn:
            raw = txn.get(_SEG_KEY.pack(seg_id))
            if raw is not None and SegmentInfo.unpack(seg_id, raw).live_records:
                return False
            if txn.delete(_SEG_KEY.pack(seg_id)):
                self._bump_epoch(txn)
            return True

    def switch(self, moves: list[tuple[bytes, IndexEntry, IndexEntry]],
               built: dict[int, int], sources: Iterable[int],
               meta_moves: Iterable[tuple[bytes, IndexEntry, IndexEntry]] = ()
               ) -> SwitchOutcome:
        """Point moved entries (chunks, and ``meta_moves`` of ``metarec``) at their
        copies, seal the ``built`` segments (id -> end), and forget each source segment
        no entry names any more: one transaction.

        A move applies only if the entry still equals the old one (compare and swap),
        so a writer's newer put or delete of the key always wins.
        """
        moved = 0
        with self.write() as txn:
            accounts = _Accounts(txn, self)
            for seg_id, end in built.items():
                info = accounts.segment(seg_id)
                if info is not None:
                    info.state, info.file_bytes = SegState.SEALED, end
            for key, old, new in moves:
                if txn.get(key, db=self.chunks) == old.pack():
                    accounts.count(key, old, -1)
                    txn.put(key, new.pack(), db=self.chunks)
                    accounts.count(key, new, +1)
                    moved += 1
            for key, old, new in meta_moves:
                if txn.get(key, db=self.metarec) == old.pack():
                    accounts.count(key, old, -1, totals=False)
                    txn.put(key, new.pack(), db=self.metarec)
                    accounts.count(key, new, +1, totals=False)
            emptied = []
            for seg_id in sources:
                info = accounts.segment(seg_id)
                if info is not None and info.live_records == 0:
                    del accounts.segments[seg_id]
                    txn.delete(_SEG_KEY.pack(seg_id), db=self.segments)
                    emptied.append(seg_id)
            if emptied:
                self._bump_epoch(txn)
            accounts.save()
        return SwitchOutcome(moved, len(moves) - moved, emptied)

    def rebuild_accounting(self, file_size: Callable[[int], int | None]) -> list[bytes]:  # noqa: C901 - one pass over the entries, each case a state of its segment
        """Recompute every segment's figures and the totals from the entries, dropping
        those whose bytes are gone (segment file missing or too short).

        ``file_size(seg_id)`` gives a segment file's size or None when it is missing; it
        is called inside the write transaction, so no other process commits meanwhile.
        Returns the dropped keys."""
        dropped: list[bytes] = []
        sizes: dict[int, int | None] = {}
        with self.write() as txn:
            infos = {_SEG_KEY.unpack(k)[0]: SegmentInfo.unpack(_SEG_KEY.unpack(k)[0], v)
                     for k, v in txn.cursor(db=self.segments)}
            for info in infos.values():
                info.live_bytes = info.live_value_bytes = info.live_records = 0
            used = items = 0
            for key, raw in txn.cursor(db=self.chunks):
                entry = IndexEntry.unpack(raw)
                found = infos.get(entry.seg_id)
                if entry.seg_id not in sizes:
                    sizes[entry.seg_id] = file_size(entry.seg_id)
                size = record_size(len(key), entry.value_len)
                limit = sizes[entry.seg_id]
                if found is None or limit is None or entry.offset + size > min(
                        limit, found.file_bytes):
                    dropped.append(bytes(key))
                    continue
                found.live_bytes += size
                found.live_value_bytes += entry.value_len
                found.live_records += 1
                used += entry.value_len
                items += 1
            for key in dropped:
                txn.delete(key, db=self.chunks)
            for key, raw in list(txn.cursor(db=self.metarec)):
                entry = IndexEntry.unpack(raw)
                if entry.seg_id not in sizes:
                    sizes[entry.seg_id] = file_size(entry.seg_id)
                found, seg_size = infos.get(entry.seg_id), sizes[entry.seg_id]
                end = entry.offset + record_size(len(key), entry.value_len)
                if found is None or seg_size is None or end > min(seg_size, found.file_bytes):
                    log.error("the record holding meta key %r is gone", key)
                    txn.delete(key, db=self.metarec)
                    if txn.get(key, db=self.meta) == b"":  # the value was that record's
                        txn.delete(key, db=self.meta)
                    continue
                found.live_bytes += record_size(len(key), entry.value_len)
                found.live_records += 1
            for seg_id, info in infos.items():
                txn.put(_SEG_KEY.pack(seg_id), info.pack(), db=self.segments)
            txn.put(_USED, _U64.pack(used), db=self.state)
            txn.put(_ITEMS, _U64.pack(items), db=self.state)
        return dropped
