"""Error injection at the disk tier's file-system seam (``fs.py``).

``FaultyFileSystem`` wraps another ``FileSystem`` and makes chosen calls fail with an
``OSError`` of a chosen errno: the Nth call of a kind (``fail("write", errno.EIO,
nth=3)``), or every call of a kind until ``heal()`` (a full disk: ``fail("write",
errno.ENOSPC, times=None)``). Kinds: ``open``, ``write``, ``read``, ``fsync`` (fsync
and fdatasync of files), ``truncate``, ``dirsync``, ``unlink``, ``rename``. A failed
call does nothing (a write writes no byte), the strictest reading of a failure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.tiers.disk.fs import OS, FileSystem


@dataclass
class _Fault:
    kind: str
    code: int
    after: int  # calls of the kind still to pass before the first failure
    times: int | None  # failures left; None: until healed


class FaultyFileSystem:
    def __init__(self, inner: FileSystem = OS) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}
        self.injected: dict[str, int] = {}  # failures raised, by kind
        self._faults: list[_Fault] = []

    def fail(self, kind: str, code: int, *, nth: int = 1, times: int | None = 1) -> None:
        """Make the ``nth`` next call of ``kind`` (and ``times - 1`` after it, or every
        later one when ``times`` is None) raise ``OSError(code)``."""
        self._faults.append(_Fault(kind, code, nth - 1, times))

    def heal(self) -> None:
        self._faults.clear()

    def _check(self, kind: str, what: object) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        for fault in self._faults:
            if fault.kind != kind:
                continue
            if fault.after:
                fault.after -= 1
                continue
            if fault.times is not None:
                fault.times -= 1
                if fault.times == 0:
                    self._faults.remove(fault)
            self.injected[kind] = self.injected.get(kind, 0) + 1
            raise OSError(fault.code, os.strerror(fault.code), str(what))

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        self._check("open", path)
        return self.inner.open(path, flags, mode)

    def close(self, fd: int) -> None:
        self.inner.close(fd)

    def write(self, fd, parts, offset: int) -> None:
        self._check("write", fd)
        self.inner.write(fd, parts, offset)

    def read(self, fd: int, buffer: memoryview, offset: int, flags: int = 0) -> int:
        self._check("read", fd)
        return self.inner.read(fd, buffer, offset, flags)

    def fsync(self, fd: int) -> None:
        self._check("fsync", fd)
        self.inner.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        self._check("fsync", fd)
        self.inner.fdatasync(fd)

    def truncate(self, fd: int, size: int) -> None:
        self._check("truncate", fd)
        self.inner.truncate(fd, size)

    def size(self, path: Path) -> int | None:
        return self.inner.size(path)

    def unlink(self, path: Path) -> bool:
        self._check("unlink", path)
        return self.inner.unlink(path)

    def rename(self, source: Path, target: Path) -> None:
        self._check("rename", source)
        self.inner.rename(source, target)

    def fsync_dir(self, directory: Path) -> None:
        self._check("dirsync", directory)
        self.inner.fsync_dir(directory)

    def listdir(self, directory: Path) -> list[str]:
        return self.inner.listdir(directory)

    def mkdir(self, directory: Path) -> None:
        self.inner.mkdir(directory)

    def commit_index(self, env: object) -> None:
        self.inner.commit_index(env)
