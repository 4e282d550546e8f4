"""Decoded manifests kept in memory, most recently used first, within a byte budget.

Where one node alone writes the manifests (its ``MetaStore`` has no ``node_id``), the
catalog's own commits are the only changes, so a manifest it committed or loaded stays
exact until its next commit or delete, which replace or drop it here. A restore then
reads only its chunks from the medium. A manifest is kept as committed: marks and
localization are applied on every load, as for one just decoded.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.session.manifest import SessionManifest

# Memory for decoded manifests: a 64k-token session's is about 300 KiB.
MANIFEST_CACHE_BYTES = 32 << 20
_PER_CHUNK = 96  # a chunk key and its size, as Python holds them
_FIXED = 1024  # the other fields


def footprint(manifest: SessionManifest) -> int:
    """Bytes ``manifest`` holds in memory, about."""
    return (manifest.token_ids.nbytes + len(manifest.tail)
            + _PER_CHUNK * len(manifest.chunk_keys) + _FIXED)


class ManifestCache:
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
