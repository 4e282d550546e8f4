"""Bringing a disk-tier directory back to a consistent state when the writer opens it.

The index is the truth; segment files are reconciled with it:

1. A segment file the index does not name is removed: segments are named before their
   file is created, so an unnamed file is one whose removal was interrupted after the
   index forgot it (a retirement or an aborted compaction).
2. Half-built compaction segments (BUILDING) are removed when no compaction holds the
   compaction lock; no entry names them before the compaction's switch commits.
3. Each ACTIVE segment is scanned from its committed end to the end of its file. What
   lies there was never committed: whole records of puts that were not acknowledged
   durably (the index commit comes after the fsync) and possibly a torn record. It is
   cut off. Those records are not re-indexed: deletes live only in the index, so
   replaying an uncommitted put could resurrect a key deleted after it. A SEALED
   segment's tail past its committed end (a write the appender abandoned) is cut too.
   Every ACTIVE segment but the newest is then sealed; the newest is where appends
   resume.
4. The accounting is rebuilt from the entries, and entries whose bytes are missing (a
   file lost or shortened behind our back) are dropped and logged, so the tier reports
   exactly what it can serve.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.tiers.disk.fs import FileSystem
from kvstore.tiers.disk.index import DiskIndex, SegState
from kvstore.tiers.disk.index_check import index_corrupt
from kvstore.tiers.disk.lock import COMPACT_LOCK, DirLock
from kvstore.tiers.disk.segments import record_size, scan_records, segment_files, segment_path

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    removed_unnamed: list[int] = field(default_factory=list)
    removed_building: list[int] = field(default_factory=list)
    uncommitted_records: int = 0  # whole records past a committed end, discarded
    torn_bytes: int = 0  # bytes of a cut-short or damaged record past them
    dropped_entries: list[str] = field(default_factory=list)
    active: tuple[int, int] | None = None  # (segment id, end) where appends resume


def drop_abandoned_builds(index: DiskIndex, directory: Path) -> list[int]:
    """Remove BUILDING segments; call only while holding the compaction lock."""
    removed = []
    for info in index.all_segments():
        if info.state == SegState.BUILDING and index.drop_segment(info.seg_id):
            index.fs.unlink(segment_path(directory, info.seg_id))
            removed.append(info.seg_id)
    return removed


def remove_unnamed_files(index: DiskIndex, directory: Path) -> list[int]:
    """Remove segment files the index does not name. Safe beside a live writer: the
    directory is listed before the index is read, and a segment is named before its
    file is created, so a file seen here and unnamed there was forgotten for good."""
    on_disk = dict(segment_files(index.fs, directory))
    named = {info.seg_id for info in index.all_segments()}
    removed = sorted(seg_id for seg_id in on_disk if seg_id not in named)
    # A forgotten segment has no entries; one that entries still name lost its own record
    # to damage, and removing it would destroy what a repair can still bring back.
    named_by_entries = removed and {
        seg_id for group in (index.live_entries(set(removed)),
                             index.live_meta_records(set(removed)))
        for seg_id, entries in group.items() if entries}
    if named_by_entries:
        raise index_corrupt(directory.parent, f"segments {sorted(named_by_entries)} hold "
                            "indexed records but have no segment record")
    for seg_id in removed:
        index.fs.unlink(on_disk[seg_id])
    return removed


def recover(index: DiskIndex, directory: Path, compact_lock: DirLock) -> RecoveryReport:
    report = RecoveryReport()
    report.removed_unnamed = remove_unnamed_files(index, directory)
    if compact_lock.try_acquire():
        try:
            report.removed_building = drop_abandoned_builds(index, directory)
        finally:
            compact_lock.release()
    fs = index.fs
    named = {info.seg_id: info for info in index.all_segments()}

    def size_of(seg_id: int) -> int | None:
        return fs.size(segment_path(directory, seg_id))

    # a SEALED one too: the writer abandoned a failed write
    cuts = [(info, size) for info in named.values() if info.state != SegState.BUILDING
            and (size := size_of(info.seg_id)) is not None and size > info.file_bytes]
    _check_ends(index, directory, [info for info, _ in cuts])
    for info, size in cuts:
        _cut_tail(fs, segment_path(directory, info.seg_id), info.file_bytes, size, report)
    active = sorted((i for i in named.values() if i.state == SegState.ACTIVE),
                    key=lambda info: info.seg_id)
    if active:
        newest = active[-1]
        for info in active[:-1]:
            info.state = SegState.SEALED
        if size_of(newest.seg_id) is None:
            newest.state = SegState.SEALED
        else:
            report.active = (newest.seg_id, newest.file_bytes)
        index.set_segments(active)

    dropped = index.rebuild_accounting(size_of)
    report.dropped_entries = [key.decode(errors="replace") for key in dropped]
    for info in index.all_segments():  # named, but the file never was or is gone
        if info.state != SegState.BUILDING and size_of(info.seg_id) is None:
            index.drop_segment(info.seg_id)
    if report.removed_unnamed or report.removed_building:
        fs.fsync_dir(directory)
    _log(report, directory)
    return report


def _check_ends(index: DiskIndex, directory: Path, infos: list) -> None:
    """Cutting a tail destroys what lies there: refuse when an entry names bytes past
    its segment's committed end, which only a damaged index does (a flipped bit in the
    segment's size); ``kvtier repair`` then rebuilds it from the intact segments."""
    if not infos:
        return
    ends = {info.seg_id: info.file_bytes for info in infos}
    for named in (index.live_entries(set(ends)), index.live_meta_records(set(ends))):
        for seg_id, entries in named.items():
            end = max((e.offset + record_size(len(k), e.value_len) for k, e in entries),
                      default=0)
            if end > ends[seg_id]:
                raise index_corrupt(directory.parent, f"segment {seg_id} has entries up to "
                                    f"byte {end} past its committed end {ends[seg_id]}")


def _cut_tail(fs: FileSystem, path: Path, end: int, size: int,
              report: RecoveryReport) -> None:
    fd = fs.open(path, os.O_RDWR)
    try:
        records, valid_end = scan_records(fs, fd, end, size)
        report.uncommitted_records += len(records)
        report.torn_bytes += size - valid_end
        fs.truncate(fd, end)
        fs.fsync(fd)
    finally:
        fs.close(fd)


def _log(report: RecoveryReport, directory: Path) -> None:
    if report.uncommitted_records or report.torn_bytes:
        log.warning("disk tier %s: discarded %d uncommitted record(s) and %d torn byte(s) "
                    "past the committed end of the active segment", directory,
                    report.uncommitted_records, report.torn_bytes)
    if report.removed_unnamed or report.removed_building:
        log.info("disk tier %s: removed unnamed segment files %s and abandoned compaction "
                 "segments %s", directory, report.removed_unnamed, report.removed_building)
    if report.dropped_entries:
        log.error("disk tier %s: %d index entries named bytes that are gone (segment file "
                  "missing or short); dropped: %s", directory, len(report.dropped_entries),
                  report.dropped_entries[:10])


def seal_dead_writer(index: DiskIndex, path: Path) -> int | None:
    """Recover like a writer open, then seal the segment appends would resume in, for
    the disk tier in ``path`` whose index is ``index``: so a compaction can rewrite the
    last segment too; the next writer starts a new one.

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

