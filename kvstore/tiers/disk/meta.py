"""The MetaStore kept by the disk tier (session manifests, refcounts).

A logged write (every one but the derived records, ``metalog.py``) is stored once: as the
segment record that logs it. The index's ``meta`` database names the key with an empty
value and ``metarec`` names the record, which a ``get`` reads and verifies (record
checksum, key, flags) like a chunk; a derived record's value is kept in ``meta`` itself.
An index written before values lived in their records alone holds the value in ``meta``
too, and it is served from there. A commit goes through the tier's write pipeline, so it
is ordered after every chunk put the tier accepted before it: a manifest is never durable
before the chunks it names (see ``DiskTier.commit_with_meta`` and ``DiskTier.put_many``
for the one-transaction forms).

A record that fails its checks raises ``ChunkCorrupt`` from ``get``; ``scan`` leaves its
key out (logging it), so one damaged record does not hide the others.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from kvstore.format.errors import ChunkCorrupt, TierUnavailable
from kvstore.tiers.base import MetaStore
from kvstore.tiers.disk.index import DiskIndex, IndexEntry
from kvstore.tiers.disk.reader import SegmentGone
from kvstore.tiers.disk.segments import key_bytes

log = logging.getLogger(__name__)

# (key, entry of its record) -> the logged value it holds; ChunkCorrupt, or SegmentGone
# when a compaction retired the segment after the lookup
ReadLogged = Callable[[bytes, IndexEntry], Awaitable[bytes]]
_ATTEMPTS = 3


class DiskMetaStore(MetaStore):
    def __init__(self, index: DiskIndex,
                 commit: Callable[[dict[str, bytes | None]], Awaitable[None]],
                 read_logged: ReadLogged) -> None:
        """``commit``: the tier's ``commit_with_meta``; ``read_logged``: its record read."""
        self._index = index
        self._commit = commit
        self._read_logged = read_logged

    async def get(self, key: str) -> bytes | None:
        kb = key_bytes(key)
        for _ in range(_ATTEMPTS):
            found = self._index.meta_scan(kb, exact=True)
            if not found:
                return None
            try:
                return await self._value(*found[0])
            except SegmentGone:
                continue  # moved by a compaction after the lookup: look it up again
        raise TierUnavailable(f"disk tier: the record of meta key {key!r} keeps moving")

    async def commit(self, writes: dict[str, bytes | None]) -> None:
        await self._commit(writes)

    async def scan(self, prefix: str) -> list[tuple[str, bytes]]:
        out = []
        for kb, value, entry in self._index.meta_scan(prefix.encode("utf-8")):
            got: bytes | None
            try:
                got = await self._value(kb, value, entry)
            except SegmentGone:
                got = await self.get(kb.decode())
            except ChunkCorrupt as exc:
                log.error("disk tier: meta key %r left out: %s", kb, exc)
                continue
            if got is not None:
                out.append((kb.decode(), got))
        return out

    async def _value(self, kb: bytes, value: bytes, entry: IndexEntry | None) -> bytes:
        if value or entry is None:  # derived, or stored before records alone held values
            return value
        return await self._read_logged(kb, entry)


def encode_writes(writes: dict[str, bytes | None]) -> dict[bytes, bytes | None]:
    """Meta writes with validated utf-8 keys; ``None`` deletes."""
    return {key_bytes(k): None if v is None else bytes(v) for k, v in writes.items()}
