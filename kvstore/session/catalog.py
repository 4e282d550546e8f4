"""The session catalog: manifests in the MetaStore, the per-session locks, their count,
and (where this node alone writes them) the decoded manifests in memory (``ManifestCache``).

Every manifest write goes through the ``RefLedger``, so it commits in one batch with the
reference changes it implies (``kvstore.placement.refcount``), and is told to the tenants'
``UsageLedger`` (``kvstore.session.quota``) once committed, which ``load_count`` fills from every
manifest at open. A manifest commit refused for a full medium sheds retained chunks
(``StoreEvents.make_room``) before it fails, so a retry finds the room a delete left. Callers hold
the session's lock (``read`` to look, ``write`` to change) from a ``load`` to the
``put`` that depends on it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager

from kvstore.format.errors import ChunkCorrupt, DataLoss, SessionNotFound, TierFull
from kvstore.placement.events import StoreEvents
from kvstore.placement.locks import RWLocks
from kvstore.placement.refcount import RefLedger
from kvstore.session.manifest import MANIFEST_PREFIX, SessionManifest, manifest_key
from kvstore.session.quota import UsageLedger
from kvstore.tiers.base import MetaStore, paced

log = logging.getLogger(__name__)
# Bytes of cache a refused manifest sheds per byte of it: a manifest's record, its index
# pages and its reference counts beside it, with room to spare.
_ROOM_PER_BYTE = 4

# Memory for decoded manifests: a 64k-token session's is about 300 KiB.
MANIFEST_CACHE_BYTES = 32 << 20
_PER_CHUNK = 96  # a chunk key and its size, as Python holds them
_FIXED = 1024  # the other fields


def footprint(manifest: SessionManifest) -> int:
    """Bytes ``manifest`` holds in memory, about."""
    return (manifest.token_ids.nbytes + len(manifest.tail)
            + _PER_CHUNK * len(manifest.chunk_keys) + _FIXED)


class ManifestCache:
    """Decoded manifests, most recently used first, within a byte budget. Where one node
    alone writes the manifests (its ``MetaStore`` has no ``node_id``), the catalog's own
    commits are the only changes, so one it committed or loaded stays exact until its
    next commit or delete, which replace or drop it here: a restore then reads only its
    chunks from the medium. Kept as committed: marks and localization apply on load."""

    def __init__(self, budget: int = MANIFEST_CACHE_BYTES) -> None:
        self.budget = budget
        self._held: OrderedDict[tuple[str, str], tuple[SessionManifest, int]] = OrderedDict()
        self._bytes = 0

    def get(self, tenant: str, session_id: str) -> SessionManifest | None:
        found = self._held.get((tenant, session_id))
        if found is None:
            return None
        self._held.move_to_end((tenant, session_id))
        return found[0]

    def put(self, manifest: SessionManifest) -> None:
        ref = (manifest.tenant, manifest.session_id)
        self.drop(*ref)
        size = footprint(manifest)
        if size > self.budget:
            return
        self._held[ref] = (manifest, size)
        self._bytes += size
        while self._bytes > self.budget:
            _, (_, freed) = self._held.popitem(last=False)
            self._bytes -= freed

    def drop(self, tenant: str, session_id: str) -> None:
        found = self._held.pop((tenant, session_id), None)
        if found is not None:
            self._bytes -= found[1]


class Catalog:
    def __init__(self, meta: MetaStore, ledger: RefLedger, usage: UsageLedger,
                 events: StoreEvents | None = None) -> None:
        """``events``: asked to shed cache (retained chunks) when a manifest commit meets
        a full medium, so the room comes back, once the tier reclaims it, for a retry."""
        self.meta = meta
        self._events = events
        self._ledger = ledger
        self._usage = usage
        self._locks = RWLocks()
        self.held = 0  # manifests in the MetaStore (expired ones not yet collected included)
        # decoded manifests, where this node alone writes them (no shared metadata)
        self._cache = ManifestCache() if not meta.node_id else None
        # Sessions (and generation) marked writeback_failed whose mark may not have been
        # persisted (a full medium can refuse the manifest write too): loads report them.
        self._failed: dict[tuple[str, str], int] = {}

    async def load_count(self) -> None:
        """Count the manifests and record each in the usage ledger (a corrupt one is
        counted as held but uses nothing until it is deleted or replaced)."""
        found = await self.meta.scan(MANIFEST_PREFIX)
        self.held = len(found)
        async for key, value in paced(found):
            try:
                self._usage.record(SessionManifest.decode(value))
            except ChunkCorrupt as exc:
                log.error("corrupt manifest %s uses no quota: %s", key, exc)

    def read(self, tenant: str, session_id: str) -> AbstractAsyncContextManager[None]:
        """The session's shared lock: restores."""
        return self._locks.read((tenant, session_id))

    def write(self, tenant: str, session_id: str) -> AbstractAsyncContextManager[None]:
        """The session's exclusive lock: spills, deletes, demotes, manifest rewrites."""
        return self._locks.write((tenant, session_id))

    async def load(self, tenant: str, session_id: str) -> SessionManifest | None:
        """The stored manifest, None if there is none, ``DataLoss`` if it is corrupt."""
        try:
            manifest = await self._stored(tenant, session_id)
        except ChunkCorrupt as exc:  # its bytes, or the record holding them
            raise DataLoss(f"the manifest of {tenant}/{session_id} is corrupt: {exc}") from exc
        return None if manifest is None else self._with_mark(self._localized(manifest))

    async def _stored(self, tenant: str, session_id: str) -> SessionManifest | None:
        """The manifest as committed, from memory or else decoded from the MetaStore;
        ``ChunkCorrupt`` if its record is."""
        manifest = self._cache.get(tenant, session_id) if self._cache is not None else None
        if manifest is None:
            raw = await self.meta.get(manifest_key(tenant, session_id))
            if raw is None:
                return None
            manifest = SessionManifest.decode(raw)
            if self._cache is not None:
                self._cache.put(manifest)
        return manifest

    def _localized(self, manifest: SessionManifest) -> SessionManifest:
        """The window as this node finds it: another node's is in that node's memory, so
        here it is absent (replay); this node's is where its tier stack holds it now, and
        absent once evicted (a manifest is not rewritten for that), or after a restart."""
        key = manifest.window_key
        if key is None:
            return manifest
        if manifest.node_id != self.meta.node_id:
            return manifest.evolve(window_tier=None, window_key=None,
                                   remote_window=(manifest.window_tier, key))
        tier = self._events.window_tier(key) if self._events is not None else manifest.window_tier
        if tier is None:
            return manifest.evolve(window_tier=None, window_key=None)
        return manifest if tier == manifest.window_tier else manifest.evolve(window_tier=tier)

    @property
    def writeback_failed_count(self) -> int:
        """Sessions marked writeback_failed now."""
        return len(self._failed)

    def _with_mark(self, manifest: SessionManifest) -> SessionManifest:
        marked = self._failed.get((manifest.tenant, manifest.session_id))
        if marked == manifest.generation and not manifest.writeback_failed:
            return manifest.evolve(writeback_failed=True)
        return manifest

    async def mark_writeback_failed(self, tenant: str, session_id: str, generation: int,
                                    failed: bool) -> None:
        """Set (or clear) ``writeback_failed`` on the session while it is at ``generation``.
        Loads report a mark at once, even one whose persisting failed (a full medium can
        refuse the manifest write too; the error propagates)."""
        ref = (tenant, session_id)
        async with self.write(tenant, session_id):
            if not failed and self._failed.get(ref) == generation:
                del self._failed[ref]
            try:
                # localized: a window another node holds stays named as its (see put)
                stored = await self._stored(tenant, session_id)
                manifest = None if stored is None else self._localized(stored)
            except ChunkCorrupt:
                return  # its loads report the corruption
            if manifest is None or manifest.generation != generation:
                return  # deleted or spilled again since
            if failed:
                self._failed[ref] = generation
            if manifest.writeback_failed != failed:
                await self.put(manifest.evolve(writeback_failed=failed))

    async def load_required(self, tenant: str, session_id: str) -> SessionManifest:
        manifest = await self.load(tenant, session_id)
        if manifest is None:
            raise SessionNotFound(f"no session {tenant}/{session_id}")
        return manifest

    async def manifests(self, tenant: str | None = None) -> list[SessionManifest]:
        """Every decodable manifest (of one tenant), sorted by tenant and id."""
        prefix = MANIFEST_PREFIX if tenant is None else manifest_key(tenant, "")
        out = []
        async for key, value in paced(await self.meta.scan(prefix)):
            try:
                out.append(self._with_mark(self._localized(SessionManifest.decode(value))))
            except ChunkCorrupt as exc:
                log.error("skipping corrupt manifest %s: %s", key, exc)
        return out

    async def put(self, manifest: SessionManifest, *, acquire: Sequence[str] = (),
                  release: Sequence[str] = (), new: bool = False,
                  marks: Mapping[str, bytes] | None = None) -> list[str]:
        """Commit ``manifest`` with its reference changes (``new``: the session had no
        manifest; ``marks``: retention marks of released chunks, ``RefLedger.commit``).
        Returns the chunks left unreferenced: the caller frees or retains them."""
        if manifest.remote_window is not None and manifest.window_key is None:
            # A change here (an access time, a mark) leaves the window where it is: the
            # manifest keeps naming it and its node, so a router still sends it home.
            tier, key = manifest.remote_window
            manifest = manifest.evolve(window_tier=tier, window_key=key, remote_window=None)
        elif (manifest.node_id, manifest.node_address) != (self.meta.node_id,
                                                           self.meta.node_address):
            manifest = manifest.evolve(node_id=self.meta.node_id,
                                       node_address=self.meta.node_address)
        encoded = manifest.encode()
        if self._cache is not None:  # until committed: a failed commit may have landed
            self._cache.drop(manifest.tenant, manifest.session_id)
        try:
            freed = await self._ledger.commit(
                {manifest_key(manifest.tenant, manifest.session_id): encoded},
                acquire=acquire, release=release, marks=marks,
            )
        except TierFull:  # the medium is full (a MetaStore knows no quota)
            if self._events is not None:
                await self._events.make_room(_ROOM_PER_BYTE * len(encoded))
            raise
        if self._cache is not None:
            self._cache.put(manifest)
        ref = (manifest.tenant, manifest.session_id)
        if self._failed.get(ref, manifest.generation) != manifest.generation:
            del self._failed[ref]  # an older generation's mark
        self.held += new  # counted once its manifest is committed
        self._usage.record(manifest)
        return freed

    async def remove(self, tenant: str, session_id: str, *, release: Sequence[str] = (),
                     marks: Mapping[str, bytes] | None = None) -> list[str]:
        """Delete the session's manifest; returns the chunks left unreferenced."""
        if self._cache is not None:
            self._cache.drop(tenant, session_id)
        freed = await self._ledger.commit({manifest_key(tenant, session_id): None},
                                          release=release, marks=marks)
        self._failed.pop((tenant, session_id), None)
        self.held -= 1
        self._usage.forget(tenant, session_id)
        return freed
