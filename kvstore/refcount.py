"""Chunk reference counts, kept in the MetaStore beside the manifests that hold them.

Every manifest commit carries the reference changes it implies, in the same atomic
MetaStore batch, so counts and manifests never disagree after a crash. Concurrent
commits are grouped: one writer task applies queued requests in order and commits them
as one batch, which keeps count updates ordered without a lock held across I/O and
amortises the MetaStore's commit cost (an fsync on disk) over concurrent spills.

Besides committed counts the ledger keeps in-memory pins: a spill pins the chunks it is
writing before any manifest references them, so a concurrent delete that drops the
last committed reference does not free a chunk that is about to be referenced again.
A chunk may be removed from the tiers only when ``count`` (committed + pins) is zero.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.errors import ChunkCorrupt
from kvstore.tiers.base import MetaStore

REF_PREFIX = "ref/"
log = logging.getLogger(__name__)


@dataclass
class _Request:
    writes: Mapping[str, bytes | None]
    acquire: Sequence[str]
    release: Sequence[str]
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class RefLedger:
    """Reference counts per chunk key; one ledger per MetaStore (one manager process)."""

    def __init__(self, meta: MetaStore) -> None:
        self._meta = meta
        self._committed: dict[str, int] = {}
        self._pins: Counter[str] = Counter()
        self._queue: list[_Request] = []
        self._writer: asyncio.Task | None = None

    async def load(self) -> None:
        self._committed.clear()
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
    ) -> list[str]:
        """Commit ``writes`` with +1 per key in ``acquire`` and -1 per key in ``release``.

        Returns the keys this request's release brought to zero and that nothing holds
        after the batch (no committed reference, no pin): the caller frees them. Raises
        what the MetaStore raises, in which case nothing of this request (or its batch)
        was applied.
        """
        request = _Request(writes, acquire, release)
        self._queue.append(request)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_batches())
        return await request.done

    async def _write_batches(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
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
            try:
                await self._meta.commit(writes)
            except BaseException as exc:
                for key, old in before.items():
                    if old:
                        self._committed[key] = old
                    else:
                        self._committed.pop(key, None)
                if not isinstance(exc, Exception):  # cancelled: fail what is still queued too
                    batch, self._queue = batch + self._queue, []
                for request in batch:
                    if not request.done.done():
                        request.done.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            for request, keys in zip(batch, zeroed, strict=True):
                if not request.done.done():  # a later request of the batch may hold it again
                    request.done.set_result([k for k in keys if not self.count(k)])
