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
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import io
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar
from urllib.parse import quote, unquote, urlsplit

import zstandard
from botocore.exceptions import BotoCoreError, ClientError

from kvstore.errors import ChunkCorrupt, ChunkNotFound, InvalidRequest, TierFull, TierUnavailable
from kvstore.tiers.base import Buffer, Tier, TierStats
from kvstore.tiers.common import Availability, as_byte_view, check_key

log = logging.getLogger(__name__)
T = TypeVar("T")

RAW, ZSTD = ".bin", ".zst"


@dataclass(frozen=True)
class ObjectTierConfig:
    compression_level: int | None = None  # zstd level; None stores values as given
    # The most a compressed object may expand to: a frame declaring more (or no size) is
    # refused before anything is allocated. Values are chunks (one gRPC message, 64 MiB
    # by default) and manifests (4 B per token id).
    max_value_bytes: int = 1 << 30
    # S3 only:
    endpoint_url: str | None = None
    region_name: str | None = None
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    # At or above: boto3's transfer manager (parallel parts). Plain PUT/GET measured faster
    # on moto up to 32 MiB; real S3 caps a connection's rate, so parts pay off for big values.
    transfer_threshold_bytes: int = 64 << 20
    transfer_chunk_bytes: int = 8 << 20
    transfer_concurrency: int = 4
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 10.0
    max_attempts: int = 3  # botocore's own retries ("standard" mode, with backoff)
    max_pool_connections: int = 16
    # Shared by a fleet (docs/fleet.md): other nodes' manifests may name any chunk, so
    # ``delete`` (a node's reference count reaching zero) keeps the object; only the
    # fleet's mark and sweep (kvstore.fleet.collect) removes chunks, through ``purge``.
    shared: bool = False
    # Local directory only:
    fsync: bool = True
    # Reads up to this size run on the event loop: from the page cache a 1 MiB read costs
    # less than a hand-off to a worker thread (bench.tiers). 0 for slow or network disks.
    inline_read_bytes: int = 4 << 20


# The slowest tier: compressing trades CPU for fewer bytes moved and kept.
OBJECT_PRESETS = {
    "default": ObjectTierConfig(),
    "compressed": ObjectTierConfig(compression_level=3),
    "network-fs": ObjectTierConfig(inline_read_bytes=0),  # never block the loop on a read
}


class _Missing(Exception):
    """The store holds no object under that name."""


class _LocalDirStore:
    """Objects as files under ``root/<2 hex>/``, written by temp file + fsync + rename."""

    def __init__(self, root: Path, config: ObjectTierConfig) -> None:
        self.root, self.fsync, self.tmp = root, config.fsync, root / ".tmp"
        self.inline_read_bytes = config.inline_read_bytes
        self.tmp.mkdir(parents=True, exist_ok=True)
        for debris in self.tmp.iterdir():  # temp files of writes a crash interrupted
            debris.unlink()

    def _path(self, name: str) -> Path:
        fanout = hashlib.blake2b(name.encode(), digest_size=1).hexdigest()
        return self.root / fanout / quote(name, safe="")

    def check_name(self, name: str) -> None:
        if len(quote(name, safe="").encode()) > 255:
            raise InvalidRequest(f"key too long for a file name: {name[:40]!r}...")

    def _fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def put(self, name: str, data: Buffer) -> None:
        final = self._path(name)
        if not final.parent.is_dir():
            final.parent.mkdir(exist_ok=True)
            if self.fsync:
                self._fsync_dir(self.root)
        temp = self.tmp / uuid.uuid4().hex
        try:
            with open(temp, "wb") as file:
                file.write(data)
                file.flush()
                if self.fsync:
                    os.fsync(file.fileno())
            os.replace(temp, final)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        if self.fsync:
            self._fsync_dir(final.parent)

    def get(self, name: str, size_hint: int | None = None) -> bytes:
        try:
            with open(self._path(name), "rb") as file:
                return file.read()
        except FileNotFoundError as exc:
            raise _Missing(name) from exc

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def delete(self, name: str) -> None:
        # No directory fsync: a delete that a crash undoes leaves an unreferenced object,
        # which the listing counts and compaction collects.
        self._path(name).unlink(missing_ok=True)

    def touch(self, name: str) -> None:
        try:
            os.utime(self._path(name))
        except FileNotFoundError as exc:
            raise _Missing(name) from exc

    def modified(self, name: str) -> float:
        try:
            return self._path(name).stat().st_mtime
        except FileNotFoundError as exc:
            raise _Missing(name) from exc

    def dated(self) -> Iterator[tuple[str, float]]:
        for name, _ in self.list():
            with contextlib.suppress(FileNotFoundError):
                yield name, self._path(name).stat().st_mtime

    def list(self) -> Iterator[tuple[str, int]]:
        for directory in self.root.iterdir():
            if directory.name == self.tmp.name or not directory.is_dir():
                continue
            for entry in os.scandir(directory):
                if entry.name.endswith((RAW, ZSTD)):
                    yield unquote(entry.name), entry.stat().st_size


