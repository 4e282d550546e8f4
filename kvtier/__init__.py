"""kvtier's client API: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Tensors in, tensors out; see ``kvtier.client`` for the calls and ``kvstore.format.chunk.
StreamData`` for the tensor layout of a stream. The error classes (``kvtier.SessionNotFound``
...) are those of ``kvstore.format.errors``, the one hierarchy, re-exported as it lists them.
"""

from kvstore.format import errors as _errors
from kvstore.format.errors import *  # noqa: F403  (every class of the one hierarchy)
from kvtier.client import AsyncClient
from kvtier.sync import Client
from kvtier.types import LayoutInfo, RestoredSession, RetryPolicy, SpillResult

__all__ = ["AsyncClient", "Client", "LayoutInfo", "RestoredSession", "RetryPolicy",
           "SpillResult",
           "StreamData", *_errors.__all__]  # noqa: F405  (StreamData: see __getattr__)


def __getattr__(name: str):
    # StreamData holds tensors: importing it imports torch, so only when it is asked for
    # (``kvtier stat`` and ``kvtier list`` import the client and no tensors).
    if name == "StreamData":
        from kvstore.format.chunk import StreamData

        return StreamData
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
