"""The disk tier's one file-system seam: every segment-file call goes through a ``FileSystem``.

The tier's code (appends, reads, fsyncs, truncation, removal, directory fsyncs, listing)
calls these synchronous, descriptor-level methods, from worker threads
(``asyncio.to_thread``) wherever they may block, so the async behaviour stays above
the seam. ``OsFileSystem`` is the real one and the default. Two others replace it in
tests and benchmarks: ``simfs.RecordingFileSystem`` (records every write and sync, so
power loss can be simulated at each point) and ``faultfs.FaultyFileSystem`` (raises
ENOSPC or EIO at a chosen call).

The LMDB index is one more file that does not go through here: LMDB writes it itself,
and under ``sync=True, metasync=True`` without ``writemap`` a commit that returned is
durable and a crash leaves the last committed transaction (see ``index.py``). The seam
only hears of each commit (``commit_index``), so a recorder knows what the index held
at every point. ``mmap`` is optional: a file system without it (the fault injector) has
every read served by copy. The advisory lock files (``lock.py``) stay outside too: flock state
does not survive a crash, and their content is only a pid for error messages.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from kvstore.tiers.base import Buffer

_IOV_MAX = 1024  # the smallest IOV_MAX Linux allows; writes of more parts are split


class FileSystem(Protocol):
    def open(self, path: Path, flags: int, mode: int = 0o644) -> int: ...
    def close(self, fd: int) -> None: ...
    def write(self, fd: int, parts: Sequence[Buffer], offset: int) -> None:
        """Write all of ``parts`` back to back at ``offset`` (short writes retried)."""
    def read(self, fd: int, buffer: memoryview, offset: int, flags: int = 0) -> int:
        """Read into ``buffer`` at ``offset``; returns the bytes read (0 at end of file)."""
    def fsync(self, fd: int) -> None: ...
    def fdatasync(self, fd: int) -> None: ...
    def truncate(self, fd: int, size: int) -> None: ...
    def size(self, path: Path) -> int | None:
        """The file's size, or None when it does not exist."""
    def unlink(self, path: Path) -> bool:
        """Remove a file; False when it was already gone."""
    def rename(self, source: Path, target: Path) -> None: ...
    def fsync_dir(self, directory: Path) -> None:
        """Make creations, renames and removals in ``directory`` durable."""
    def listdir(self, directory: Path) -> list[str]: ...
    def mkdir(self, directory: Path) -> None: ...
    def commit_index(self, env: object) -> None:
        """Called after each LMDB write transaction of the tier's index committed."""


class OsFileSystem:
    """The real file system (``os`` calls, no buffering of our own)."""

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def write(self, fd: int, parts: Sequence[Buffer], offset: int) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        views = [v for v in views if v.nbytes]
        while views:
            done = os.pwritev(fd, views[:_IOV_MAX], offset)
            offset += done
            while views and done >= views[0].nbytes:
                done -= views[0].nbytes
                views.pop(0)
            if views and done:
                views[0] = views[0][done:]

    def read(self, fd: int, buffer: memoryview, offset: int, flags: int = 0) -> int:
        return os.preadv(fd, [buffer], offset, flags) if flags else os.preadv(
            fd, [buffer], offset)

    def willneed(self, fd: int, offset: int, size: int) -> None:
        """Start reading the range into the page cache, without waiting for it."""
        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)

    def mmap(self, fd: int) -> mmap.mmap:
        """A read-only mapping of the whole file as it is now."""
        return mmap.mmap(fd, 0, prot=mmap.PROT_READ)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def size(self, path: Path) -> int | None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None

    def unlink(self, path: Path) -> bool:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True

    def rename(self, source: Path, target: Path) -> None:
        os.rename(source, target)

    def fsync_dir(self, directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def listdir(self, directory: Path) -> list[str]:
        return os.listdir(directory)

    def mkdir(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)

    def commit_index(self, env: object) -> None:
        return None


OS = OsFileSystem()


def fsync_path(fs: FileSystem, path: Path) -> None:
    """fsync a file by name (for a segment whose writer's descriptor may be closing)."""
    fd = fs.open(path, os.O_RDONLY)
    try:
        fs.fsync(fd)
    finally:
        fs.close(fd)
