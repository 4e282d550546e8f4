"""The one exception hierarchy of kvtier, and the one table from its classes to gRPC
status codes and back.

Library code raises these. The table names status codes by their ``grpc.StatusCode``
names, so the store stays usable without gRPC: ``services.serving.errors`` (the servers)
and ``kvtier.errors`` (the clients) turn the names into codes and back, and Redis Streams
replay carries the names as they are.
A failed call carries the exception's class name in the ``ERROR_KEY`` trailer, so the peer
raises the very class that was raised (``StaleGeneration``, not just
"FAILED_PRECONDITION"); the status code alone decides when that name is absent.
"""

from __future__ import annotations

from collections.abc import Sequence

ERROR_KEY = "kvtier-error"  # trailing metadata: the class name of the error raised
SHOWN_CHARS = 128  # the most of any client-supplied value an error message echoes


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, clipped to ``limit`` characters of the value:
    a client's 20 kB session id must not come back 20 kB long (nor overflow the status
    details gRPC carries in metadata)."""
    if isinstance(value, str | bytes | bytearray) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} long)"
    text = repr(value)
    return text if len(text) <= limit + 2 else f"{text[:limit]}... ({len(text)} long)"


class KVTierError(Exception):
    """Root of every error kvtier raises on purpose."""

    request_id: str | None = None  # a failed call's, as its trailers named it (client side)

    @classmethod
    def from_message(cls, message: str) -> KVTierError:
        """The error as a peer raises it, knowing only its class and message."""
        return cls(message)


class InvalidRequest(KVTierError):
    """Malformed input: wrong shapes, unknown layout, bad identifiers, oversize messages."""


class LayoutMismatch(InvalidRequest):
    """Data described by one layout was presented under another."""


class UnsupportedModel(InvalidRequest):
    """A model whose cache kvtier cannot store exactly (its type, window or layer kinds,
    an encoder-decoder cache...): refused before anything is sent, whatever the server's
    state, so INVALID_ARGUMENT."""


class UnknownLayout(InvalidRequest):
    """No layout spec is registered under this name or id."""


class SharedMemoryUnavailable(InvalidRequest):
    """A shared-memory segment named in a call cannot be mapped here: the two sides do
    not share a host (or /dev/shm). Clients fall back to sending bytes inline."""


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

    @classmethod
    def from_message(cls, message: str) -> ChunksNotHeld:
        error = cls(())  # a peer learns the message, not the indices
        error.args = (message,)
        return error


class DataLoss(KVTierError):
    """No tier holds an intact copy of something the session needs.

    A read's loss says why, where it knows: ``corrupt``, some tier held a copy that failed
    its checks; ``unavailable``, a tier tried for it could not be reached (neither: no
    tier holds it). A peer learns the message only."""

    def __init__(self, message: str = "", *, corrupt: bool = False,
                 unavailable: bool = False) -> None:
        super().__init__(message)
        self.corrupt = corrupt
        self.unavailable = unavailable


class TierUnavailable(KVTierError):
    """The tier's medium cannot be reached (Redis down, bucket unreachable, disk gone).

    ``whole_tier=False``: only the part of the medium that holds this key is out (the
    Redis Cluster master owning its slot), so the call failed for this key alone and the
    tier keeps serving the others."""

    def __init__(self, message: str = "", *, whole_tier: bool = True) -> None:
        super().__init__(message)
        self.whole_tier = whole_tier


class DeadlineExceeded(TierUnavailable):
    """A call did not end within its deadline (a client's ``timeout_s``, every retry and
    failover counted), or a call that must not be sent twice found its node silent: it may
    have been applied there (the message says which)."""


class IndexCorrupt(TierUnavailable):
    """The disk tier's LMDB index cannot be trusted; ``kvtier repair`` rebuilds it from the
    segments."""


class TierFull(KVTierError):
    """The tier has no room for the value, even after eviction."""


class QuotaExceeded(TierFull):
    """A spill would take its tenant over a configured quota (``kvstore.session.quota``); the
    message names the quota, its limit and the tenant's use."""


class SharedMemoryExhausted(KVTierError):
    """A shared memory lease would pass one of the server's lease bounds (bytes per
    client, bytes in all, leases): no tier is full, the bytes go inline instead."""


class MessageTooLarge(KVTierError):
    """A payload is larger than one gRPC message may carry (``max_message_bytes``): raise
    the limit or use shared memory."""


class StaleGeneration(KVTierError):
    """A writer presented a generation older than the session's current one."""


