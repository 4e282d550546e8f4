"""The two media behind the object tier (``kvstore.tiers.object``): a local directory
(temp file, fsync, rename, directory fsync: never a torn file after a crash) and an
S3-compatible bucket through boto3, with the tier's settings (``ObjectTierConfig``).
Both are synchronous; the tier runs them in worker threads.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, ReadTimeoutError

from kvstore.format.errors import InvalidRequest
from kvstore.tiers.base import Buffer
from kvstore.tiers.disk.headroom import DEFAULT_RESERVE_BYTES, PAGE_BYTES, check_room, medium_full

log = logging.getLogger(__name__)

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
    # At or above: boto3's transfer manager (parallel parts). Real S3 caps a connection's
    # rate, so parts pay off for big values; below, a plain PUT/GET does better.
    transfer_threshold_bytes: int = 64 << 20
    transfer_chunk_bytes: int = 8 << 20
    transfer_concurrency: int = 4
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 10.0  # one socket read; a stalled store is found by the deadline
    max_attempts: int = 3  # botocore's own retries ("standard" mode, with backoff)
    # The most one call (its retries included) is waited for, and how long the tier then
    # fails fast before one call probes the store again (kvstore.remote.breaker).
    deadline_s: float = 15.0
    breaker_cooldown_s: float = 5.0
    max_threads: int = 16  # S3 calls at once: the threads they run in (kvstore.remote.calls)
    # boto3's connection pool; 0: ``max_threads * transfer_concurrency``. A caller that
    # reads response bodies in a later call (the fleet's metadata, kvstore.fleet.bucket)
    # holds a connection until then: size the pool to those too (``kvtier serve`` does).
    max_pool_connections: int = 0
    # Shared by a fleet (docs/fleet.md): other nodes' manifests may name any chunk, so
    # ``delete`` (a node's reference count reaching zero) keeps the object; only the
    # fleet's sweep (kvstore.fleet.gc.collect) removes chunks.
    shared: bool = False
    # Local directory only:
    fsync: bool = True
    # Free space a put leaves on the directory's medium (``kvstore.tiers.disk.headroom``):
    # it is the data directory's, whose disk tier needs the reserve to delete and reclaim.
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    # Reads up to this size run on the event loop: from the page cache such a read costs
    # less than a hand-off to a worker thread. 0 for slow or network disks.
    inline_read_bytes: int = 4 << 20

    @property
    def pool_connections(self) -> int:
        """boto3's connection pool size (``max_pool_connections``, above)."""
        return self.max_pool_connections or self.max_threads * self.transfer_concurrency


# The slowest tier: compressing trades CPU for fewer bytes moved and kept.
OBJECT_PRESETS = {
    "default": ObjectTierConfig(),
    "compressed": ObjectTierConfig(compression_level=3),
    "network-fs": ObjectTierConfig(inline_read_bytes=0),  # never block the loop on a read
}


class Missing(Exception):
    """The store holds no object under that name."""


class LocalDirStore:
    """Objects as files under ``root/<2 hex>/``, written by temp file + fsync + rename."""

    def __init__(self, root: Path, config: ObjectTierConfig) -> None:
        self.root, self.fsync, self.tmp = root, config.fsync, root / ".tmp"
        self.reserve_bytes = config.reserve_bytes
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

    def full(self) -> bool:
        return medium_full(self.root, self.reserve_bytes)

    def put(self, name: str, data: Buffer) -> None:
        # the file's blocks and its directory entry, counted whole
        check_room(self.root, memoryview(data).nbytes + PAGE_BYTES, self.reserve_bytes,
                   "object tier")
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
            raise Missing(name) from exc

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def delete(self, name: str) -> None:
        # No directory fsync: a delete that a crash undoes leaves an unreferenced object,
        # which the listing counts and compaction collects.
        self._path(name).unlink(missing_ok=True)

    def list(self) -> Iterator[tuple[str, int]]:
        for directory in self.root.iterdir():
            if directory.name == self.tmp.name or not directory.is_dir():
                continue
            for entry in os.scandir(directory):
                if entry.name.endswith((RAW, ZSTD)):
                    yield unquote(entry.name), entry.stat().st_size


class S3Store:
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
                          max_pool_connections=config.pool_connections))
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
            if is_missing(exc):
                raise Missing(name) from exc
            raise

    def exists(self, name: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.prefix + name)
        except ClientError as exc:
            if is_missing(exc):
                return False
            raise
        return True

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + name)

    def named(self, start: str, limit: int) -> list[tuple[str, int]]:
        """Up to ``limit`` (name, size) of values whose names begin with ``start``: one
        LIST request."""
        response = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + start,
                                               MaxKeys=limit)
        return [(item["Key"][len(self.prefix):], item["Size"])
                for item in response.get("Contents", []) if item["Key"].endswith((RAW, ZSTD))]

    def page(self, token: str | None = None) -> tuple[list[tuple[str, int]], str | None]:
        """One LIST request: (name, size) of up to 1,000 values, and the token of the next
        page (None after the last): each page is one call, within its own deadline."""
        more = {"ContinuationToken": token} if token else {}
        response = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, **more)
        items = [(item["Key"][len(self.prefix):], item["Size"])
                 for item in response.get("Contents", []) if item["Key"].endswith((RAW, ZSTD))]
        return items, response.get("NextContinuationToken") if response.get("IsTruncated") \
            else None

    def list(self) -> Iterator[tuple[str, int]]:
        items, token = self.page()
        yield from items
        while token is not None:
            items, token = self.page(token)
            yield from items


def error_code(exc: ClientError) -> str | None:
    return exc.response.get("Error", {}).get("Code")


def is_outage(exc: BaseException) -> bool:
    """Whether an exception of a boto3 call means the store is out (no answer, or a server
    error after botocore's retries), not that it answered the request (a missing key, a
    failed precondition)."""
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500
    return isinstance(exc, (BotoCoreError, OSError))


_THROTTLED = ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
              "TooManyRequestsException", "503")


def error_kind(exc: BaseException) -> str | None:
    """The ``kind`` of a boto3 call's failure (``kvstore.remote.observe``); None when S3
    answered the request (a missing key, a failed precondition)."""
    if isinstance(exc, ClientError):
        code = error_code(exc)
        if code in _THROTTLED:
            return "throttled"
        if is_missing(exc) or code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
            return None
        return "unavailable" if is_outage(exc) else "other"
    if isinstance(exc, (ConnectTimeoutError, ReadTimeoutError)):
        return "timeout"
    if isinstance(exc, (BotoCoreError, OSError)):
        return "unavailable"
    return "other"


def is_missing(exc: ClientError) -> bool:
    return error_code(exc) in ("NoSuchKey", "404", "NotFound")
