"""The rewrite step of compaction: drive the disk tier's rewrite over runs of segments
(``kvstore.tiers.disk.reclaim`` picks and groups them), time it, and judge it against a
plain sequential write + fsync of the same volume on the same file system.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.compaction.report import Progress
from kvstore.format.errors import TierFull
from kvstore.tiers.disk.tier import DiskTier

log = logging.getLogger(__name__)
_BLOCK = 4 << 20  # the rewrite's own write batch size, so both figures use one pattern


@dataclass
class RewriteTotals:
    segments: int = 0
    written_bytes: int = 0
    reclaimed_bytes: int = 0
    seconds: float = 0.0
    corrupt_keys: tuple[str, ...] = ()


async def rewrite(tier: DiskTier, runs: list[list[int]], progress: Progress) -> RewriteTotals:
    totals = RewriteTotals()
    corrupt: list[str] = []
    step = progress.step("rewrite segments", len(runs))
    try:
        for run in runs:
            started = time.perf_counter()
            try:
                result = await tier.rewrite_segments(run)
            except TierFull as exc:  # its copies would eat the reserve deletes need
                log.warning("segments %s not rewritten: %s", run, exc)
                step.advance()
                continue
            totals.seconds += time.perf_counter() - started
            totals.segments += len(result.sources)
            totals.written_bytes += result.written_bytes
            totals.reclaimed_bytes += result.reclaimed_bytes
            corrupt += result.corrupt_keys
            step.advance()
    finally:
        step.close()
    totals.corrupt_keys = tuple(corrupt)
    return totals


def raw_write_seconds(directory: Path, volume: int) -> float:
    """Seconds to write ``volume`` bytes sequentially in 4 MiB writes, then fsync, into a
    temporary file in ``directory`` (removed afterwards)."""
    block = np.random.default_rng(0).integers(0, 256, min(volume, _BLOCK), np.uint8).tobytes()
    path = directory / f".compact-bench-{uuid.uuid4().hex}.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        started = time.perf_counter()
        left = volume
        while left > 0:
            left -= os.write(fd, block[:left])
        os.fsync(fd)
        return time.perf_counter() - started
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


async def write_rates(tier: DiskTier, totals: RewriteTotals) -> tuple[float | None, float | None]:
    """(raw sequential write GB/s, rewrite GB/s) for the bytes this run rewrote."""
    if not totals.written_bytes or not totals.seconds:
        return None, None
    raw = await asyncio.to_thread(raw_write_seconds, tier.segment_dir, totals.written_bytes)
    return totals.written_bytes / raw / 1e9, totals.written_bytes / totals.seconds / 1e9
