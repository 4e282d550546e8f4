"""The object tier: an S3-compatible bucket through boto3, or a local directory.

``ObjectTier("s3://bucket/prefix", cap, config)`` or ``ObjectTier("/dir" or "file:///dir",
cap)``. One object per value: S3 shows a PUT whole; the local store writes a temp file,
fsyncs, renames it into place and fsyncs the directory: never a torn file after a crash.

Stored names are ``key + ".bin"`` or, with ``compression_level`` set, ``key + ".zst"``
(a zstd frame): each object says how to read it, so a tier whose compression setting
changed still reads what it wrote before. Accounting counts stored bytes (after
compression: what the medium holds), loaded from a listing of the medium when the tier
is built (local directory) or first used (S3), and again by ``resync()``. ``ttl_s`` is
accepted and not enforced here: expiring durable data is the compaction job's work, which
knows session lifetimes. Blocking I/O runs in worker threads, except small local reads.

An S3 call is waited for at most ``config.deadline_s`` (retries included), in a pool of
``max_threads`` threads, behind the store's circuit breaker (``self.breaker``,
dependency "object"): while it is open every call fails fast with ``TierUnavailable``
and the tier reports itself down (``kvstore.remote.calls``). The fleet's metadata in the
bucket (``kvstore.fleet.bucket``) goes through the same calls and breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

import zstandard
from botocore.exceptions import BotoCoreError, ClientError

from kvstore.format.errors import (
    ChunkCorrupt,
    ChunkNotFound,
    InvalidRequest,
    TierFull,
    TierUnavailable,
)
from kvstore.format.keys import split_block_key
from kvstore.remote.breaker import CircuitBreaker
from kvstore.remote.calls import BlockingCalls
from kvstore.tiers.base import Buffer, Tier, TierStats
from kvstore.tiers.common import Availability, as_byte_view, check_key
from kvstore.tiers.object_media import (
    RAW,
    ZSTD,
    LocalDirStore,
    Missing,
    ObjectTierConfig,
    S3Store,
    error_code,
    error_kind,
    is_outage,
)

log = logging.getLogger(__name__)
T = TypeVar("T")



class ObjectTier(Tier):
    name: ClassVar[str] = "object"
    durable = True

    def __init__(self, url: str | os.PathLike, capacity_bytes: int,
                 config: ObjectTierConfig | None = None) -> None:
        super().__init__(capacity_bytes)
        self.config = config = config or ObjectTierConfig()
        self.url = str(url)
        parts = urlsplit(self.url)
        if parts.scheme == "s3":
            if not parts.netloc:
                raise InvalidRequest(f"no bucket in {self.url!r}")
            prefix = parts.path.lstrip("/")
            if prefix and not prefix.endswith("/"):
                prefix += "/"
            self._store: S3Store | LocalDirStore = S3Store(parts.netloc, prefix, config)
            self.breaker: CircuitBreaker | None = CircuitBreaker(
                "object", cooldown_s=config.breaker_cooldown_s)
            self.remote: BlockingCalls | None = BlockingCalls(
                self.breaker, deadline_s=config.deadline_s,
                max_threads=config.max_threads, is_outage=is_outage,
                kind_of=error_kind)
        elif parts.scheme in ("", "file"):
            path = Path(parts.path if parts.scheme == "file" else self.url)
            self._store = LocalDirStore(path, config)
            self.breaker = self.remote = None  # a local disk: no remote dependency
        else:
            raise InvalidRequest(f"object tier URL must be s3://bucket/prefix or a path: "
                                 f"{self.url!r}")
        self._suffix = RAW if config.compression_level is None else ZSTD
        self._sizes: dict[str, int] = {}  # stored name -> stored bytes
        self._used = self._reserved = 0  # _reserved: bytes of puts in flight
        self._loaded = False
        self._load_lock = asyncio.Lock()
        self.health = Availability(log, f"object tier at {self.url}")
        if isinstance(self._store, LocalDirStore):  # a local listing is quick: load now
            self._load(list(self._store.list()))

    @property
    def used_bytes(self) -> int:
        return self._used

    def medium_full(self) -> bool:
        return isinstance(self._store, LocalDirStore) and self._store.full()

    def s3_location(self) -> tuple[Any, str, str]:  # boto3's client: untyped
        """(boto3 client, bucket, prefix) of an S3 tier, for records kept beside its
        chunks (kvstore.fleet.shared_meta); ``InvalidRequest`` for a local directory."""
        if not isinstance(self._store, S3Store):
            raise InvalidRequest(f"object tier at {self.url} is not S3: shared metadata "
                                 "needs s3_bucket")
        return self._store.client, self._store.bucket, self._store.prefix

    async def _io(self, what: str, function: Callable[..., T], *args: object,
                  inline: bool = False) -> T:
        """Run blocking store I/O in a worker thread (or here when ``inline``; S3 calls
        within their deadline, behind the breaker); map medium failures to our errors."""
        try:
            if inline:
                result = function(*args)
            elif self.remote is not None:
                result = await self.remote.run(what, function, *args)
            else:
                result = await asyncio.to_thread(function, *args)
        except TierUnavailable as exc:  # past its deadline, or the circuit is open
            self.health.failed(what, exc)
            raise
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise TierFull(f"object {what}: the directory's disk is full") from exc
            self.health.failed(what, exc)
            # The file name (a server path) goes to the log; the message may reach a client.
            log.warning("object %s failed: %r", what, exc)
            raise TierUnavailable(f"object {what} failed: "
                                  f"{exc.strerror or type(exc).__name__}") from exc
        except (BotoCoreError, ClientError) as exc:
            self.health.failed(what, exc)
            if isinstance(exc, ClientError) and error_code(exc) == "NoSuchBucket":
                # Every call says so (none is cached), so creating the bucket is enough.
                bucket = getattr(self._store, "bucket", "")  # an S3Store's
                raise TierUnavailable(f"object {what} failed: bucket {bucket!r} does not "
                                      "exist") from exc
            raise TierUnavailable(f"object {what} failed: {exc!r}") from exc
        self.health.succeeded()
        return result

    async def _ensure_loaded(self) -> None:
        if not self._loaded:
            async with self._load_lock:
                if not self._loaded:
                    await self.resync()

    async def _listing(self) -> list[tuple[str, int]]:
        store = self._store
        if not isinstance(store, S3Store):
            return await self._io("LIST", lambda: list(store.list()))
        found, token = await self._io("LIST", store.page)
        while token is not None:  # page by page: one deadline per request, not per bucket
            items, token = await self._io("LIST", store.page, token)
            found.extend(items)
        return found

    async def resync(self) -> int:
        """Rebuild the accounting from a listing of the medium; return ``used_bytes``."""
        return self._load(await self._listing())

    def _load(self, listing: list[tuple[str, int]]) -> int:
        self._sizes, self._loaded = dict(listing), True
        self._used = sum(self._sizes.values())
        return self._used

    async def stats(self) -> TierStats:
        """Counts from the accounting (no listing), after loading it if needed."""
        with contextlib.suppress(TierUnavailable):
            await self._ensure_loaded()
        items = len({name[:-len(RAW)] for name in self._sizes})
        up = self.health.available and not (self.breaker is not None and self.breaker.is_open)
        return TierStats(self.name, self.capacity_bytes, self._used, items, up)

    async def probe(self) -> bool:
        """Whether the bucket serves now (HEAD bucket through the breaker, so a timer
        calling this half-opens an open breaker after its cool-down); a local directory
        is not probed. A bucket that answers but refuses (gone, access denied) opens the
        breaker too: every call would fail. Never raises."""
        store = self._store
        if not isinstance(store, S3Store) or self.breaker is None:
            return True
        try:
            await self._io("PROBE", lambda: store.client.head_bucket(Bucket=store.bucket))
        except TierUnavailable as exc:
            if not self.breaker.is_open:
                self.breaker.failed(exc)
            return False
        return True

    async def close(self) -> None:
        if self.remote is not None:
            self.remote.close()

    def _account(self, name: str, stored: int | None) -> None:
        self._used -= self._sizes.pop(name, 0)
        if stored is not None:
            self._sizes[name] = stored
            self._used += stored

    def _encode(self, view: memoryview) -> Buffer:
        if self.config.compression_level is None:
            return view
        return zstandard.ZstdCompressor(level=self.config.compression_level).compress(view)

    def _decode(self, name: str, data: bytes) -> bytes:
        if name.endswith(RAW):
            return data
        try:
            # A frame declaring its size is decompressed into a buffer of that size
            # whatever max_output_size says: bound the declared size first.
            declared = zstandard.frame_content_size(data)
            if not 0 <= declared <= self.config.max_value_bytes:
                raise ChunkCorrupt(f"object {name!r} declares {declared} B (-1: no size); "
                                   f"at most {self.config.max_value_bytes} B are read")
            return zstandard.ZstdDecompressor().decompress(data, max_output_size=declared)
        except zstandard.ZstdError as exc:
            raise ChunkCorrupt(f"object {name!r} is not a valid zstd frame: {exc}") from exc

    def _names(self, key: str) -> tuple[str, str]:
        """(the name this tier writes, the name of the other encoding)."""
        return key + self._suffix, key + (ZSTD if self._suffix == RAW else RAW)

    def _candidates(self, key: str) -> list[str]:
        """Stored names to try for ``key``, likeliest first. The other encoding is tried
        only when the listing showed it, so a miss costs one call."""
        own, other = self._names(key)
        if other not in self._sizes:
            return [own]
        return [own, other] if own in self._sizes else [other, own]

    async def put(self, key: str, value: Buffer, *, ttl_s: float | None = None) -> None:
        check_key(key)
        name, other = self._names(key)
        self._store.check_name(name)
        view = as_byte_view(value)
        if self.config.compression_level is not None and len(view) > self.config.max_value_bytes:
            raise InvalidRequest(f"object: a {len(view)} B value exceeds max_value_bytes "
                                 f"{self.config.max_value_bytes}: it could not be read back")
        await self._ensure_loaded()
        stored = view if self.config.compression_level is None \
            else await asyncio.to_thread(self._encode, view)
        growth = len(stored) - self._sizes.get(name, 0) - self._sizes.get(other, 0)
        if self._used + self._reserved + growth > self.capacity_bytes:
            raise TierFull(f"object: {len(stored)} B does not fit ({self.free_bytes} B free "
                           f"of {self.capacity_bytes} B)")
        self._reserved += len(stored)
        try:
            await self._io("PUT", self._store.put, name, stored)
        finally:
            self._reserved -= len(stored)
        self._account(name, len(stored))
        if other in self._sizes:  # written before the compression setting changed
            await self._io("DELETE", self._store.delete, other)
            self._account(other, None)

    async def get(self, key: str) -> Buffer:
        check_key(key)
        await self._ensure_loaded()
        for name in self._candidates(key):
            size = self._sizes.get(name)
            inline = size is not None and size <= self._store.inline_read_bytes
            try:
                data = await self._io("GET", self._store.get, name, size, inline=inline)
            except Missing:
                self._account(name, None)  # removed behind our back
                continue
            return data if name.endswith(RAW) else await asyncio.to_thread(
                self._decode, name, data)
        raise ChunkNotFound(f"object: no value under {key!r}")

    async def delete(self, key: str) -> int:
        if self.config.shared:
            return 0  # another node's manifest may name it: the fleet's sweep decides
        return await self.purge(key)

    async def purge(self, key: str) -> int:
        """Remove ``key`` whatever ``shared`` says; the bytes freed."""
        check_key(key)
        await self._ensure_loaded()
        freed = 0
        for name in (key + RAW, key + ZSTD):
            if name in self._sizes or name.endswith(self._suffix):
                await self._io("DELETE", self._store.delete, name)
                freed += self._sizes.get(name, 0)
                self._account(name, None)
        return freed

    def held_keys(self) -> set[str]:
        """Keys the accounting counts as held (the last listing and this tier's writes)."""
        return {name[:-len(RAW)] for name in self._sizes}

    async def contains(self, key: str) -> bool:
        check_key(key)
        await self._ensure_loaded()
        for name in self._candidates(key):
            self.probes["HEAD"] += 1
            if await self._io("HEAD", self._store.exists, name):
                return True
            self._account(name, None)
        return False

    async def find_chains(self, chains: Sequence[str]) -> list[str | None] | None:
        """The chunk stored under each chain key: one LIST of the names that begin with
        it (a HEAD would need the digest, which is what is asked), all at once. None for
        a local directory (its names are spread by hash: no listing by prefix)."""
        if not isinstance(self._store, S3Store):
            return None
        await self._ensure_loaded()
        self.probes["LIST"] += len(chains)
        listings = await asyncio.gather(*(self._io("LIST", self._store.named, chain + ".", 4)
                                          for chain in chains))
        found: list[str | None] = []
        for listing in listings:
            key = None
            for name, size in listing:
                try:
                    split_block_key(name[:-len(RAW)])
                except InvalidRequest:  # not a chunk of ours
                    continue
                self._account(name, size)  # as a listing at open would have counted it
                key = name[:-len(RAW)]
                break
            found.append(key)
        return found

    async def keys(self) -> AsyncIterator[str]:
        """Every key in the medium under this tier's root or prefix, whoever wrote it."""
        for key in {name[:-len(RAW)] for name, _ in await self._listing()}:
            yield key

    async def held_bytes(self) -> int:
        """Bytes the medium holds under this tier's root or prefix (a listing)."""
        return sum(size for _, size in await self._listing())
