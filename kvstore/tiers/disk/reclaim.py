"""Online space reclamation: the writer rewrites its own mostly dead segments.

Deletes and overwrites only make bytes dead; the space comes back when a segment's
live records are copied elsewhere and the file is removed. After such a change the
tier pokes its ``Reclaimer``: one background task (never two at once), at most once per
``interval_s``, picks the SEALED segments whose dead fraction is at or above
``dead_fraction`` and rewrites them with the crash-safe protocol of
``kvstore.tiers.disk.rewrite`` (copies fsynced, entries switched in one
transaction, the old file removed only once the index no longer names it), the
deadest first, in runs whose copies fit in the free space and half the medium's
reserve (``headroom.py``), so a full medium gets its space back a segment at a time
and deletes always find the other half. A fully dead segment is simply forgotten and
removed: freeing space needs none to write. Everything slow runs in worker threads or
aiofiles, beside the tier's own writes. When an offline ``kvtier compact`` holds the
compaction lock, the round is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from kvstore.format.errors import Busy, KVTierError
from kvstore.tiers.disk.headroom import free_bytes, rewrite_need
from kvstore.tiers.disk.index import SegmentInfo, SegState

if TYPE_CHECKING:
    from kvstore.tiers.disk.tier import DiskTier

log = logging.getLogger(__name__)

_RUN_SEGMENTS = 8  # sources per rewrite (one switch transaction each)


class Reclaimer:
    def __init__(self, tier: DiskTier, dead_fraction: float, interval_s: float) -> None:
        self.tier = tier
        self.dead_fraction = dead_fraction
        self.interval_s = interval_s
        self.rounds = 0
        self.reclaimed_bytes = 0
        self._task: asyncio.Task | None = None
        self._wanted = False
        self._last = float("-inf")

    @property
    def enabled(self) -> bool:
        return self.dead_fraction < 1

    def poke(self) -> None:
        """Note that bytes died; a round follows within the interval."""
        if not self.enabled:
            return
        self._wanted = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def idle(self) -> None:
        """Wait until no round is pending (for tests and shutdown)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while self._wanted:
            self._wanted = False
            # past the interval, and past the commit of a buffered delete that poked
            wait = max(self._last + self.interval_s - time.monotonic(),
                       2 * self.tier.pipeline.commit_interval_s)
            await asyncio.sleep(wait)
            self._last = time.monotonic()
            try:
                await self.run_once()
            except (KVTierError, OSError) as exc:
                log.warning("disk tier %s: online reclamation failed: %s", self.tier.path, exc)

    async def run_once(self) -> int:
        """One round now; returns the bytes of segment files it freed."""
        # the deadest first: they free the most for what they copy
        chosen = sorted((info for info in self.tier.segments()
                         if info.state == SegState.SEALED and info.dead_bytes > 0
                         and info.dead_fraction >= self.dead_fraction),
                        key=lambda info: (-info.dead_fraction, info.seg_id))
        if not chosen:
            return 0
        if not self.tier.compact_lock.try_acquire():
            return 0  # a compaction runs: it rewrites these itself
        freed = done = 0
        try:
            while run := self._next_run(chosen):
                result = await self.tier.rewrite_segments([info.seg_id for info in run])
                freed += result.reclaimed_bytes
                done += len(run)
                chosen = [info for info in chosen if info not in run]
        except Busy:
            return freed
        finally:
            self.tier.compact_lock.release()
        self.rounds += 1
        self.reclaimed_bytes += freed
        log.info("disk tier %s: reclaimed %d bytes from %d segment(s)", self.tier.path,
                 freed, done)
        return freed

    def _next_run(self, chosen: list[SegmentInfo]) -> list[SegmentInfo]:
        """Up to ``_RUN_SEGMENTS`` of ``chosen`` whose copies fit in the free space and
        half the reserve (``headroom.py``); on a full medium the fully dead ones (they
        copy nothing) and the deadest that fit, so space comes back a segment at a time."""
        tier = self.tier
        room = free_bytes(tier.path) - tier.reserve_bytes // 2 if tier.reserve_bytes > 0 \
            else None
        run: list[SegmentInfo] = []
        for info in chosen:
            if len(run) == _RUN_SEGMENTS:
                break
            if room is None or rewrite_need([*run, info]) <= room:
                run.append(info)
        return run
