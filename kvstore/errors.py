"""The one exception hierarchy of kvtier.

Library code raises these; only the gRPC servicer boundary maps them to status codes
(see ``kvtier/errors.py``), so the store stays usable without gRPC.
"""

from collections.abc import Sequence


class KVTierError(Exception):
    """Root of every error kvtier raises on purpose."""


class InvalidRequest(KVTierError):
    """Malformed input: wrong shapes, unknown layout, bad identifiers, oversize messages."""


class LayoutMismatch(InvalidRequest):
    """Data described by one layout was presented under another."""


class UnknownLayout(InvalidRequest):
    """No layout spec is registered under this name or id."""


class CodecError(KVTierError):
    """A chunk buffer could not be decoded."""


class ChunkCorrupt(CodecError):
    """The bytes fail their checksum or structural checks: never decode them into a tensor."""


class ChunkTruncated(ChunkCorrupt):
    """The buffer ends before the header or a section says it should."""


class UnsupportedVersion(CodecError):
    """The chunk was written by a format version this build cannot read."""


class NotFound(KVTierError):
    """Base for lookups that found nothing."""


class SessionNotFound(NotFound):
    """No manifest exists for this tenant and session id."""


class ChunkNotFound(NotFound):
    """This tier (or every tier) holds no copy of the chunk."""


class ChunksNotHeld(ChunkNotFound):
    """A spill named chunks by key only (no bytes) that no tier holds intact: nothing was
    stored; spill again with their bytes."""

    def __init__(self, indices: Sequence[int]) -> None:
        self.indices = tuple(indices)
        shown = ", ".join(map(str, self.indices[:10])) + (" ..." if len(self.indices) > 10
                                                           else "")
        super().__init__(f"{len(self.indices)} chunks were named without bytes and no tier "
                         f"holds them (indices {shown}): send them")


class DataLoss(KVTierError):
    """No tier holds an intact copy of something the session needs."""


class TierUnavailable(KVTierError):
    """The tier's medium cannot be reached (Redis down, bucket unreachable, disk gone)."""


class TierFull(KVTierError):
    """The tier has no room for the value, even after eviction."""


class StaleGeneration(KVTierError):
    """A writer presented a generation older than the session's current one."""


class Busy(KVTierError):
    """An exclusive operation (such as compaction) already holds the resource."""
