"""Batched reads of the disk tier: many records in file order, one buffer, one thread call.

A session's chunks are appended together, so they mostly lie back to back in one segment.
``get_many`` looks every key up, orders the records by (segment, offset), merges adjacent
ones into runs, and in one worker thread reads the runs into one preallocated buffer and
checks every record (``check_record``), so neither the reads nor the checksums wait on the
event loop. Per key it answers the value (a read-only view of that buffer) or the error a
``get`` of it raises; a key it cannot serve so (missing or expired, a segment retired under
it, a read that failed or came up short) is answered by ``get`` itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np

from kvstore.format.errors import ChunkCorrupt, KVTierError
from kvstore.tiers.base import Buffer
from kvstore.tiers.disk.index import IndexEntry
from kvstore.tiers.disk.reader import SegmentFiles, SegmentGone
from kvstore.tiers.disk.segments import (
    ADMITTED,
    check_record,
    key_bytes,
    record_flags,
    record_size,
)

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


async def _read_batch(files: SegmentFiles, where: Path, wanted: list, out: list,
                      proven: list[bool]) -> None:
    fds, runs, records = {}, [], []  # runs: (fd, offset, size); records: (index, kb, entry)
    for seg_id, offset, i, kb, entry in wanted:
        if seg_id not in fds:
            try:
                fds[seg_id] = files.descriptor(seg_id)
            except (SegmentGone, OSError):  # get looks it up again or reports the failure
                fds[seg_id] = None
        fd, size = fds[seg_id], record_size(len(kb), entry.value_len)
        if fd is None:
            continue
        if runs and runs[-1][0] == fd and runs[-1][1] + runs[-1][2] == offset:
            runs[-1] = (fd, runs[-1][1], runs[-1][2] + size)
        else:
            runs.append((fd, offset, size))
        records.append((i, kb, entry, size))
    if not records:
        return
    # np.empty, not bytearray: zero-filling first costs as much as the read
    buffer = memoryview(np.empty(sum(size for *_, size in records), dtype=np.uint8))

    def read_and_check() -> list[tuple[Buffer, bool] | KVTierError]:
        files.read_runs(runs, buffer)
        values, at = [], 0
        for _, kb, entry, size in records:
            record = buffer[at:at + size]
            try:
                values.append((check_record(record, kb, entry.value_len, entry.checksum,
                                            f"disk tier, key {kb!r}").toreadonly(),
                               bool(record_flags(record) & ADMITTED)))
            except ChunkCorrupt as exc:
                log.warning("disk tier %s, segment %d @ %d: %s", where, entry.seg_id,
                            entry.offset, exc)
                values.append(exc)
            at += size
        return values

    try:
        values = await asyncio.to_thread(read_and_check)
    except (OSError, ChunkCorrupt) as exc:  # a failed or short read: each key's get says
        log.info("disk tier %s: batched read failed, reading one by one: %s", where, exc)
        return
    for (i, *_), value in zip(records, values, strict=True):
        out[i], proven[i] = (value, False) if isinstance(value, ChunkCorrupt) else value


async def _get(get: Callable[[str], Awaitable[Buffer]], key: str) -> Buffer | KVTierError:
    try:
        return await get(key)
    except KVTierError as exc:
        return exc
