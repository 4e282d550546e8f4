"""Advisory lock files that coordinate processes sharing one disk-tier directory.

Two locks, each an ``fcntl.flock`` on its own file in the directory:

- ``writer.lock``: held for its whole life by the one DiskTier that appends (the
  server). A second writer is refused with ``Busy``; the offline compactor tests it to
  learn whether a live server shares the directory.
- ``compact.lock``: held by whoever rewrites segments. A second compaction is refused
  with ``Busy``; a writer opening the directory cleans up half-built compaction
  segments only when it can take this lock (no compaction is running).

flock locks belong to an open file description and vanish when the process dies, so a
SIGKILLed holder never leaves a stale lock. The holder's pid is written into the file
for the error message only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from kvstore.format.errors import Busy

WRITER_LOCK = "writer.lock"
COMPACT_LOCK = "compact.lock"


class DirLock:
    def __init__(self, path: Path, purpose: str) -> None:
        self.path = path
        self.purpose = purpose
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock now or raise ``Busy`` naming the holder."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise Busy(f"{self.purpose} of {self.path.parent} is already held by pid "
                       f"{holder} ({self.path.name})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def try_acquire(self) -> bool:
        """Take the lock if it is free now; False when someone else holds it."""
        try:
            self.acquire()
        except Busy:
            return False
        return True

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the description drops the flock

    def is_held_elsewhere(self) -> bool:
        """Whether another holder (any process, or another DirLock here) has it now."""
        if self._fd is not None:
            return False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    @contextlib.contextmanager
    def holding(self):
        """Hold the lock for a block unless this object already holds it."""
        if self.held:
            yield self
            return
        self.acquire()
        try:
            yield self
        finally:
            self.release()