class GenerationConflict(StaleGeneration):
    """A spill presented the session's current generation with other content than the
    spill stored under it (the same content is an idempotent retry, answered as before)."""


class PermissionDenied(KVTierError):
    """The caller may not use what it named (a dedupe domain not configured for it)."""


class Unauthenticated(KVTierError):
    """The call carried no credential the server accepts (missing, unknown or expired)."""


class Busy(KVTierError):
    """An exclusive operation (such as compaction) already holds the resource."""


class PreconditionFailed(KVTierError):
    """The session's state (or the server's set-up) forbids the operation as asked."""


class MissingChunks(PreconditionFailed):
    """A spill left out chunks the server does not hold: send them and spill again."""


class ReplayUnavailable(PreconditionFailed):
    """Resume needs the session's window rebuilt by bounded replay, and nothing this
    server runs can replay its layout (the layout's replayer is not configured here, or
    replay is off). Restore still returns the persistent part."""


class ModelMismatch(PreconditionFailed):
    """The model a caller or a replayer states is not the one the session was spilled
    with (``model_fingerprint``): its KV would be read, or its window rebuilt, by other
    weights. Nothing of the session is returned or changed."""


class ServerError(KVTierError):
    """The server failed in a way no specific error describes (INTERNAL, UNKNOWN...)."""


# Class -> status code name; most specific first: the first isinstance match decides.
STATUS_NAMES: tuple[tuple[type[KVTierError], str], ...] = (
    (UnsupportedModel, "INVALID_ARGUMENT"),
    (InvalidRequest, "INVALID_ARGUMENT"),
    (NotFound, "NOT_FOUND"),
    (TierFull, "RESOURCE_EXHAUSTED"),
    (SharedMemoryExhausted, "RESOURCE_EXHAUSTED"),
    (MessageTooLarge, "RESOURCE_EXHAUSTED"),
    (StaleGeneration, "FAILED_PRECONDITION"),
    (PermissionDenied, "PERMISSION_DENIED"),
    (Unauthenticated, "UNAUTHENTICATED"),
    (ReplayUnavailable, "FAILED_PRECONDITION"),
    (PreconditionFailed, "FAILED_PRECONDITION"),
    (DataLoss, "DATA_LOSS"),
    (CodecError, "DATA_LOSS"),
    (DeadlineExceeded, "DEADLINE_EXCEEDED"),
    (TierUnavailable, "UNAVAILABLE"),
    (Busy, "ABORTED"),
)
UNEXPECTED = "INTERNAL"  # ServerError, a bare KVTierError, and anything not ours

# Status code name -> the class raised when the peer named none (or one unknown here).
CLASS_FOR_STATUS: dict[str, type[KVTierError]] = {
    "INVALID_ARGUMENT": InvalidRequest,
    "NOT_FOUND": SessionNotFound,
    # Our own RESOURCE_EXHAUSTED always names its class; without a name it is gRPC's
    # refusal of a message over the size limit: the request was too big.
    "RESOURCE_EXHAUSTED": InvalidRequest,
    "FAILED_PRECONDITION": StaleGeneration,
    "DATA_LOSS": DataLoss,
    "UNAVAILABLE": TierUnavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "ABORTED": Busy,
    "PERMISSION_DENIED": PermissionDenied,
    "UNAUTHENTICATED": Unauthenticated,
}

# Every class above by name, as the ERROR_KEY trailer names it.
ERROR_CLASSES: dict[str, type[KVTierError]] = {
    name: cls for name, cls in list(globals().items())
    if isinstance(cls, type) and issubclass(cls, KVTierError)
}
# What ``from kvstore.format.errors import *`` re-exports (kvtier does): every class, one list.
__all__ = [*ERROR_CLASSES, "ERROR_KEY"]


def status_name(exc: BaseException) -> str:
    """The status code name a failed call reports for ``exc``."""
    for cls, name in STATUS_NAMES:
        if isinstance(exc, cls):
            return name
    return UNEXPECTED


def error_name(exc: BaseException) -> str:
    """What the ERROR_KEY trailer names: the class, or ServerError when it is not ours."""
    return type(exc).__name__ if isinstance(exc, KVTierError) else ServerError.__name__


def error_for(status: str, details: str, name: str | None = None) -> KVTierError:
    """The exception a peer raises for a failed call: the class ``name`` names, else the
    one ``status`` (a status code name) stands for."""
    cls = ERROR_CLASSES.get(name or "") or CLASS_FOR_STATUS.get(status, ServerError)
    return cls.from_message(f"{status}: {details}")