class _S3Store:
    """Objects under ``prefix`` in one bucket; plain PUT/GET for values below the
    transfer threshold (fewer round trips), boto3's transfer manager above it."""

    inline_read_bytes = -1  # network I/O never runs on the event loop

    def __init__(self, bucket: str, prefix: str, config: ObjectTierConfig) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix
        self.threshold = config.transfer_threshold_bytes
        self.client = boto3.client(
            "s3", endpoint_url=config.endpoint_url, region_name=config.region_name,
            aws_access_key_id=config.aws_access_key_id,
            aws_secret_access_key=config.aws_secret_access_key,
            config=Config(connect_timeout=config.connect_timeout_s,
                          read_timeout=config.read_timeout_s,
                          retries={"max_attempts": config.max_attempts, "mode": "standard"},
                          max_pool_connections=config.max_pool_connections))
        self.transfer = TransferConfig(multipart_threshold=config.transfer_threshold_bytes,
                                       multipart_chunksize=config.transfer_chunk_bytes,
                                       max_concurrency=config.transfer_concurrency)

    def check_name(self, name: str) -> None:
        if len((self.prefix + name).encode()) > 1024:
            raise InvalidRequest(f"key too long for an S3 object key: {name[:40]!r}...")

    def put(self, name: str, data: Buffer) -> None:
        if len(data) < self.threshold:
            self.client.put_object(Bucket=self.bucket, Key=self.prefix + name, Body=bytes(data))
        else:
            self.client.upload_fileobj(io.BytesIO(data), self.bucket, self.prefix + name,
                                       Config=self.transfer)

    def get(self, name: str, size_hint: int | None = None) -> bytes:
        """``size_hint``: the size the listing or our own put saw, to pick the method."""
        try:
            if size_hint is None or size_hint < self.threshold:
                response = self.client.get_object(Bucket=self.bucket, Key=self.prefix + name)
                return response["Body"].read()
            sink = io.BytesIO()
            self.client.download_fileobj(self.bucket, self.prefix + name, sink,
                                         Config=self.transfer)
            return sink.getvalue()
        except ClientError as exc:
            if _is_missing(exc):
                raise _Missing(name) from exc
            raise

    def exists(self, name: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.prefix + name)
        except ClientError as exc:
            if _is_missing(exc):
                return False
            raise
        return True

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + name)

    def touch(self, name: str) -> None:
        """Refresh the object's LastModified (a copy onto itself, no bytes moved here)."""
        key = self.prefix + name
        try:
            self.client.copy_object(Bucket=self.bucket, Key=key, MetadataDirective="REPLACE",
                                    CopySource={"Bucket": self.bucket, "Key": key})
        except ClientError as exc:
            if _is_missing(exc):
                raise _Missing(name) from exc
            raise

    def modified(self, name: str) -> float:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.prefix + name)
        except ClientError as exc:
            if _is_missing(exc):
                raise _Missing(name) from exc
            raise
        return head["LastModified"].timestamp()

    def dated(self) -> Iterator[tuple[str, float]]:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for item in page.get("Contents", []):
                if item["Key"].endswith((RAW, ZSTD)):
                    yield item["Key"][len(self.prefix):], item["LastModified"].timestamp()

    def list(self) -> Iterator[tuple[str, int]]:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for item in page.get("Contents", []):
                if item["Key"].endswith((RAW, ZSTD)):
                    yield item["Key"][len(self.prefix):], item["Size"]


def _error_code(exc: ClientError) -> str | None:
    return exc.response.get("Error", {}).get("Code")


def _is_missing(exc: ClientError) -> bool:
    return _error_code(exc) in ("NoSuchKey", "404", "NotFound")


