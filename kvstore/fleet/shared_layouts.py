"""A fleet's registered layouts in the object store, so a layout registered on one node is
known to every node (docs/fleet.md "Layouts").

One object per layout name, ``<prefix>fleet/layouts/<name>.json``, holding the layout's
canonical JSON (``kvstore.format.layout.layout_to_json``). Written once, with ``If-None-Match:
*``: a name is the fleet's for good, so the only conflict is a name clash (another node
registered another layout under it), which the writer sees as the bytes already there.
Keyed by name rather than by id so that a clash is decided by the store's conditional
PUT, not by two nodes' reads. Raw bytes here; what they must be is the server's to check
(``services.server.layout_registry``), and every read is bounded (``max_bytes``, ``max_names``).
"""

from __future__ import annotations

import logging

from kvstore.fleet.bucket import BucketIO
from kvstore.format.errors import ChunkNotFound, StaleGeneration

log = logging.getLogger(__name__)
SUFFIX = ".json"


class BucketLayouts:
    def __init__(self, io: BucketIO, root: str, *, max_bytes: int, max_names: int) -> None:
        """``root``: the fleet's prefix (``<s3_prefix>fleet/``)."""
        self.io = io
        self.prefix = root + "layouts/"
        self.max_bytes = max_bytes
        self.max_names = max_names

    def key(self, name: str) -> str:
        return self.prefix + name + SUFFIX

    async def put_new(self, name: str, body: bytes) -> bytes | None:
        """Store ``body`` under ``name`` unless the name is taken: None when this call
        wrote it, else the bytes already there."""
        try:
            await self.io.put(self.key(name), body, if_absent=True)
            return None
        except StaleGeneration:  # 412: the name is taken
            found = await self.get(name)
            return b"" if found is None else found  # b"": taken by an unreadable object

    async def get(self, name: str) -> bytes | None:
        """The bytes stored under ``name`` (None: none, or more than ``max_bytes``)."""
        try:
            response = await self.io.call("GET", self.io.client.get_object,
                                          Bucket=self.io.bucket, Key=self.key(name))
        except ChunkNotFound:
            return None
        body = response["Body"]
        try:
            if response.get("ContentLength", 0) > self.max_bytes:
                log.warning("fleet layout object %s holds %s bytes, more than a layout may: "
                            "ignored", self.key(name), response["ContentLength"])
                return None
            return await self.io.read(body, self.max_bytes + 1)
        finally:
            body.close()

    async def names(self) -> list[str]:
        """The names stored (at most ``max_names``; the objects of at most ``max_bytes``)."""
        response = await self.io.call("LIST", self.io.client.list_objects_v2,
                                      Bucket=self.io.bucket, Prefix=self.prefix,
                                      MaxKeys=self.max_names)
        if response.get("IsTruncated"):
            log.warning("the fleet holds more than %d layouts under %s: listing the first",
                        self.max_names, self.prefix)
        return [item["Key"][len(self.prefix):-len(SUFFIX)]
                for item in response.get("Contents", [])
                if item["Key"].endswith(SUFFIX) and item["Size"] <= self.max_bytes]
