"""What a store holds at rest, sealed or in clear, and whether a keyring opens it: the
check every offline tool makes before it touches a data directory or bucket.

A ``Census`` is shown stored values (manifests, chunks) and notes each one as sealed
(``kvstore.encryption.seal``'s magic) under a key id, or in clear. ``require`` refuses, with
``InvalidRequest`` and before the tool changes anything, when

- sealed values are there (or values whose sealed header is damaged) and no keyring
  was given, or they name a key id it lacks;
- for some key id none of the values sampled under it opens: a key of that id with
  other material (a wrong key is refused, never taken for corruption);
- a keyring was given and values are in clear (``clear_allowed`` off): a server with
  that key reads them as corrupt, so a tool with it would quarantine intact data.

``census_disk`` and ``census_tier`` collect a census of a disk tier (its manifests and
the head of every chunk record) and of any other tier (every value read once); a fleet's
bucket is sampled by ``SharedMetaStore.listed_manifests``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.encryption.seal import MAGIC, OVERHEAD_BYTES, Keyring, read_header
from kvstore.format.errors import ChunkCorrupt, ChunkNotFound, InvalidRequest
from kvstore.session.manifest import MANIFEST_PREFIX
from kvstore.tiers.base import Buffer, MetaStore, Tier
from kvstore.tiers.disk.segments import HEADER_SIZE, segment_path

if TYPE_CHECKING:
    from kvstore.tiers.disk.index import IndexEntry
    from kvstore.tiers.disk.tier import DiskTier

SAMPLES = 3  # values per key id tried before a key is called wrong
KEY_SOURCES = ("--config with encryption_key_file, or KVTIER_ENCRYPTION_KEY, as "
               "kvtier serve reads it")
_BATCH = 4096


@dataclass
class _Sample:
    storage_key: str
    load: Callable[[], Buffer] | Buffer  # the whole sealed value, or how to read it


@dataclass
class Census:
    where: str  # named in refusals: "the data directory D"
    sealed: dict[str, list[_Sample]] = field(default_factory=dict)  # key id -> samples
    sealed_count: int = 0
    clear: int = 0  # values in clear
    clear_example: str = ""  # the storage key of the first
    damaged: int = 0  # sealed magic, header unreadable: corrupt, if a keyring is given

    def note(self, storage_key: str, head: Buffer,
             load: Callable[[], Buffer] | Buffer | None = None) -> None:
        """``head``: the value's first bytes (``OVERHEAD_BYTES`` or all of it); ``load``:
        the whole value, or a callable returning it (default: ``head`` is all of it)."""
        view = memoryview(head).cast("B")
        if bytes(view[:len(MAGIC)]) != MAGIC:
            self.clear += 1
            self.clear_example = self.clear_example or storage_key
            return
        try:
            key_id = read_header(view).key_id
        except ChunkCorrupt:
            self.damaged += 1
            return
        self.sealed_count += 1
        samples = self.sealed.setdefault(key_id, [])
        if len(samples) < SAMPLES:
            samples.append(_Sample(storage_key, head if load is None else load))

    def require(self, keyring: Keyring | None, *, clear_allowed: bool = False) -> None:
        """Refuse (``InvalidRequest``) unless ``keyring`` opens what was noted."""
        if (self.sealed or self.damaged) and keyring is None:
            raise InvalidRequest(
                f"{self.where} is encrypted at rest ({self.sealed_count} sealed values "
                f"under key id(s) {sorted(self.sealed)}, {self.damaged} more with a "
                f"damaged header) and no key was given: give the server's key "
                f"({KEY_SOURCES}); nothing was changed")
        if keyring is None:
            return
        missing = sorted(set(self.sealed) - set(keyring.key_ids))
        if missing:
            raise InvalidRequest(
                f"{self.where} is sealed under key id(s) {missing}, which the "
                f"keyring given does not hold (it holds {keyring.key_ids}): give the "
                f"server's key ({KEY_SOURCES}); nothing was changed")
        for key_id, samples in sorted(self.sealed.items()):
            if not any(_opens(keyring, sample) for sample in samples):
                raise InvalidRequest(
                    f"the key {key_id!r} given does not open the values of {self.where} "
                    f"sealed under that id ({len(samples)} tried): a wrong key, not "
                    "corruption; give the server's own key; nothing was changed")
        if self.clear and not clear_allowed:
            what = "not encrypted" if not self.sealed else "partly in clear"
            raise InvalidRequest(
                f"{self.where} is {what} ({self.clear} values in clear, e.g. "
                f"{self.clear_example!r}), but an encryption key was given: a server with it "
                "reads them as corrupt. Run without the key for data in clear (encryption "
                "at rest is turned on only for a new directory or bucket); nothing was "
                "changed")


def _opens(keyring: Keyring, sample: _Sample) -> bool:
    try:
        value = sample.load() if callable(sample.load) else sample.load
        keyring.open(sample.storage_key, value)
    except (ChunkCorrupt, OSError):  # OSError: its segment was retired meanwhile
        return False
    return True


async def census_disk(disk: DiskTier, census: Census) -> Census:
    """Note ``disk``'s manifests (from its own, unsealed MetaStore) and every chunk entry
    (the head of its record, read from its segment in a worker thread)."""
    await census_manifests(disk.meta, census)
    descriptors: dict[int, int | None] = {}
    try:
        start = None
        while batch := disk.index.entries_after(start, _BATCH):
            await asyncio.to_thread(_note_records, disk, batch, descriptors, census)
            start = batch[-1][0]
    finally:
        for fd in descriptors.values():
            if fd is not None:
                disk.fs.close(fd)
    return census


def _note_records(disk: DiskTier, batch: list[tuple[bytes, IndexEntry]],
                  descriptors: dict[int, int | None], census: Census) -> None:
    for kb, entry in batch:
        fd = descriptors.get(entry.seg_id, -1)
        if fd == -1:
            try:
                fd = disk.fs.open(segment_path(disk.segment_dir, entry.seg_id), os.O_RDONLY)
            except FileNotFoundError:
                fd = None  # retired since the listing: its entries moved
            descriptors[entry.seg_id] = fd
        if fd is None:
            continue
        at = entry.offset + HEADER_SIZE + len(kb)
        head = memoryview(bytearray(min(entry.value_len, OVERHEAD_BYTES)))
        got = disk.fs.read(fd, head, at)
        census.note(kb.decode(), head[:got], _reader(disk, entry, at))


def _reader(disk: DiskTier, entry: IndexEntry, at: int) -> Callable[[], Buffer]:
    """The whole value ``entry`` names (at ``at``), read when a key check needs it."""
    def load() -> Buffer:
        fd = disk.fs.open(segment_path(disk.segment_dir, entry.seg_id), os.O_RDONLY)
        try:
            out = memoryview(bytearray(entry.value_len))
            return out[:disk.fs.read(fd, out, at)]
        finally:
            disk.fs.close(fd)
    return load


async def census_manifests(meta: MetaStore, census: Census) -> Census:
    """Note every manifest record of ``meta`` (a MetaStore that does not open them)."""
    for key, raw in await meta.scan(MANIFEST_PREFIX):
        census.note(key, raw)
    return census


async def census_tier(tier: Tier, census: Census) -> Census:
    """Note every value of ``tier`` (unsealed: the tier as the medium stores it)."""
    async for key in tier.keys():
        try:
            value = await tier.get(key)
        except (ChunkNotFound, ChunkCorrupt):
            continue  # gone meanwhile, or damaged below the seal: the scrub's business
        census.note(key, value)
    return census
