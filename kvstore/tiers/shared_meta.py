"""Manifests in the object store, written by compare-and-swap: the truth of a fleet.

``SharedMetaStore`` keeps every ``manifest/`` record as one S3 object beside the object
tier's chunks (``<prefix>fleet/manifest/<tenant>/<session>.kvsm``: a suffix the tier's
own listing skips) and every other record (reference counts: node-local, an
optimisation nobody else trusts) in ``local``. A manifest write is a conditional PUT:
``If-None-Match: *`` when this node saw no manifest, ``If-Match`` on the ETag it read
otherwise, so of two nodes writing one session from the same generation exactly one
wins and the other gets ``StaleGeneration``. Before that PUT every chunk the manifest
names is touched in the object store (its LastModified refreshed), which is what keeps
the fleet's mark and sweep (``kvstore.fleet.collect``) off a chunk that a spill dedupes
while the sweep runs; a chunk already gone fails the write (``ChunksNotHeld``-like
``DataLoss``) rather than commit a manifest naming nothing. docs/fleet.md has the protocol.

The ETags (and bytes) last read are cached per key: the CAS compares against what the
caller's ``get`` under the session lock saw. When the store cannot be reached a cached
manifest is served (a node's hot sessions still resume), never trusted over the store
once it answers; writes then fail ``TierUnavailable``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from kvstore.errors import ChunkNotFound, DataLoss, StaleGeneration, TierUnavailable
from kvstore.manifest import MANIFEST_PREFIX, SessionManifest
from kvstore.tiers.base import MetaStore
from kvstore.tiers.object import ObjectTier

log = logging.getLogger(__name__)
T = TypeVar("T")
SUFFIX = ".kvsm"
_ABSENT = None  # cached ETag of a key seen absent


class SharedMetaStore(MetaStore):
    def __init__(self, tier: ObjectTier, local: MetaStore, node_id: str) -> None:
        self._tier = tier
        self._client, self._bucket, prefix = tier.s3_location()
        self._root = prefix + "fleet/"
        self._local = local
        self.node_id = node_id
        self._seen: dict[str, tuple[str | None, bytes | None]] = {}  # key -> (ETag, bytes)

    @staticmethod
    def _shared(key: str) -> bool:
        return key.startswith(MANIFEST_PREFIX)

    def _object(self, key: str) -> str:
        return self._root + key + SUFFIX

    async def _call(self, what: str, function: Callable[..., T], **kwargs: object) -> T:
        try:
            return await asyncio.to_thread(function, **kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise StaleGeneration(f"another node wrote {kwargs.get('Key')} since this "
                                      "node read it: load the session again") from exc
            if code in ("NoSuchKey", "404", "NotFound"):
                raise ChunkNotFound(str(kwargs.get("Key"))) from exc
            raise TierUnavailable(f"shared metadata {what} failed: {code}") from exc
        except BotoCoreError as exc:
            raise TierUnavailable(f"shared metadata {what} failed: {exc!r}") from exc

    async def _fetch(self, key: str) -> tuple[str | None, bytes | None]:
        try:
            response = await self._call("GET", self._client.get_object,
                                        Bucket=self._bucket, Key=self._object(key))
        except ChunkNotFound:
            return _ABSENT, None
        body = await asyncio.to_thread(response["Body"].read)
        return response["ETag"], body

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
        names: list[str] = []
        paginator = self._client.get_paginator("list_objects_v2")

        def listing() -> None:
            for page in paginator.paginate(Bucket=self._bucket, Prefix=self._root + prefix):
                names.extend(item["Key"] for item in page.get("Contents", [])
                             if item["Key"].endswith(SUFFIX))

        await self._call("LIST", listing)
        keys = [name[len(self._root):-len(SUFFIX)] for name in names]
        found = await asyncio.gather(*(self._fetch(key) for key in keys))
        return sorted((key, body) for key, (_, body) in zip(keys, found, strict=True)
                      if body is not None)

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
        try:
            if value is None:
                if expected is not None:
                    await self._call("DELETE", self._client.delete_object, Bucket=self._bucket,
                                     Key=self._object(key), IfMatch=expected)
                return _ABSENT
            await self._touch_chunks(value)
            response = await self._call("PUT", self._client.put_object, Bucket=self._bucket,
                                        Key=self._object(key), Body=bytes(value), **condition)
        except (StaleGeneration, ChunkNotFound):
            self._seen.pop(key, None)  # the next get reads the store again
            raise StaleGeneration(f"{key}: another node committed a generation since this "
                                  "node read it: load the session again") from None
        return response["ETag"]

    async def _touch_chunks(self, value: bytes) -> None:
        """Refresh every chunk the manifest names, so a sweep running now keeps them. A
        memory-acked generation's chunks may not be written back yet (the write-back's
        PUT dates them then): only a durable one must find them all."""
        manifest = SessionManifest.decode(value)
        durable = manifest.receipt is not None and manifest.receipt.durable
        found = await asyncio.gather(*(self._tier.touch(key) for key in manifest.chunk_keys),
                                     return_exceptions=True)
        for outcome in found:
            if isinstance(outcome, ChunkNotFound) and durable:
                raise DataLoss(f"{manifest.tenant}/{manifest.session_id}: a chunk it names "
                               f"is gone from the object store ({outcome}): spill it again "
                               "with its bytes") from outcome
            if isinstance(outcome, BaseException) and not isinstance(outcome, ChunkNotFound):
                raise outcome

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
