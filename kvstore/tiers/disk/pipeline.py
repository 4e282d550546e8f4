"""The disk tier's group commit: queued index operations, fsync, one LMDB transaction.

Operations are queued in append order (the tier holds its append lock while it
appends and queues). A commit takes the whole queue at once, fsyncs every segment its
puts wrote, then applies it in one LMDB write transaction, so the index never names
bytes that are not on disk, and operations waiting for the same commit share one fsync
and one transaction. Until its commit, a queued put or delete is visible to this
process through ``overlay`` and counted in the ``pending_*`` projections.

A failed commit loses its whole batch and nothing else: none of it reached the index,
its bytes stay in the segment as dead bytes no entry names, durable waiters get the
error, and buffered writes raise it from the next ``flush``.

A commit runs in a task of its own holding the pipeline's lock (``_run_commit``): a
caller cancelled meanwhile (the background flush, at close) cannot stop the thread the
commit's fsync or LMDB transaction runs in, and its batch must still be settled, so the
commit goes on without it. ``close`` waits for every commit in flight, so LMDB never
closes under one, and refuses later commits (their batches fail as the tier is closed).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from pathlib import Path
from typing import NamedTuple

import lmdb

from kvstore.format.errors import TierFull, TierUnavailable
from kvstore.tiers.disk.fs import fsync_path
from kvstore.tiers.disk.index import DeleteOp, DiskIndex, IndexEntry, IndexOp, MetaOp, PutOp
from kvstore.tiers.disk.log import storage_error
from kvstore.tiers.disk.segments import segment_path

log = logging.getLogger(__name__)


class QueuedOp(NamedTuple):
    op: IndexOp
    key: bytes | None
    seq: int
    delta: int  # projected change of used bytes
    items: int  # projected change of the item count
    nbytes: int  # value bytes waiting for the commit (backpressure)
    future: asyncio.Future | None  # set when someone waits for the commit


class CommitPipeline:
    def __init__(self, index: DiskIndex, segment_dir: Path, *, commit_interval_s: float,
                 max_pending_bytes: int) -> None:
        self.index = index
        self.segment_dir = segment_dir
        self.commit_interval_s = commit_interval_s
        self.max_pending_bytes = max_pending_bytes
        self.overlay: dict[bytes, tuple[int, IndexEntry | None]] = {}  # key -> (seq, entry)
        self.pending_delta = self.pending_items = self.pending_bytes = 0
        self.failed_writes = 0  # buffered writes lost to a failed commit
        # Segments an fsync failed on. Linux may drop the dirty pages of a failed fsync
        # and report success on the next, so no later batch naming one may commit; the
        # appender shares the set and stops writing to them.
        self.failed_syncs: set[int] = set()
        self._queue: list[QueuedOp] = []
        self._seq = 0
        self._lock = asyncio.Lock()
        self._unreported: Exception | None = None
        self._flush_task: asyncio.Task | None = None
        self._commits: set[asyncio.Task] = set()  # commits started and not finished
        self._closing = False
        self._applying = False
        self._totals = (0, 0)

    def committed_totals(self) -> tuple[int, int]:
        """(used bytes, items) in the index, consistent with the ``pending_*`` figures.

        While a batch's transaction runs in its thread it may already be visible in LMDB
        while still counted as pending here, so the figures read just before it started
        stand in until the batch is settled.
        """
        if not self._applying:
            self._totals = self.index.totals()
        return self._totals

    def enqueue(self, op: IndexOp, key: bytes | None = None, delta: int = 0, items: int = 0,
                nbytes: int = 0, *, future: bool = False) -> QueuedOp:
        self._seq += 1
        waiter = asyncio.get_running_loop().create_future() if future else None
        queued = QueuedOp(op, key, self._seq, delta, items, nbytes, waiter)
        self._queue.append(queued)
        self.pending_delta += delta
        self.pending_items += items
        self.pending_bytes += nbytes
        if key is not None:
            self.overlay[key] = (self._seq, op.entry if isinstance(op, PutOp) else None)
        return queued

    async def settle(self, op: QueuedOp) -> None:
        """Wait for ``op``'s commit if it has a waiter, else make sure one comes soon."""
        if op.future is None:
            self._schedule()
            if self.pending_bytes > self.max_pending_bytes:
                await self._run_commit()
            return
        while not op.future.done():
            await self._run_commit(unless=op.future)
        op.future.result()

    async def flush(self) -> None:
        await self._run_commit()
        error, self._unreported = self._unreported, None
        if error is not None:
            raise error

    async def close(self) -> None:
        """Commit what is queued, wait for every commit in flight, refuse any later one."""
        if self._flush_task is not None:
            self._flush_task.cancel()  # sleeping, or waiting for a commit that goes on
        try:
            await self._run_commit()
        finally:
            self._closing = True
            while self._commits:  # started before closing: let their threads finish
                await asyncio.gather(*self._commits, return_exceptions=True)

    def _schedule(self) -> None:
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        while self._queue:
            await asyncio.sleep(self.commit_interval_s)
            await self._run_commit()

    async def _run_commit(self, unless: asyncio.Future | None = None) -> None:
        """Commit the queue (unless ``unless`` is done by the time the lock is ours) in a
        task that a cancelled caller leaves running (see the module docstring)."""
        task = asyncio.ensure_future(self._locked_commit(unless))
        self._commits.add(task)
        task.add_done_callback(self._commits.discard)
        await asyncio.shield(task)

    async def _locked_commit(self, unless: asyncio.Future | None) -> None:
        async with self._lock:
            if unless is None or not unless.done():
                await self._commit()

    async def _commit(self) -> None:
        batch, self._queue = self._queue, []
        if not batch:
            return
        if self._closing:
            self._fail(batch, TierUnavailable("disk tier is closed"), None)
            return
        segments = {o.op.entry.seg_id for o in batch if isinstance(o.op, PutOp)}
        segments.update(entry.seg_id for o in batch if isinstance(o.op, MetaOp)
                        for entry in (o.op.records or {}).values())
        where = "disk tier"
        try:
            if segments:
                await asyncio.to_thread(self._fsync, segments)
            self.committed_totals()
            self._applying = True
            await asyncio.to_thread(self.index.apply, [o.op for o in batch])
        except lmdb.MapFullError as exc:
            self._fail(batch, TierFull(f"{where}: the LMDB index is full; reopen with a "
                                       "larger map_size"), exc)
        except OSError as exc:
            self._fail(batch, storage_error(exc, f"{where} commit"), exc)
        except lmdb.Error as exc:
            self._fail(batch, storage_error(exc, f"{where} index"), exc)
        else:
            for op in batch:
                self._settled(op)
                if op.future is not None and not op.future.done():
                    op.future.set_result(None)
        finally:
            self._applying = False

    def _fsync(self, seg_ids: set[int]) -> None:
        # by path, not through the appender's handle, which a roll may be closing now
        for seg_id in sorted(seg_ids):
            if seg_id in self.failed_syncs:
                raise OSError(errno.EIO, f"an earlier fsync of segment {seg_id} failed")
            try:
                fsync_path(self.index.fs, segment_path(self.segment_dir, seg_id))
            except OSError:
                self.failed_syncs.add(seg_id)
                raise

    def _settled(self, op: QueuedOp) -> None:
        self.pending_delta -= op.delta
        self.pending_items -= op.items
        self.pending_bytes -= op.nbytes
        if op.key is not None and self.overlay.get(op.key, (None,))[0] == op.seq:
            del self.overlay[op.key]

    def _fail(self, batch: list[QueuedOp], error: Exception, cause: BaseException | None
              ) -> None:
        error.__cause__ = cause
        log.error("%s (%d queued operations lost)", error, len(batch))
        for op in batch:
            self._settled(op)
            if op.future is not None:
                if not op.future.done():
                    op.future.set_exception(error)
            elif isinstance(op.op, PutOp | DeleteOp):
                self.failed_writes += 1
                self._unreported = error
