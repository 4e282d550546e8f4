"""Bounds on what clients hold open on the server, so no client (or many) can take its
memory or its event loop: streams open per connection and in all (Spill, Restore,
Resume), how long a Spill stream may send nothing, and the bytes of spills not yet
committed, per tenant and in all. Past a bound the call ends with ``TierFull``
(RESOURCE_EXHAUSTED) naming the config key and its limit.

    with limits.stream(peer, "Spill"), limits.in_flight() as flight:
        async for message in idle_bounded(requests, limits.idle_s):
            flight.reserve(tenant, len(data))      # released when the call ends

Everything runs on the server's event loop: plain counters, no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore.format.errors import TierFull

T = TypeVar("T")


@dataclass(frozen=True)
class Bounds:
    max_streams: int  # Spill, Restore and Resume streams open at once, all clients
    max_peer_streams: int  # the same, one connection
    stream_idle_s: float  # a Spill stream silent this long is cancelled
    max_inflight_bytes: int  # bytes of uncommitted spills held, all tenants
    max_tenant_inflight_bytes: int  # the same, one tenant

    @classmethod
    def from_config(cls, config: object) -> Bounds:
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})


def s3_pool_connections(config: Any) -> int:  # a ServerConfig (or its fields)
    """boto3's connection pool for the object tier of a server with ``config``: one
    connection per stream it may hold open (a fleet's metadata read holds its connection
    until the body is read) and one per part of each of the tier's calls
    (``ObjectTierConfig.pool_connections``), so the pool is never full ("Connection pool
    is full, discarding connection")."""
    from kvstore.tiers.object_media import ObjectTierConfig

    return config.max_streams + ObjectTierConfig().pool_connections


class Limits:
    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.streams = 0
        self.peer_streams: Counter[str] = Counter()
        self.inflight_bytes = 0
        self.tenant_bytes: Counter[str] = Counter()

    @property
    def idle_s(self) -> float:
        return self.bounds.stream_idle_s

    @contextlib.contextmanager
    def stream(self, peer: str, method: str) -> Iterator[None]:
        """Hold one stream slot of ``peer`` for the block, or refuse the call."""
        b = self.bounds
        if self.streams >= b.max_streams:
            raise TierFull(f"{method} refused: {self.streams} streams are open on this "
                           f"server, the limit (max_streams = {b.max_streams})")
        if self.peer_streams[peer] >= b.max_peer_streams:
            raise TierFull(f"{method} refused: this connection has {self.peer_streams[peer]} "
                           f"streams open, the limit (max_peer_streams = "
                           f"{b.max_peer_streams})")
        self.streams += 1
        self.peer_streams[peer] += 1
        try:
            yield
        finally:
            self.streams -= 1
            self.peer_streams[peer] -= 1
            if not self.peer_streams[peer]:
                del self.peer_streams[peer]

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[InFlight]:
        """A call's reservation of in-flight bytes, released whole when the block ends."""
        flight = InFlight(self)
        try:
            yield flight
        finally:
            flight.release()


class InFlight:
    """The bytes one call holds; ``reserve`` refuses what would pass a bound."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.held: Counter[str] = Counter()

    def reserve(self, tenant: str, nbytes: int) -> None:
        limits, b = self.limits, self.limits.bounds
        if limits.tenant_bytes[tenant] + nbytes > b.max_tenant_inflight_bytes:
            raise TierFull(f"tenant {tenant} would hold {limits.tenant_bytes[tenant] + nbytes} "
                           f"B of uncommitted spills, over the limit "
                           f"(max_tenant_inflight_bytes = {b.max_tenant_inflight_bytes})")
        if limits.inflight_bytes + nbytes > b.max_inflight_bytes:
            raise TierFull(f"the server would hold {limits.inflight_bytes + nbytes} B of "
                           f"uncommitted spills, over the limit (max_inflight_bytes = "
                           f"{b.max_inflight_bytes})")
        limits.tenant_bytes[tenant] += nbytes
        limits.inflight_bytes += nbytes
        self.held[tenant] += nbytes

    def release(self) -> None:
        limits = self.limits
        for tenant, nbytes in self.held.items():
            limits.inflight_bytes -= nbytes
            limits.tenant_bytes[tenant] -= nbytes
            if not limits.tenant_bytes[tenant]:
                del limits.tenant_bytes[tenant]
        self.held.clear()


async def idle_bounded(messages: AsyncIterator[T], idle_s: float, method: str
                       ) -> AsyncIterator[T]:
    """``messages``, cancelled with ``TierFull`` once the client sends nothing for
    ``idle_s`` seconds (an open stream it never finishes holds a slot and its bytes)."""
    iterator = aiter(messages)
    while True:
        try:
            async with asyncio.timeout(idle_s):
                message = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise TierFull(f"{method} cancelled: the client sent nothing for {idle_s} s "
                           f"(stream_idle_s = {idle_s})") from None
        yield message