class ObjectTier(Tier):
    name: ClassVar[str] = "object"
    durable: ClassVar[bool] = True

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
            self._store: _S3Store | _LocalDirStore = _S3Store(parts.netloc, prefix, config)
        elif parts.scheme in ("", "file"):
            path = Path(parts.path if parts.scheme == "file" else self.url)
            self._store = _LocalDirStore(path, config)
        else:
            raise InvalidRequest(f"object tier URL must be s3://bucket/prefix or a path: "
                                 f"{self.url!r}")
        self._suffix = RAW if config.compression_level is None else ZSTD
        self._sizes: dict[str, int] = {}  # stored name -> stored bytes
        self._used = self._reserved = 0  # _reserved: bytes of puts in flight
        self._loaded = False
        self._load_lock = asyncio.Lock()
        self.health = Availability(log, f"object tier at {self.url}")
        if isinstance(self._store, _LocalDirStore):  # a local listing is quick: load now
            self._load(list(self._store.list()))

    @property
    def used_bytes(self) -> int:
        return self._used

    def s3_location(self) -> tuple[object, str, str]:
        """(boto3 client, bucket, prefix) of an S3 tier, for records kept beside its
        chunks (kvstore.tiers.shared_meta); ``InvalidRequest`` for a local directory."""
        if not isinstance(self._store, _S3Store):
            raise InvalidRequest(f"object tier at {self.url} is not S3: shared metadata "
                                 "needs s3_bucket")
        return self._store.client, self._store.bucket, self._store.prefix

    async def _io(self, what: str, function: Callable[..., T], *args: object,
                  inline: bool = False) -> T:
        """Run blocking store I/O in a worker thread (or here when ``inline``); map medium
        failures to our errors."""
        try:
            result = function(*args) if inline else await asyncio.to_thread(function, *args)
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
            if isinstance(exc, ClientError) and _error_code(exc) == "NoSuchBucket":
                # Every call says so (none is cached), so creating the bucket is enough.
                raise TierUnavailable(f"object {what} failed: bucket "
                                      f"{self._store.bucket!r} does not exist") from exc
            raise TierUnavailable(f"object {what} failed: {exc!r}") from exc
        self.health.succeeded()
        return result

    async def _ensure_loaded(self) -> None:
        if not self._loaded:
            async with self._load_lock:
                if not self._loaded:
                    await self.resync()

    async def _listing(self) -> list[tuple[str, int]]:
        return await self._io("LIST", lambda: list(self._store.list()))

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
        return TierStats(self.name, self.capacity_bytes, self._used, items, self.health.available)

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
            except _Missing:
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

    async def touch(self, key: str) -> None:
        """Mark ``key`` as just used (its modification time), or ``ChunkNotFound``."""
        check_key(key)
        await self._ensure_loaded()
        for name in self._candidates(key):
            try:
                return await self._io("TOUCH", self._store.touch, name)
            except _Missing:
                self._account(name, None)
        raise ChunkNotFound(f"object: no value under {key!r}")

    async def modified(self, key: str) -> float | None:
        """When ``key`` was last written or touched (epoch seconds); None when absent."""
        check_key(key)
        for name in (key + RAW, key + ZSTD):
            try:
                return await self._io("HEAD", self._store.modified, name)
            except _Missing:
                continue
        return None

    async def dated_keys(self) -> list[tuple[str, float]]:
        """(key, modification time as epoch seconds) of every value held."""
        listing = await self._io("LIST", lambda: list(self._store.dated()))
        newest: dict[str, float] = {}
        for name, when in listing:
            key = name[:-len(RAW)]
            newest[key] = max(when, newest.get(key, when))
        return list(newest.items())

    async def contains(self, key: str) -> bool:
        check_key(key)
        await self._ensure_loaded()
        for name in self._candidates(key):
            if await self._io("HEAD", self._store.exists, name):
                return True
            self._account(name, None)
        return False

    async def keys(self) -> AsyncIterator[str]:
        """Every key in the medium under this tier's root or prefix, whoever wrote it."""
        for key in {name[:-len(RAW)] for name, _ in await self._listing()}:
            yield key

    async def held_bytes(self) -> int:
        """Bytes the medium holds under this tier's root or prefix (a listing)."""
        return sum(size for _, size in await self._listing())
