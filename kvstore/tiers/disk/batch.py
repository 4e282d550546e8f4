"""Batched reads of the disk tier: many records in file order, read as one sequential pass.

A session's chunks are appended together, so they mostly lie back to back in one segment.
``get_many`` looks every key up in one index call, orders the records by (segment,
offset) and reads them in one worker thread: the kernel is first told every range the
batch will read (``SegmentFiles.prefetch``: the device gets them all at once), then the
records are read in order in pieces of about ``PIECE_BYTES`` (adjacent records merged
into runs), each piece's records checked (``check_record``, all of a piece at once) as
soon as it is read, while the device fills the next pieces. Per key it answers the value
(a read-only view of its piece's buffer) or the error a ``get`` of it raises; a key it
cannot serve so (missing or expired, a segment retired under it, a read of its piece that
failed or came up short) is answered by ``get`` itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np
import xxhash

from kvstore.format.errors import ChunkCorrupt, KVTierError
from kvstore.tiers.base import Buffer
from kvstore.tiers.disk.index import IndexEntry
from kvstore.tiers.disk.reader import SegmentFiles, SegmentGone
from kvstore.tiers.disk.segments import (
    ADMITTED,
    HASHED_FROM,
    HEADER_SIZE,
    MAGIC,
    META,
    TOMBSTONE,
    check_record,
    key_bytes,
    record_flags,
    record_size,
)

# (index, key, its entry, record size, segment descriptor or None)
Record = tuple[int, bytes, IndexEntry, int, int | None]
log = logging.getLogger(__name__)


async def get_many(files: SegmentFiles, keys: Sequence[str],
                   current: Callable[[Sequence[bytes]], list[IndexEntry | None]],
                   get: Callable[[str], Awaitable[Buffer]], where: Path
                   ) -> tuple[list[Buffer | KVTierError], list[bool]]:
    """(answers, and per key whether its value came from an ``ADMITTED`` record:
    ``admission.py``). ``current``: each key's unexpired entry or None; ``get``: the tier's
    own, for what the batch does not serve; ``where``: the tier's path, for the log."""
    out: list[Buffer | KVTierError | None] = [None] * len(keys)
    proven = [False] * len(keys)
    wanted = []  # (seg_id, offset, index, key bytes, entry)
    kbs = [key_bytes(key) for key in keys]
    for i, (kb, entry) in enumerate(zip(kbs, current(kbs), strict=True)):
        if entry is not None:
            wanted.append((entry.seg_id, entry.offset, i, kb, entry))
    wanted.sort(key=lambda w: (w[0], w[1]))
    segs = {w[0] for w in wanted}
    for seg_id in segs:
        files.pin(seg_id)
    try:
        await _read_batch(files, where, wanted, out, proven)
    finally:
        for seg_id in segs:
            files.unpin(seg_id)
    for i, got in enumerate(out):
        if got is None:
            out[i] = await _get(get, keys[i])
    return out, proven  # type: ignore[return-value]


# A batch is read in pieces of about this many bytes (whole records each), each checked
# as soon as it is read: the device fills the next pieces meanwhile (the batch's ranges
# were prefetched), so what the checks add to a cold read is about one piece's.
PIECE_BYTES = 1 << 19


async def _read_batch(files: SegmentFiles, where: Path, wanted: list, out: list,
                      proven: list[bool]) -> None:
    fds: dict[int, int | None] = {}
    records: list[Record] = []
    for seg_id, _, i, kb, entry in wanted:
        if seg_id not in fds:
            try:
                fds[seg_id] = files.descriptor(seg_id)
            except (SegmentGone, OSError):  # get looks it up again or reports the failure
                fds[seg_id] = None
        if fds[seg_id] is not None:
            records.append((i, kb, entry, record_size(len(kb), entry.value_len), fds[seg_id]))
    if not records:
        return
    pieces = _pieces(records)
    checked = await asyncio.to_thread(_read_pieces, files, where, pieces)
    for piece, values in zip(pieces, checked, strict=True):
        if values is None:  # a failed or short read: each key's get says
            continue
        for (i, *_), value in zip(piece, values, strict=True):
            out[i], proven[i] = (value, False) if isinstance(value, ChunkCorrupt) else value


def _pieces(records: list[Record]) -> list[list[Record]]:
    """``records`` in consecutive groups of about ``PIECE_BYTES`` each."""
    pieces: list[list[Record]] = [[]]
    size = 0
    for record in records:
        if size >= PIECE_BYTES:
            pieces.append([])
            size = 0
        pieces[-1].append(record)
        size += record[3]
    return pieces


