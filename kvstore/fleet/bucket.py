"""The S3 calls of a fleet's shared metadata: manifests and the garbage-collection
objects (docs/fleet.md), with conditional writes and our errors.

``BucketIO`` runs each boto3 call in a worker thread and maps its failures: a failed
precondition (412: If-Match or If-None-Match did not hold) is ``StaleGeneration``, a
missing object ``ChunkNotFound``, anything else ``TierUnavailable``. It reuses the
object tier's client and its ``BlockingCalls`` (``calls``): each call, and each read of
a response body, is waited for at most the tier's deadline, behind the store's circuit
breaker, so a stalled store costs one deadline and then fails fast.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from kvstore.format.errors import ChunkNotFound, StaleGeneration, TierUnavailable
from kvstore.remote.calls import BlockingCalls

T = TypeVar("T")
_PRECONDITION = ("PreconditionFailed", "412", "ConditionalRequestConflict")
_MISSING = ("NoSuchKey", "404", "NotFound")
_DELETE_BATCH = 1000  # DeleteObjects takes at most this many keys


class BucketIO:
    def __init__(self, client: Any, bucket: str, calls: BlockingCalls | None = None) -> None:
        """``calls``: the object tier's (None: plain worker threads, no deadline)."""
        self.client, self.bucket, self.calls = client, bucket, calls

    async def call(self, what: str, function: Callable[..., T], **kwargs: object) -> T:
        try:
            if self.calls is None:
                return await asyncio.to_thread(function, **kwargs)
            return await self.calls.run(what, function, **kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in _PRECONDITION:
                raise StaleGeneration(f"{kwargs.get('Key')} changed since it was read") from exc
            if code in _MISSING:
                raise ChunkNotFound(str(kwargs.get("Key"))) from exc
            raise TierUnavailable(f"shared metadata {what} failed: {code}") from exc
        except BotoCoreError as exc:
            raise TierUnavailable(f"shared metadata {what} failed: {exc!r}") from exc

    async def get(self, key: str) -> tuple[str, bytes] | None:
        """(ETag, body) of ``key``, or None when there is no such object."""
        try:
            response = await self.call("GET", self.client.get_object, Bucket=self.bucket,
                                       Key=key)
        except ChunkNotFound:
            return None
        return response["ETag"], await self.read(response["Body"])

    async def read(self, body: Any, limit: int | None = None) -> bytes:
        """A response body (up to ``limit`` bytes), read within the calls' deadline."""
        return await self.call("GET body", body.read, **({} if limit is None
                                                        else {"amt": limit}))

    async def get_json(self, key: str) -> tuple[str, Any] | None:
        found = await self.get(key)
        if found is None:
            return None
        try:
            return found[0], json.loads(found[1])
        except ValueError as exc:
            raise TierUnavailable(f"shared metadata object {key} is not JSON: {exc}") from exc

    async def put(self, key: str, body: bytes, *, if_match: str | None = None,
                  if_absent: bool = False) -> str:
        """Write ``key``; with ``if_match`` only over that ETag, with ``if_absent`` only if
        no object is there (``StaleGeneration`` otherwise). Returns the new ETag."""
        condition: dict[str, str] = {}
        if if_match is not None:
            condition["IfMatch"] = if_match
        elif if_absent:
            condition["IfNoneMatch"] = "*"
        response = await self.call("PUT", self.client.put_object, Bucket=self.bucket, Key=key,
                                   Body=body, **condition)
        return response["ETag"]

    async def put_json(self, key: str, value: Any, **condition: Any) -> str:
        return await self.put(key, json.dumps(value, separators=(",", ":")).encode(),
                              **condition)

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        extra = {"IfMatch": if_match} if if_match is not None else {}
        await self.call("DELETE", self.client.delete_object, Bucket=self.bucket, Key=key,
                        **extra)

    async def delete_many(self, keys: Iterable[str],
                          before: Callable[[], bool] = lambda: True) -> list[str]:
        """Delete ``keys`` in batches, each only while ``before()`` holds; the keys
        S3 reported deleted (a missing key counts as deleted)."""
        keys = list(keys)
        done: list[str] = []
        for start in range(0, len(keys), _DELETE_BATCH):
            if not before():
                break
            batch = keys[start:start + _DELETE_BATCH]
            response = await self.call("DELETE", self.client.delete_objects, Bucket=self.bucket,
                                       Delete={"Objects": [{"Key": k} for k in batch],
                                               "Quiet": True})
            failed = {error["Key"] for error in response.get("Errors", [])}
            done.extend(k for k in batch if k not in failed)
        return done

    async def listing(self, prefix: str) -> list[dict[str, Any]]:
        """Every object under ``prefix``: dicts with Key, Size and LastModified."""
        found: list[dict[str, Any]] = []
        more: dict[str, str] = {}
        while True:  # page by page: one deadline per request, not per listing
            page = await self.call("LIST", self.client.list_objects_v2, Bucket=self.bucket,
                                   Prefix=prefix, **more)
            found.extend(page.get("Contents", []))
            if not page.get("IsTruncated"):
                return found
            more = {"ContinuationToken": page["NextContinuationToken"]}

    async def age(self, key: str) -> float | None:
        """Seconds since ``key`` was last written, on S3's own clock (its Date header
        against the object's LastModified); None when absent."""
        try:
            head = await self.call("HEAD", self.client.head_object, Bucket=self.bucket, Key=key)
        except ChunkNotFound:
            return None
        now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
        return (now - head["LastModified"]).total_seconds()
