"""The fleet's garbage collection: mark and sweep over the shared manifests.

Reference counts are node-local (``kvstore.refcount``), so no node may delete a chunk
from the shared object store when its own count reaches zero (the object tier keeps it,
``ObjectTierConfig.shared``). ``collect`` does it instead, for the whole fleet: list the
chunks with their modification times, then read every manifest (the live set is what
some manifest names), then delete each chunk that no manifest names and that nobody
wrote or touched within ``grace_s``, checking its time again just before the delete.
A spill writes its chunks before its manifest and touches every chunk the manifest
names just before the manifest's conditional PUT (``kvstore.tiers.shared_meta``), so
neither an in-flight spill's new chunks nor an old chunk it dedupes looks old. The
argument, and the window it leaves, are in docs/fleet.md.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvstore.errors import ChunkCorrupt
from kvstore.manifest import MANIFEST_PREFIX, SessionManifest
from kvstore.tiers.base import MetaStore
from kvstore.tiers.object import ObjectTier

log = logging.getLogger(__name__)
DEFAULT_GRACE_S = 3600.0  # far above any spill's touch-to-commit time


@dataclass(frozen=True)
class FleetGcReport:
    chunks: int  # chunk objects listed
    live: int  # of those, named by some manifest
    young: int  # unnamed but written or touched within the grace period
    deleted: int
    bytes_freed: int
    manifests: int
    corrupt_manifests: int  # a corrupt manifest stops the sweep: its chunks are unknown


async def collect(meta: MetaStore, objects: ObjectTier, *, grace_s: float = DEFAULT_GRACE_S,
                  now: float | None = None) -> FleetGcReport:
    """Delete the chunks of the shared object store that no manifest names and that are
    older than ``grace_s``. Safe to run beside serving nodes and beside other
    collectors; a corrupt manifest aborts the sweep (nothing is deleted)."""
    listed = await objects.dated_keys()  # before the manifests: see docs/fleet.md
    live: set[str] = set()
    records = await meta.scan(MANIFEST_PREFIX)
    corrupt = 0
    for key, value in records:
        try:
            live.update(SessionManifest.decode(value).chunk_keys)
        except ChunkCorrupt as exc:
            corrupt += 1
            log.error("fleet gc: manifest %s is corrupt (%s): nothing is deleted", key, exc)
    named = sum(key in live for key, _ in listed)
    deleted = freed = young = 0
    if not corrupt:
        for key, when in listed:
            if key in live:
                continue
            cutoff = (time.time() if now is None else now) - grace_s
            if when >= cutoff:
                young += 1
                continue
            latest = await objects.modified(key)  # a touch since the listing keeps it
            if latest is None or latest >= cutoff:
                young += latest is not None
                continue
            freed += await objects.purge(key)
            deleted += 1
    return FleetGcReport(chunks=len(listed), live=named, young=young, deleted=deleted,
                         bytes_freed=freed, manifests=len(records),
                         corrupt_manifests=corrupt)
