"""asyncio locks the tier manager takes per chunk key and per session (never globally).

``KeyedLocks`` serialises the moves of one chunk (place, demote, promote, free) so a chunk
freed at refcount zero cannot race a spill that writes it again. ``busy`` lets eviction
skip a key someone holds instead of waiting on it, so no task ever waits for one key's
lock while holding another's: no deadlock by construction.

``RWLocks`` gives each session a readers-writer lock: restores share it, spills and
deletes take it alone, so a reader never sees chunks of two generations mixed. Writers
are preferred, so a stream of restores cannot starve a spill.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: dict[Hashable, asyncio.Lock] = {}
        self._users: dict[Hashable, int] = {}  # holders + waiters; the entry goes at zero

    def busy(self, key: Hashable) -> bool:
        """Someone holds or waits for ``key`` (a fresh ``hold`` would not be immediate)."""
        return key in self._locks

    @asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key], self._locks[key]


class _RWLock:
    def __init__(self) -> None:
        self.cond = asyncio.Condition()
        self.readers = 0
        self.writer = False
        self.writers_waiting = 0
        self.users = 0


class RWLocks:
    def __init__(self) -> None:
        self._locks: dict[Hashable, _RWLock] = {}

    def _enter(self, key: Hashable) -> _RWLock:
        lock = self._locks.setdefault(key, _RWLock())
        lock.users += 1
        return lock

    def _leave(self, key: Hashable, lock: _RWLock) -> None:
        lock.users -= 1
        if not lock.users:
            del self._locks[key]

    @asynccontextmanager
    async def read(self, key: Hashable) -> AsyncIterator[None]:
        lock = self._enter(key)
        try:
            async with lock.cond:
                await lock.cond.wait_for(lambda: not lock.writer and not lock.writers_waiting)
                lock.readers += 1
            try:
                yield
            finally:
                async with lock.cond:
                    lock.readers -= 1
                    lock.cond.notify_all()
        finally:
            self._leave(key, lock)

    @asynccontextmanager
    async def write(self, key: Hashable) -> AsyncIterator[None]:
        lock = self._enter(key)
        try:
            async with lock.cond:
                lock.writers_waiting += 1
                try:
                    await lock.cond.wait_for(lambda: not lock.writer and not lock.readers)
                finally:
                    lock.writers_waiting -= 1
                    lock.cond.notify_all()  # readers held back by this writer may go on
                lock.writer = True
            try:
                yield
            finally:
                async with lock.cond:
                    lock.writer = False
                    lock.cond.notify_all()
        finally:
            self._leave(key, lock)
