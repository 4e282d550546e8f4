"""kvtier's client API: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Tensors in, tensors out; see ``kvtier.client`` for the calls and ``kvstore.codec.
StreamData`` for the tensor layout of a stream.
"""

from kvstore.codec import StreamData
from kvtier.client import AsyncClient
from kvtier.sync import Client
from kvtier.types import RestoredSession, RetryPolicy, SpillResult

__all__ = ["AsyncClient", "Client", "RestoredSession", "RetryPolicy", "SpillResult",
           "StreamData"]