def _read_pieces(files: SegmentFiles, where: Path, pieces: list[list]
                 ) -> list[list[tuple[Buffer, bool] | ChunkCorrupt] | None]:
    """Blocking (one worker thread: one thread hop per batch): every range prefetched,
    then each piece read in order and checked; per piece its ``_checked_records``, or
    None when its read failed or came up short."""
    plans = [(_runs(piece), piece) for piece in pieces]
    files.prefetch([run for runs, _ in plans for run in runs])
    checked: list[list | None] = []
    for runs, piece in plans:
        # np.empty, not bytearray: zero-filling first costs as much as the read
        buffer = np.empty(sum(r[3] for r in piece), dtype=np.uint8).data
        try:
            files.read_runs(runs, buffer)
        except (OSError, ChunkCorrupt) as exc:
            log.info("disk tier %s: batched read failed, reading one by one: %s", where, exc)
            checked.append(None)
            continue
        checked.append(_checked_records(buffer, piece, where))
    return checked


def _runs(records: list) -> list[tuple[int, int, int]]:
    """(descriptor, offset, size) of ``records``, merged where they are adjacent."""
    runs: list[tuple[int, int, int]] = []
    for _, _, entry, size, fd in records:
        if runs and runs[-1][0] == fd and runs[-1][1] + runs[-1][2] == entry.offset:
            runs[-1] = (fd, runs[-1][1], runs[-1][2] + size)
        else:
            runs.append((fd, entry.offset, size))
    return runs


# A record header (``segments.HEADER``) as a numpy dtype: a batch's headers in a few calls.
_RECORD = np.dtype([("magic", "S4"), ("checksum", "<u8"), ("key_len", "<u2"), ("flags", "<u2"),
                    ("value_len", "<u4")])
assert _RECORD.itemsize == HEADER_SIZE


def _checked_records(buffer: memoryview, records: list[Record], where: Path
                     ) -> list[tuple[Buffer, bool] | ChunkCorrupt]:
    """Each record of ``buffer`` (back to back, as ``records`` list them) checked as
    ``check_record`` does: its value (a read-only view) and whether it is ``ADMITTED``,
    or the ``ChunkCorrupt`` of ``check_record`` itself for one the batch check refuses."""
    n = len(records)
    sizes = np.fromiter((r[3] for r in records), np.int64, n)
    starts = np.zeros(n, np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    whole = np.frombuffer(buffer, np.uint8)
    heads = whole[starts[:, None] + np.arange(HEADER_SIZE)].view(_RECORD).reshape(n)
    sums = np.fromiter((r[2].checksum for r in records), np.uint64, n)
    hashed = np.fromiter((xxhash.xxh3_64_intdigest(buffer[at + HASHED_FROM:at + size])
                          for at, size in zip(starts.tolist(), sizes.tolist(), strict=True)),
                         np.uint64, n)
    ok = ((heads["magic"] == MAGIC) & ((heads["flags"] & (META | TOMBSTONE)) == 0)
          & (heads["key_len"] == np.fromiter((len(r[1]) for r in records), np.int64, n))
          & (heads["value_len"] == np.fromiter((r[2].value_len for r in records), np.int64, n))
          & (heads["checksum"] == sums) & (hashed == sums)).tolist()
    admitted = ((heads["flags"] & ADMITTED) != 0).tolist()
    view = buffer.toreadonly()
    values: list[tuple[Buffer, bool] | ChunkCorrupt] = []
    for (_, kb, entry, size, _), at, good, sure in zip(records, starts.tolist(), ok, admitted,
                                                    strict=True):
        key_at = at + HEADER_SIZE
        if good and view[key_at:key_at + len(kb)] == kb:
            values.append((view[key_at + len(kb):at + size], sure))
            continue
        record = buffer[at:at + size]
        try:  # refused above: check_record says why
            values.append((check_record(record, kb, entry.value_len, entry.checksum,
                                        f"disk tier, key {kb!r}").toreadonly(),
                           bool(record_flags(record) & ADMITTED)))
        except ChunkCorrupt as exc:
            log.warning("disk tier %s, segment %d @ %d: %s", where, entry.seg_id,
                        entry.offset, exc)
            values.append(exc)
    return values


async def _get(get: Callable[[str], Awaitable[Buffer]], key: str) -> Buffer | KVTierError:
    try:
        return await get(key)
    except KVTierError as exc:
        return exc
