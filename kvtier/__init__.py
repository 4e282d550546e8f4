"""kvtier's client API: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Tensors in, tensors out; see ``services.client`` for the calls and ``kvstore.codec.
StreamData`` for the tensor layout of a stream.
"""

from kvstore.codec import StreamData
from services.client import AsyncClient
from services.client_sync import Client
from services.client_types import RestoredSession, RetryPolicy, SpillResult

__all__ = ["AsyncClient", "Client", "RestoredSession", "RetryPolicy", "SpillResult",
           "StreamData"]
