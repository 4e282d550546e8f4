"""Chunk reference counts, kept in the MetaStore beside the manifests that hold them.

Every manifest commit carries the reference changes it implies, in the same atomic
MetaStore batch, so counts and manifests never disagree after a crash. Concurrent
commits are grouped: one writer task applies queued requests in order and commits them
as one batch, which keeps count updates ordered without a lock held across I/O and
amortises the MetaStore's commit cost (an fsync on disk) over concurrent spills. A
batch holds requests of one kind, deletes or stores (``_take``), so a full medium that
refuses stores never fails a delete.

Besides committed counts the ledger keeps in-memory pins: a spill pins the chunks it is
writing before any manifest references them, so a concurrent delete that drops the
last committed reference does not free a chunk that is about to be referenced again.
A chunk may be removed from the tiers only when ``count`` (committed + pins) is zero.

Retention marks (``kvstore.prefix.chains``: a chunk kept as cache after its last reference)
follow the same discipline: a commit that releases chunks may carry their marks, and
the batch writes ``ret/<key>`` for each one it leaves unreferenced; a batch that
references a marked chunk again deletes its mark, and so does the next batch after
``unmark`` (the chunk left every tier), so no mark costs a commit of its own. A chunk
stored as cache with no reference ever (a prefix chunk of no session) has its mark
written by ``mark_retained``, a batch of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.format.errors import ChunkCorrupt
from kvstore.placement.events import StoreEvents
from kvstore.tiers.base import REF_PREFIX, RETAIN_PREFIX, MetaStore

log = logging.getLogger(__name__)


@dataclass
class _Request:
    writes: Mapping[str, bytes | None]
    acquire: Sequence[str]
    release: Sequence[str]
    marks: Mapping[str, bytes]  # released key -> its mark, if the batch frees it
    retained: bool = False  # marks of chunks no reference ever held (``mark_retained``)
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class RefLedger:
    """Reference counts per chunk key; one ledger per MetaStore (one manager process)."""

    def __init__(self, meta: MetaStore, events: StoreEvents | None = None) -> None:
        """``events``: told, after their commit, the keys a batch referenced that had no
        reference."""
        self._meta = meta
        self._events = events
        self._committed: dict[str, int] = {}
        self._pins: Counter[str] = Counter()
        self._queue: list[_Request] = []
        self._writer: asyncio.Task | None = None
        self.marks: dict[str, bytes] = {}  # chunk key -> its persisted retention mark
        self._unmarks: set[str] = set()  # marks the next batch deletes

    async def load(self) -> None:
        self._committed.clear()
        self.marks = {key[len(RETAIN_PREFIX):]: value
                      for key, value in await self._meta.scan(RETAIN_PREFIX)}
        for key, value in await self._meta.scan(REF_PREFIX):
            try:
                count = int(value)
            except ValueError as exc:
                raise ChunkCorrupt(f"reference count {key!r} is not an integer") from exc
            self._committed[key[len(REF_PREFIX) :]] = count

    def committed(self, key: str) -> int:
        return self._committed.get(key, 0)

    def count(self, key: str) -> int:
        return self._committed.get(key, 0) + self._pins[key]

    def referenced(self) -> list[str]:
        """Every key with a committed reference."""
        return list(self._committed)

    def unmark(self, keys: Iterable[str]) -> None:
        """Delete the marks of ``keys`` (gone from every tier) with the next batch."""
        self._unmarks.update(key for key in keys if key in self.marks)

    async def flush_marks(self) -> None:
        """Commit the pending mark deletions now (at open, for the stale ones)."""
        if self._unmarks:
            await self.commit({})

    async def mark_retained(self, marks: Mapping[str, bytes]) -> None:
        """Persist the retention marks of chunks stored as cache without a reference (a
        prefix written by no session), for those still without a committed reference
        when the batch commits."""
        if marks:
            await self._enqueue(_Request({}, (), (), marks, retained=True))

    def pin(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._pins[key] += 1

    def unpin(self, keys: Iterable[str]) -> list[str]:
        """Drop pins; return the keys nothing references any more (free them)."""
        unreferenced = []
        for key in keys:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]
                if not self._committed.get(key):
                    unreferenced.append(key)
        return unreferenced

    async def commit(
        self,
        writes: Mapping[str, bytes | None],
        *,
        acquire: Sequence[str] = (),
        release: Sequence[str] = (),
        marks: Mapping[str, bytes] | None = None,
    ) -> list[str]:
        """Commit ``writes`` with +1 per key in ``acquire`` and -1 per key in ``release``;
        ``marks``: the retention marks of released keys, written for those the batch
        leaves without a committed reference.

        Returns the keys this request's release brought to zero and that nothing holds
        after the batch (no committed reference, no pin): the caller frees them. Raises
        what the MetaStore raises, in which case nothing of this request (or its batch)
        was applied.
        """
        return await self._enqueue(_Request(writes, acquire, release, marks or {}))

    async def _enqueue(self, request: _Request) -> list[str]:
        self._queue.append(request)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_batches())
        return await request.done

    async def _write_batches(self) -> None:  # noqa: C901 - one loop: a batch written, its waiters settled by outcome
        while self._queue:
            batch = self._take()
            before: dict[str, int] = {}
            writes: dict[str, bytes | None] = {}
            zeroed: list[list[str]] = []  # per request: keys its release brought to zero
            for request in batch:
                writes.update(request.writes)
                zeroed.append([])
                deltas = [(k, 1) for k in request.acquire] + [(k, -1) for k in request.release]
                for key, delta in deltas:
                    old = self._committed.get(key, 0)
                    before.setdefault(key, old)
                    new = old + delta
                    if new < 0:
                        log.error("reference count of %s would go below zero; kept at 0", key)
                        new = 0
                    if new:
                        self._committed[key] = new
                    else:
                        self._committed.pop(key, None)
                        if old:
                            zeroed[-1].append(key)
            for key in before:
                count = self._committed.get(key, 0)
                writes[REF_PREFIX + key] = str(count).encode() if count else None
            marks_before = dict(self.marks)
            unmarks, self._unmarks = self._unmarks, set()
            referenced = self._mark_writes(batch, before, unmarks, writes)
            try:
                await self._meta.commit(writes)
            except BaseException as exc:
                for key, old in before.items():
                    if old:
                        self._committed[key] = old
                    else:
                        self._committed.pop(key, None)
                self.marks = marks_before
                self._unmarks |= unmarks
                if not isinstance(exc, Exception):  # cancelled: fail what is still queued too
                    batch, self._queue = batch + self._queue, []
                for request in batch:
                    if not request.done.done():
                        request.done.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            if referenced and self._events is not None:
                self._events.revived(referenced)
            for request, keys in zip(batch, zeroed, strict=True):
                if not request.done.done():  # a later request of the batch may hold it again
                    request.done.set_result([k for k in keys if not self.count(k)])

    def _take(self) -> list[_Request]:
        """The queue's leading requests of one kind: those that only delete metadata, or
        those that store some. On a full medium a disk MetaStore lets the first use its
        reserve and refuses the second, so neither may fail the other by sharing a batch."""
        def stores(request: _Request) -> bool:
            return request.retained or any(value is not None
                                           for value in request.writes.values())

        kind = stores(self._queue[0])
        n = next((i for i, request in enumerate(self._queue) if stores(request) != kind),
                 len(self._queue))
        batch, self._queue = self._queue[:n], self._queue[n:]
        return batch

    def _mark_writes(self, batch: Sequence[_Request], before: Mapping[str, int],
                     unmarks: set[str], writes: dict[str, bytes | None]) -> list[str]:
        """Add the batch's mark writes to ``writes`` (and ``self.marks``); returns the
        keys it references that had no committed reference before."""
        for key in unmarks:
            if key in self.marks and not self._committed.get(key):
                del self.marks[key]
                writes[RETAIN_PREFIX + key] = None
        for request in batch:
            for key, value in request.marks.items():
                if (key in before or request.retained) and not self._committed.get(key):
                    self.marks[key] = value
                    writes[RETAIN_PREFIX + key] = value
        referenced = [key for key, old in before.items()
                      if not old and self._committed.get(key)]
        for key in referenced:
            if self.marks.pop(key, None) is not None:
                writes[RETAIN_PREFIX + key] = None
        return referenced
