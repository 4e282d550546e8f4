"""kvtier's client API: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Tensors in, tensors out; see ``kvtier.client`` for the calls and ``StreamData`` for the tensor
layout of a stream. The error classes (``kvtier.SessionNotFound`` ...) are those of
``kvstore.format.errors``, the one hierarchy, re-exported as it lists them. Importing kvtier
loads no torch: the calls that make or read tensors do.
"""

from kvstore.format import errors as _errors
from kvstore.format.chunk import StreamData
from kvstore.format.errors import *  # noqa: F403  (every class of the one hierarchy)
from kvtier.client import AsyncClient
from kvtier.request_ids import request_id
from kvtier.routing import RoutingPolicy
from kvtier.sync import Client
from kvtier.types import (
    DeleteResult,
    DrainProgress,
    EvictResult,
    FleetStat,
    ForkResult,
    LayoutInfo,
    NodeLiveness,
    PrefetchResult,
    ReadChunksResult,
    RestoredSession,
    RetryPolicy,
    SessionInfo,
    SessionRef,
    SpillResult,
    StatResult,
    TenantUsage,
    TierStat,
    TokenIds,
    WriteChunksResult,
)

__all__ = ["AsyncClient", "Client", "DeleteResult", "DrainProgress", "EvictResult",
           "FleetStat", "ForkResult", "LayoutInfo", "NodeLiveness", "PrefetchResult",
           "ReadChunksResult", "RestoredSession", "RetryPolicy", "RoutingPolicy",
           "SessionInfo", "SessionRef", "SpillResult", "StatResult", "StreamData",
           "TenantUsage", "TierStat", "TokenIds", "WriteChunksResult", "request_id",
           *_errors.__all__]
