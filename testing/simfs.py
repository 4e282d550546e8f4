"""Simulated power loss for the disk tier: record its file I/O, rebuild what a crash leaves.

``RecordingFileSystem`` is a ``FileSystem`` (``fs.py``) that performs every call on a
real directory and records, in order, each write, truncation, fsync/fdatasync, file
creation, rename, unlink and directory fsync, plus a snapshot (``env.copy``) of the
LMDB index after each committed write transaction. ``power_loss_images`` then builds,
for a prefix of that log, directories holding what a power cut at that point may
leave, after the model SQLite's crash tests and ALICE use:

- a file's bytes are durable up to its last fsync; later writes and truncations (its
  "unsynced window") may each be lost, in any combination, since the device may
  persist them in any order, and the last one may be torn at 512-byte sectors;
- a creation, rename or unlink is durable once its directory was fsynced; before
  that it may be lost (a created file then does not exist, whatever was synced into it);
- the LMDB index is as of its last committed transaction (LMDB's own guarantee under
  ``sync=True, metasync=True``; see ``index.py``).

Each prefix yields a bounded set of such states (``VARIANTS``): the page cache kept
whole (what a ``kill -9`` leaves), nothing unsynced kept, seeded random subsets of the
unsynced writes and namespace changes, and the last unsynced write torn. Identical
states are built once. The campaign that opens each image and checks it is
``power_loss.py``.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.tiers.disk.fs import OsFileSystem

SECTOR = 512
VARIANTS = ("page-cache", "synced-only", "subset-1", "subset-2", "torn-last")


class RecordingFileSystem(OsFileSystem):
    """Real I/O under ``root``, with every durability-relevant call recorded in ``log``."""

    def __init__(self, root: Path, snapshots: Path) -> None:
        self.root = root.resolve()
        self.snapshots = snapshots
        snapshots.mkdir(parents=True, exist_ok=True)
        self.log: list[tuple] = []
        self._fd_inode: dict[int, int] = {}
        self._names: dict[Path, int] = {}  # path -> inode, as the program sees it now
        self._next_inode = 0
        self._commits = 0

    def _relative(self, path: Path) -> Path:
        return Path(os.path.abspath(path)).relative_to(self.root)

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        rel = self._relative(path)
        existed = rel in self._names
        fd = super().open(path, flags, mode)
        if not existed:
            self._next_inode += 1
            self._names[rel] = self._next_inode
            self.log.append(("create", rel.parent, rel.name, self._next_inode))
        inode = self._names[rel]
        if existed and flags & os.O_TRUNC:
            self.log.append(("truncate", inode, 0))
        self._fd_inode[fd] = inode
        return fd

    def close(self, fd: int) -> None:
        self._fd_inode.pop(fd, None)
        super().close(fd)

    def write(self, fd, parts, offset: int) -> None:
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        super().write(fd, [data], offset)
        self.log.append(("write", self._fd_inode[fd], offset, data))

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        self.log.append(("sync", self._fd_inode[fd]))

    def fdatasync(self, fd: int) -> None:
        super().fdatasync(fd)
        self.log.append(("sync", self._fd_inode[fd]))

    def truncate(self, fd: int, size: int) -> None:
        super().truncate(fd, size)
        self.log.append(("truncate", self._fd_inode[fd], size))

    def unlink(self, path: Path) -> bool:
        rel = self._relative(path)
        gone = super().unlink(path)
        if gone and self._names.pop(rel, None) is not None:
            self.log.append(("unlink", rel.parent, rel.name))
        return gone

    def rename(self, source: Path, target: Path) -> None:
        src, dst = self._relative(source), self._relative(target)
        super().rename(source, target)
        self._names[dst] = self._names.pop(src)
        self.log.append(("rename", src.parent, src.name, dst.parent, dst.name))

    def fsync_dir(self, directory: Path) -> None:
        super().fsync_dir(directory)
        self.log.append(("dirsync", self._relative(directory)))

    def commit_index(self, env) -> None:
        target = self.snapshots / f"{len(self.log):06d}-{self._commits:06d}"
        self._commits += 1
        target.mkdir()
        env.copy(str(target))
        self.log.append(("index", target, self._relative(Path(env.path()))))


@dataclass
class _Inode:
    synced: bytearray = field(default_factory=bytearray)
    current: bytearray = field(default_factory=bytearray)
    pending: list[tuple] = field(default_factory=list)  # ("write", off, data) | ("truncate", n)


def _apply(content: bytearray, op: tuple, sectors: set[int] | None = None) -> None:
    if op[0] == "truncate":
        del content[op[1]:]
        content.extend(bytes(max(0, op[1] - len(content))))
        return
    _, offset, data = op
    if len(content) < offset:
        content.extend(bytes(offset - len(content)))
    for start in range(0, len(data), SECTOR):
        if sectors is not None and (offset + start) // SECTOR not in sectors:
            continue
        piece = data[start:start + SECTOR]
        if len(content) < offset + start:
            content.extend(bytes(offset + start - len(content)))
        content[offset + start:offset + start + len(piece)] = piece


class _Replay:
    """The durable and the volatile state after each event, advanced one event at a time."""

    def __init__(self) -> None:
        self.inodes: dict[int, _Inode] = {}
        self.synced_names: dict[Path, dict[str, int]] = {}
        self.names: dict[Path, dict[str, int]] = {}
        self.pending_names: dict[Path, list[tuple]] = {}
        self.index: tuple[Path, Path] | None = None  # (snapshot, where it belongs)
        self.unsynced: list[tuple[int, int]] = []  # writes (inode, index in its pending)

    def step(self, event: tuple) -> None:
        kind = event[0]
        if kind == "create":
            _, parent, name, inode = event
            self.inodes[inode] = _Inode()
            self.names.setdefault(parent, {})[name] = inode
            self.synced_names.setdefault(parent, {})
            self.pending_names.setdefault(parent, []).append(event)
        elif kind in ("write", "truncate"):
            inode = self.inodes[event[1]]
            op = event[0:1] + event[2:]
            _apply(inode.current, op)
            inode.pending.append(op)
            if kind == "write":
                self.unsynced.append((event[1], len(inode.pending) - 1))
        elif kind == "sync":
            inode = self.inodes[event[1]]
            inode.synced = bytearray(inode.current)
            inode.pending = []
            self.unsynced = [w for w in self.unsynced if w[0] != event[1]]
        elif kind == "unlink":
            self.names[event[1]].pop(event[2], None)
            self.pending_names.setdefault(event[1], []).append(event)
        elif kind == "rename":
            _, sdir, sname, ddir, dname = event
            self.names.setdefault(ddir, {})[dname] = self.names[sdir].pop(sname)
            self.pending_names.setdefault(ddir, []).append(event)
        elif kind == "dirsync":
            directory = event[1]
            self.synced_names[directory] = dict(self.names.get(directory, {}))
            for op in self.pending_names.pop(directory, []):
                if op[0] == "rename":  # the source entry's removal is durable with it
                    self.synced_names.setdefault(op[1], {}).pop(op[2], None)
        elif kind == "index":
            self.index = (event[1], event[2])

    def state(self, variant: str, rng: random.Random) -> dict[Path, bytes]:
        """path -> content of every file the variant leaves."""
        keep_data = keep_names = (lambda _op: True)
        torn: tuple[int, int] | None = None
        if variant == "synced-only":
            keep_data = keep_names = (lambda _op: False)
        elif variant.startswith("subset"):
            keep_data = keep_names = (lambda _op: rng.random() < 0.5)
        elif variant == "torn-last":
            torn = self.unsynced[-1] if self.unsynced else None
        names = {d: dict(entries) for d, entries in self.synced_names.items()}
        for directory in sorted(self.pending_names):
            for op in self.pending_names[directory]:
                if not keep_names(op):
                    continue
                if op[0] == "create":
                    names.setdefault(op[1], {})[op[2]] = op[3]
                elif op[0] == "unlink":
                    names.get(op[1], {}).pop(op[2], None)
                elif op[2] in names.get(op[1], {}):  # a rename whose source is there
                    names.setdefault(op[3], {})[op[4]] = names[op[1]].pop(op[2])
        files: dict[Path, bytes] = {}
        for directory, entries in names.items():
            for name, number in entries.items():
                inode = self.inodes[number]
                content = bytearray(inode.synced)
                for position, op in enumerate(inode.pending):
                    if torn == (number, position):
                        first, last = op[1] // SECTOR, (op[1] + len(op[2]) - 1) // SECTOR
                        span = list(range(first, last + 1))
                        _apply(content, op, set(rng.sample(span, rng.randrange(len(span)))))
                    elif keep_data(op):
                        _apply(content, op)
                files[directory / name] = bytes(content)
        return files


@dataclass(frozen=True)
class CrashImage:
    point: int  # the crash came after this many logged events
    variant: str
    path: Path


def power_loss_images(log: list[tuple], workdir: Path, seed: int,
                      points: Iterator[int] | None = None) -> Iterator[CrashImage]:
    """Each distinct crash state at each prefix of ``log`` as a fresh directory under
    ``workdir`` (removed when the next one is built). ``points``: the prefix lengths
    to try, ascending (default: every one, 0..len(log))."""
    replay = _Replay()
    done = 0
    seen: set[bytes] = set()
    for point in (points if points is not None else range(len(log) + 1)):
        while done < point:
            replay.step(log[done])
            done += 1
        for variant in VARIANTS:
            rng = random.Random(f"{seed}/{point}/{variant}")
            files = replay.state(variant, rng)
            digest = hashlib.sha256(repr(replay.index).encode())
            for path in sorted(files):
                digest.update(str(path).encode() + b"\0" + hashlib.sha256(files[path]).digest())
            if digest.digest() in seen:
                continue
            seen.add(digest.digest())
            target = workdir / "image"
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            for path, content in files.items():
                (target / path).parent.mkdir(parents=True, exist_ok=True)
                (target / path).write_bytes(content)
            if replay.index is not None:
                snapshot, home = replay.index
                (target / home).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(snapshot / "data.mdb", target / home / "data.mdb")
            yield CrashImage(point, variant, target)
