"""kvtier's client API: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Tensors in, tensors out; see ``kvtier.client`` for the calls and ``kvstore.codec.
StreamData`` for the tensor layout of a stream. The error classes (``kvtier.SessionNotFound``
...) are those of ``kvstore.errors``, imported from there so naming them imports no gRPC.
"""

from kvstore.errors import (
    Busy,
    ChunkCorrupt,
    ChunkNotFound,
    ChunksNotHeld,
    ChunkTruncated,
    CodecError,
    DataLoss,
    GenerationConflict,
    IndexCorrupt,
    InvalidRequest,
    KVTierError,
    LayoutMismatch,
    MissingChunks,
    NotFound,
    PermissionDenied,
    PreconditionFailed,
    QuotaExceeded,
    ServerError,
    SessionNotFound,
    SharedMemoryUnavailable,
    StaleGeneration,
    TierFull,
    TierUnavailable,
    Unauthenticated,
    UnknownLayout,
    UnsupportedVersion,
)
from kvtier.client import AsyncClient
from kvtier.sync import Client
from kvtier.types import RestoredSession, RetryPolicy, SpillResult

__all__ = ["AsyncClient", "Client", "RestoredSession", "RetryPolicy", "SpillResult",
           "StreamData"]
__all__ += [
    "Busy",
    "ChunkCorrupt",
    "ChunkNotFound",
    "ChunkTruncated",
    "ChunksNotHeld",
    "CodecError",
    "DataLoss",
    "GenerationConflict",
    "IndexCorrupt",
    "InvalidRequest",
    "KVTierError",
    "LayoutMismatch",
    "MissingChunks",
    "NotFound",
    "PermissionDenied",
    "PreconditionFailed",
    "QuotaExceeded",
    "ServerError",
    "SessionNotFound",
    "SharedMemoryUnavailable",
    "StaleGeneration",
    "TierFull",
    "TierUnavailable",
    "Unauthenticated",
    "UnknownLayout",
    "UnsupportedVersion",
]


def __getattr__(name: str):
    # StreamData holds tensors: importing it imports torch, so only when it is asked for
    # (``kvtier stat`` and ``kvtier list`` import the client and no tensors).
    if name == "StreamData":
        from kvstore.codec import StreamData

        return StreamData
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
