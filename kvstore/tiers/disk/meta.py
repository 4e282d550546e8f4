"""The MetaStore kept in the disk tier's LMDB environment (session manifests, refcounts).

Records live in the ``meta`` database of the same environment as the chunk index, and a
commit goes through the tier's write pipeline, so it is ordered after every chunk put the
tier accepted before it: a manifest is never durable before the chunks it names (see
``DiskTier.commit_with_meta`` and ``DiskTier.put_many`` for the one-transaction forms).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvstore.tiers.base import MetaStore
from kvstore.tiers.disk.index import DiskIndex
from kvstore.tiers.disk.segments import key_bytes


class DiskMetaStore(MetaStore):
    def __init__(self, index: DiskIndex,
                 commit: Callable[[dict[str, bytes | None]], Awaitable[None]]) -> None:
        """``commit``: the tier's ``commit_with_meta``."""
        self._index = index
        self._commit = commit

    async def get(self, key: str) -> bytes | None:
        return self._index.meta_get(key_bytes(key))

    async def commit(self, writes: dict[str, bytes | None]) -> None:
        await self._commit(writes)

    async def scan(self, prefix: str) -> list[tuple[str, bytes]]:
        return [(key.decode(), value)
                for key, value in self._index.meta_scan(prefix.encode("utf-8"))]


def encode_writes(writes: dict[str, bytes | None]) -> dict[bytes, bytes | None]:
    """Meta writes with validated utf-8 keys; ``None`` deletes."""
    return {key_bytes(k): None if v is None else bytes(v) for k, v in writes.items()}
