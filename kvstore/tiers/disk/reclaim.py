"""Online space reclamation, and which segments are worth rewriting.

Deletes and overwrites only make bytes dead; the space comes back when a segment's live
records are copied elsewhere (``rewrite.py``) and its file removed. After such a change
the tier pokes its ``Reclaimer``: one background task, at most once per ``interval_s``,
rewrites the SEALED segments at or above ``dead_fraction`` dead, the deadest first, in
runs whose copies fit in the free space and half the medium's reserve (``headroom.py``),
so a full medium gets its space back a segment at a time and deletes always find the
other half. A fully dead segment copies nothing. A round is skipped while an offline
compaction holds the compaction lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvstore.format.errors import Busy, KVTierError
from kvstore.tiers.disk.headroom import free_bytes, rewrite_need
from kvstore.tiers.disk.index import SegmentInfo, SegState
from kvstore.tiers.disk.rewrite import Rewriter

log = logging.getLogger(__name__)

_RUN_SEGMENTS = 8  # sources per rewrite (one switch transaction each)


def reclaimable(infos: list[SegmentInfo], dead_fraction: float, *,
                include_active: bool = False) -> list[SegmentInfo]:
    """Sealed segments with dead bytes at or above ``dead_fraction`` of their size
    (``include_active``: a stopped writer's active segment too, which a real offline run
    seals first; for a dry run's forecast)."""
    states = (SegState.SEALED, SegState.ACTIVE) if include_active else (SegState.SEALED,)
    return [info for info in infos
            if info.state in states and info.dead_bytes > 0
            and info.dead_fraction >= dead_fraction]


def groups(infos: list[SegmentInfo], group_bytes: int) -> list[list[int]]:
    """Segment ids in runs of about ``group_bytes`` live bytes (each run: one switch)."""
    out: list[list[int]] = []
    size = 0
    for info in sorted(infos, key=lambda i: i.seg_id):
        if not out or size + info.live_bytes > group_bytes:
            out.append([])
            size = 0
        out[-1].append(info.seg_id)
        size += info.live_bytes
    return out


class Reclaimer:
    def __init__(self, rewriter: Rewriter, segments: Callable[[], list[SegmentInfo]],
                 dead_fraction: float, interval_s: float, settle_s: float) -> None:
        """``segments``: the tier's current segments; ``settle_s``: the least wait after a
        poke (past the commit of the buffered delete that poked)."""
        self.rewriter = rewriter
        self.segments = segments
        self.settle_s = settle_s
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
            wait = max(self._last + self.interval_s - time.monotonic(), self.settle_s)
            await asyncio.sleep(wait)
            self._last = time.monotonic()
            try:
                await self.run_once()
            except (KVTierError, OSError) as exc:
                log.warning("disk tier %s: online reclamation failed: %s",
                            self.rewriter.path, exc)

    async def run_once(self) -> int:
        """One round now; returns the bytes of segment files it freed."""
        # the deadest first: they free the most for what they copy
        chosen = sorted(reclaimable(self.segments(), self.dead_fraction),
                        key=lambda info: (-info.dead_fraction, info.seg_id))
        if not chosen:
            return 0
        rewriter = self.rewriter
        if not rewriter.compact_lock.try_acquire():
            return 0  # a compaction runs: it rewrites these itself
        freed = done = 0
        try:
            while run := self._next_run(chosen):
                result = await rewriter.rewrite([info.seg_id for info in run])
                freed += result.reclaimed_bytes
                done += len(run)
                chosen = [info for info in chosen if info not in run]
        except Busy:
            return freed
        finally:
            rewriter.compact_lock.release()
        self.rounds += 1
        self.reclaimed_bytes += freed
        log.info("disk tier %s: reclaimed %d bytes from %d segment(s)", rewriter.path,
                 freed, done)
        return freed

    def _next_run(self, chosen: list[SegmentInfo]) -> list[SegmentInfo]:
        """Up to ``_RUN_SEGMENTS`` of ``chosen`` whose copies fit in the free space and
        half the reserve (``headroom.py``); on a full medium the fully dead ones (they
        copy nothing) and the deadest that fit, so space comes back a segment at a time."""
        reserve = self.rewriter.reserve_bytes
        room = free_bytes(self.rewriter.path) - reserve // 2 if reserve > 0 else None
        run: list[SegmentInfo] = []
        for info in chosen:
            if len(run) == _RUN_SEGMENTS:
                break
            if room is None or rewrite_need([*run, info]) <= room:
                run.append(info)
        return run
