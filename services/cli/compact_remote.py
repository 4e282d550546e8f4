"""Session changes through a live server, for a compaction beside ``kvtier serve``.

A live server's TierManager owns the reference counts and manifests (it keeps counts in
memory), so a compaction running beside it asks it to delete and demote sessions over
its gRPC API instead of writing them itself. The address comes from ``--server`` or,
when the server records it, from ``SERVER_ADDRESS_FILE`` in the data directory.
"""

from __future__ import annotations

from kvtier.client import AsyncClient
from services.cli.address import ClientOptions

OBJECT_TIER = "object"


class ServerOps:
    """``kvstore.compaction.sessions.SessionOps`` over the server's Delete and Evict RPCs."""

    zstd_level = None  # the server compresses with its own object_compression_level

    def __init__(self, address: str, connection: ClientOptions | None = None) -> None:
        self.description = f"the server at {address}"
        # ``connection``: TLS and an admin token when the server authenticates.
        self.client = (AsyncClient(address, shared_memory=False, **connection) if connection
                       else AsyncClient(address, shared_memory=False))

    async def delete(self, tenant: str, session_id: str) -> int:
        return (await self.client.delete(tenant, session_id)).chunks_freed

    async def demote(self, tenant: str, session_id: str) -> None:
        await self.client.evict(tenant, session_id, OBJECT_TIER)

    async def collect_orphans(self) -> None:
        return None  # chunks of a spill in flight are referenced only in its memory

    async def close(self) -> None:
        await self.client.close()
