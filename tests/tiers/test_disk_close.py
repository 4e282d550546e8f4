"""DiskTier.close racing a commit: close waits for a commit thread in flight (LMDB must
not close under it) and refuses commits once it has started, instead of hanging.

The race is made deterministic at the file-system seam: ``HoldingFileSystem`` parks the
next call of a kind (an append's write, a commit's fsync) in its worker thread until the
test lets it go."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvstore.format.errors import TierUnavailable
from kvstore.tiers.disk import DiskTier
from testing.faultfs import FaultyFileSystem

GUARD_S = 30  # only so a regression fails instead of hanging the suite


class HoldingFileSystem(FaultyFileSystem):
    """Parks the next call of an armed kind until ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self._holds: dict[str, tuple[threading.Event, threading.Event]] = {}

    def arm(self, kind: str) -> tuple[threading.Event, threading.Event]:
        entered, release = threading.Event(), threading.Event()
        self._holds[kind] = (entered, release)
        return entered, release

    def _check(self, kind: str, what: object) -> None:
        held = self._holds.pop(kind, None)
        if held is not None:
            entered, release = held
            entered.set()
            release.wait(GUARD_S)
        super()._check(kind, what)


async def _spin(turns: int = 50) -> None:
    """Let every ready task run a while (no clock involved)."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def test_close_waits_for_a_commit_another_task_starts_after_its_flush(tmp_path, opened):
    fs = HoldingFileSystem()
    tier = opened.adopt(DiskTier(tmp_path, 1 << 20, fs=fs))
    await tier.put("a", b"first" * 100)
    # A durable put parked in its append (holding the append lock) while close flushes.
    write_entered, write_release = fs.arm("write")
    put = asyncio.create_task(tier.put("b", b"second" * 100))
    assert await asyncio.to_thread(write_entered.wait, GUARD_S)
    closing = asyncio.create_task(opened.close(tier))
    await _spin()
    assert not closing.done()  # flushed, now waiting for the append in flight
    # The put's commit starts after close's flush; its fsync is parked in the thread.
    fsync_entered, fsync_release = fs.arm("fsync")
    write_release.set()
    assert await asyncio.to_thread(fsync_entered.wait, GUARD_S)
    await _spin()
    assert not closing.done()  # LMDB is not closed under the commit's thread
    fsync_release.set()
    await asyncio.wait_for(asyncio.gather(put, closing), GUARD_S)
    reopened = DiskTier(tmp_path, 1 << 20)
    try:
        assert bytes(await reopened.get("a")) == b"first" * 100
        assert bytes(await reopened.get("b")) == b"second" * 100  # its commit completed
    finally:
        await reopened.close()


async def test_close_lets_a_background_commit_finish_and_refuses_later_ones(tmp_path, opened):
    fs = HoldingFileSystem()
    tier = opened.adopt(DiskTier(tmp_path, 1 << 20, fs=fs, durable=False, commit_interval_s=0))
    fsync_entered, fsync_release = fs.arm("fsync")
    await tier.put("a", b"buffered" * 100)  # the background flush commits it
    assert await asyncio.to_thread(fsync_entered.wait, GUARD_S)
    closing = asyncio.create_task(opened.close(tier))
    await _spin()
    assert not closing.done()
    fsync_release.set()
    await asyncio.wait_for(closing, GUARD_S)
    with pytest.raises(TierUnavailable):
        await tier.put("late", b"x")
    await tier.pipeline.flush()  # a commit asked for after close touches no LMDB
    reopened = DiskTier(tmp_path, 1 << 20)
    try:
        assert bytes(await reopened.get("a")) == b"buffered" * 100
    finally:
        await reopened.close()
