"""Manifests in the object store, written by compare-and-swap: the truth of a fleet.

``SharedMetaStore`` keeps every ``manifest/`` record as one S3 object beside the object
tier's chunks (``<prefix>fleet/manifest/<tenant>/<session>.kvsm``: a suffix the tier's
own listing skips) and every other record (reference counts: node-local, an
optimisation nobody else trusts) in ``local``. A manifest write is a conditional PUT:
``If-None-Match: *`` when this node saw no manifest, ``If-Match`` on the ETag it read
otherwise, so of two nodes writing one session from the same generation exactly one
wins and the other gets ``StaleGeneration``. Before that PUT the chunks the manifest
names anew pass the garbage-collection epoch's gate (``kvstore.fleet.epochs``), which is
what keeps the fleet's sweep (``kvstore.fleet.gc.collect``) off a chunk that a spill
dedupes while the sweep runs. docs/fleet.md has the protocol.

The ETags (and bytes) last read are cached per key: the CAS compares against what the
caller's ``get`` under the session lock saw. When the store cannot be reached a cached
manifest is served (a node's hot sessions still resume), never trusted over the store
once it answers; writes then fail ``TierUnavailable``.

Each conditional write is reported to ``observer`` (``kvstore.remote.observe``: won,
conflict, error), and so is each spill's time at the epoch gate.

Under encryption at rest the manifests are sealed in the bucket as on a node's disk
(``kvstore.encryption.tiers.RecordSealer``); the chunks are sealed by the object tier itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from kvstore.fleet.bucket import BucketIO
from kvstore.fleet.epochs import GcPaths, SpillGate
from kvstore.format.errors import (
    ChunkCorrupt,
    ChunkNotFound,
    DataLoss,
    InvalidRequest,
    StaleGeneration,
    TierUnavailable,
)
from kvstore.format.keys import chunk_digest, split_block_key
from kvstore.remote.observe import IGNORE, Observer
from kvstore.session.manifest import MANIFEST_PREFIX, SessionManifest
from kvstore.tiers.base import FLEET_BUCKET_KEY, MetaStore, Tier
from kvstore.tiers.object import ObjectTier

if TYPE_CHECKING:  # cryptography is imported only by a server that encrypts
    from kvstore.encryption.tiers import RecordSealer

log = logging.getLogger(__name__)
T = TypeVar("T")
SUFFIX = ".kvsm"
_ABSENT = None  # cached ETag of a key seen absent


class SharedMetaStore(MetaStore):
    def __init__(self, tier: ObjectTier, local: MetaStore, node_id: str,
                 caches: Sequence[Tier] = (), *, sealer: RecordSealer | None = None,
                 chunks: Tier | None = None) -> None:
        """``caches``: this node's other tiers, from which a chunk a sweep collected
        while a spill named it is put back (``kvstore.fleet.epochs``) through ``chunks``
        (the object tier as the node's stack has it: sealed under encryption at rest;
        default ``tier``). ``sealer``: manifests are sealed in the bucket (every node of
        the fleet then needs the keyring)."""
        self._tier = tier
        self._chunks = chunks if chunks is not None else tier
        self._sealer = sealer
        self._client, self._bucket, prefix = tier.s3_location()
        self.io = BucketIO(self._client, self._bucket, tier.remote)
        self._root = prefix + "fleet/"
        self.paths = GcPaths(self._root)
        self._local = local
        self._caches = tuple(caches)
        self.node_id = node_id
        self._seen: dict[str, tuple[str | None, bytes | None]] = {}  # key -> (ETag, bytes)
        self.gate = SpillGate(self.io, self.paths, node_id, exists=tier.contains,
                              reupload=self._reupload, gone_since_listing=self._gone_since)
        self._observer = IGNORE
        self.cas_results: Counter[str] = Counter()  # this node's CAS outcomes, as observed

    @property
    def observer(self) -> Observer:
        return self._observer

    @observer.setter
    def observer(self, observer: Observer) -> None:
        self._observer = self.gate.observer = observer

    @property
    def tier(self) -> ObjectTier:
        return self._tier

    @staticmethod
    def _shared(key: str) -> bool:
        return key.startswith(MANIFEST_PREFIX)

    def _object(self, key: str) -> str:
        return self._root + key + SUFFIX

    async def _call(self, what: str, function: Callable[..., T], **kwargs: object) -> T:
        return await self.io.call(what, function, **kwargs)

    async def _fetch(self, key: str, *, keep_sealed: bool = False
                     ) -> tuple[str | None, bytes | None]:
        """(ETag, plaintext) of ``key``; ``keep_sealed``: a record that cannot be opened
        is returned as stored (its reader then finds it corrupt and says which)."""
        try:
            response = await self._call("GET", self._client.get_object,
                                        Bucket=self._bucket, Key=self._object(key))
        except ChunkNotFound:
            return _ABSENT, None
        body = await self.io.read(response["Body"])
        if self._sealer is not None:
            try:
                body = self._sealer.open(key, body)
            except ChunkCorrupt as exc:
                if not keep_sealed:
                    raise
                log.error("manifest %s cannot be opened: %s", key, exc)
        return response["ETag"], body

    async def mark_node(self) -> None:
        """Name the fleet's bucket in this node's own store (once): its manifests are not
        there, and a repair of the node's directory must count references from them."""
        bucket = self._tier.url.encode()
        if await self._local.get(FLEET_BUCKET_KEY) != bucket:
            await self._local.commit({FLEET_BUCKET_KEY: bucket})

    async def get(self, key: str) -> bytes | None:
        if not self._shared(key):
            return await self._local.get(key)
        try:
            self._seen[key] = await self._fetch(key)
        except TierUnavailable:
            cached = self._seen.get(key)
            if cached is None or cached[1] is None:
                raise
            log.warning("object store unreachable: serving this node's copy of %s", key)
        return self._seen[key][1]

    async def scan(self, prefix: str) -> list[tuple[str, bytes]]:
        if not self._shared(prefix):
            return await self._local.scan(prefix)
        await self.gate.baseline()  # the manager's open scans before listing its tiers
        names = [item["Key"] for item in await self.io.listing(self._root + prefix)
                 if item["Key"].endswith(SUFFIX)]
        keys = [name[len(self._root):-len(SUFFIX)] for name in names]
        # A fetch holds a connection from its GET to its body's read: as many fetches at
        # once as calls run, so a scan of many manifests never overfills boto3's pool.
        slots = asyncio.Semaphore(self.io.calls.max_threads if self.io.calls else 16)

        async def fetch(key: str) -> tuple[str | None, bytes | None]:
            async with slots:
                return await self._fetch(key, keep_sealed=True)

        found = await asyncio.gather(*(fetch(key) for key in keys))
        return sorted((key, body) for key, (_, body) in zip(keys, found, strict=True)
                      if body is not None)

    async def listed_manifests(self, limit: int = 64) -> list[tuple[str, bytes]]:
        """(key, record) of the first ``limit`` manifests listed in the bucket, opened only
        when this store has a sealer: a sample for ``kvstore.encryption.census`` (a
        manifest a sweep cannot open stops its deletions anyway, and a migration never
        overwrites one)."""
        root = self.paths.root
        names = [item["Key"] for item in await self.io.listing(root + MANIFEST_PREFIX)
                 if item["Key"].endswith(SUFFIX)]
        out = []
        for name in sorted(names)[:limit]:
            key = name[len(root):-len(SUFFIX)]
            raw = await self.get(key)
            if raw is not None:
                out.append((key, raw))
        return out

    async def commit(self, writes: dict[str, bytes | None]) -> None:
        """Manifests first, one CAS each (a batch groups several sessions' commits): if
        one loses, the ones already written are put back as they were, so the batch
        fails whole; then the node-local records."""
        done: list[tuple[str, tuple[str | None, bytes | None], str | None]] = []
        try:
            for key, value in writes.items():
                if self._shared(key):
                    before = self._seen.get(key, (_ABSENT, None))
                    etag = await self._swap(key, before[0], value)
                    done.append((key, before, etag))
                    self._seen[key] = (etag, None if value is None else bytes(value))
            await self._local.commit({k: v for k, v in writes.items() if not self._shared(k)})
        except BaseException:
            for key, before, etag in reversed(done):
                await self._undo(key, before, etag)
            raise

    async def _swap(self, key: str, expected: str | None, value: bytes | None) -> str | None:
        """Write (or delete) ``key`` if it is still at ETag ``expected`` (None: absent);
        the new ETag."""
        condition = {"IfMatch": expected} if expected is not None else {"IfNoneMatch": "*"}
        if value is None:
            if expected is not None:
                await self._conditional(key, "DELETE", self._client.delete_object,
                                        IfMatch=expected)
            return _ABSENT
        await self._admit(key, value)
        body = bytes(value) if self._sealer is None else self._sealer.seal(key, bytes(value))
        response = await self._conditional(key, "PUT", self._client.put_object, Body=body,
                                           **condition)
        return response["ETag"]

    async def _conditional(self, key: str, what: str, function: Callable[..., T],
                           **kwargs: object) -> T:
        """One compare-and-swap call on ``key``'s object, its outcome observed."""
        try:
            result = await self._call(what, function, Bucket=self._bucket,
                                      Key=self._object(key), **kwargs)
        except (StaleGeneration, ChunkNotFound):
            self._cas("conflict")
            self._seen.pop(key, None)  # the next get reads the store again
            raise StaleGeneration(f"{key}: another node committed a generation since this "
                                  "node read it: load the session again") from None
        except Exception:
            self._cas("error")
            raise
        self._cas("won")
        return result

    def _cas(self, result: str) -> None:
        self.cas_results[result] += 1
        self._observer.cas(result)

    def writers(self) -> set[str]:
        """Nodes that wrote the manifests this node last read or wrote (no I/O)."""
        nodes = set()
        for _, body in self._seen.values():
            if body is not None:
                try:
                    nodes.add(SessionManifest.decode(body).node_id)
                except ChunkCorrupt:
                    continue
        return nodes - {""}

    async def _admit(self, key: str, value: bytes) -> None:
        """Pass the chunks the manifest names and the one it replaces did not (those
        stay named throughout) through the collection epoch's gate."""
        manifest = SessionManifest.decode(value)
        before = self._seen.get(key, (_ABSENT, None))[1]
        try:
            kept = set(SessionManifest.decode(before).chunk_keys) if before else set()
        except ChunkCorrupt:
            kept = set()
        new = set(manifest.chunk_keys) - kept
        if new:
            await self.gate.admit(new, f"{manifest.tenant}/{manifest.session_id}")

    async def _reupload(self, key: str) -> bool:
        """Put ``key`` back in the bucket from a cache tier holding its very bytes."""
        try:
            digest = split_block_key(key)[1]
        except InvalidRequest:
            return False
        for cache in self._caches:
            try:
                data = await cache.get(key)
            except (ChunkNotFound, DataLoss, TierUnavailable, ChunkCorrupt):
                continue
            if chunk_digest(data) == digest:
                await self._chunks.put(key, data)
                log.info("chunk %s was collected while a spill named it: put back", key)
                return True
        return False

    async def _gone_since(self) -> set[str]:
        """Chunks the object tier counted as held that a fresh listing lacks."""
        before = self._tier.held_keys()
        await self._tier.resync()
        return before - self._tier.held_keys()

    async def _undo(self, key: str, before: tuple[str | None, bytes | None],
                    etag: str | None) -> None:
        try:
            written = await self._swap(key, etag, before[1])
            self._seen[key] = (written, before[1])
        except Exception as exc:  # noqa: BLE001 - the batch's own error is what matters
            self._seen.pop(key, None)
            log.error("could not put %s back after a failed batch: %s", key, exc)

    async def close(self) -> None:
        await self._local.close()
