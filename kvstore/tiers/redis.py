"""The Redis tier: one Redis key per value, single node or Redis Cluster, through redis-py's
asyncio clients.

Each value is written by a single ``SET`` (``PX`` for a TTL): a reader sees the old value
or the new one, never part of one. Keys are ``config.prefix + key``; with a cluster the
prefix must not contain a ``{hash tag}`` (every value would land on one slot).

Outages: redis-py's ``Retry`` retries transient connection errors with backoff; when it
gives up, or ``op_timeout_s`` passes, the call raises ``TierUnavailable`` and the pool
reconnects on a later call. A failure of the whole tier opens the circuit breaker
(``self.breaker``, ``kvstore.remote.breaker``): calls fail fast for
``breaker_cooldown_s``, then one probes Redis again. With a cluster, when a call on one
key fails and another master still reports ``cluster_state:ok``, the error says
``whole_tier=False`` and the stack keeps using Redis for other keys (run clusters without
replicas with ``cluster-require-full-coverage no``, or a failed master stops every slot).

Accounting is exact for what this instance wrote and has not deleted (sizes it set,
dropped on delete, on finding the key missing, or at its TTL). Another writer on the
namespace, or Redis' own ``maxmemory`` eviction, is seen only when the key is next read;
``resync()`` rebuilds the accounting from every key under the prefix.

Every call is timed and reported, with its error's kind, to ``self.observer``
(``kvstore.remote.observe``, dependency "redis").

With ``chain_index`` (a fleet's shared hot tier) a chunk put also sets
``config.prefix + "chain/" + <chain key>`` to the digest of its bytes, with the same TTL;
a delete removes it if it still names that digest. ``find_chains`` reads them
(``kvstore.prefix.fleet_lookup``). Pointers are neither counted in ``used_bytes`` nor listed.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from kvstore.format.errors import ChunkNotFound, InvalidRequest, TierFull, TierUnavailable
from kvstore.format.keys import split_block_key
from kvstore.remote.breaker import CircuitBreaker
from kvstore.remote.observe import IGNORE, op_name
from kvstore.tiers.base import Buffer, Tier, TierStats
from kvstore.tiers.common import Availability, as_byte_view, check_key, without_password

log = logging.getLogger(__name__)
T = TypeVar("T")

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

# The medium is unreachable or refusing service: fall through to other tiers.
_UNAVAILABLE_ERRORS = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.ClusterError,
    rexc.ClusterDownError,
    rexc.TryAgainError,
    rexc.ReadOnlyError,
    rexc.RedisClusterException,
    TimeoutError,
    OSError,
)

_REDIS_PACKAGE = Path(rexc.__file__).parent


def _dead_connection(exc: AttributeError) -> bool:
    """An AttributeError raised inside redis-py itself: a command written to a connection
    that a failover just closed (its writer is None) escapes as one (redis/redis-py#4287)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).is_relative_to(_REDIS_PACKAGE)


# STRLEN then DEL in one step, so delete reports the bytes the medium really freed.
_DELETE_SCRIPT = "local n = redis.call('STRLEN', KEYS[1]) redis.call('DEL', KEYS[1]) return n"
# A chain pointer goes only if it still names the deleted chunk's digest (not a newer one).
_UNPOINT_SCRIPT = ("if redis.call('GET', KEYS[1]) == ARGV[1] then "
                   "return redis.call('DEL', KEYS[1]) end return 0")
CHAIN_PREFIX = "chain/"  # under config.prefix: chain key -> digest hex of a chunk held


@dataclass(frozen=True)
class RedisTierConfig:
    prefix: str = "kvtier:"
    cluster: bool | None = None  # None: chosen by the URL scheme (redis+cluster://)
    connect_timeout_s: float = 0.5
    socket_timeout_s: float = 2.0
    retries: int = 2  # redis-py Retry attempts after the first failure
    backoff_base_s: float = 0.02
    backoff_cap_s: float = 0.25
    op_timeout_s: float = 5.0  # hard bound on one operation, retries included
    breaker_cooldown_s: float = 5.0  # failing fast after an outage, before a probe
    max_connections: int = 32
    default_ttl_s: float | None = None
    scan_batch: int = 1000
    chain_index: bool = False  # keep chain pointers (a fleet's shared hot tier; above)


REDIS_PRESETS = {
    # Same host or rack: fail fast, the other tiers answer instead.
    "loopback": RedisTierConfig(connect_timeout_s=0.25, socket_timeout_s=1.0, op_timeout_s=2.0),
    "datacenter": RedisTierConfig(),
    # A managed service across a region: slower links, more patience.
    "remote": RedisTierConfig(connect_timeout_s=2.0, socket_timeout_s=5.0, retries=3,
                              backoff_cap_s=1.0, op_timeout_s=15.0),
}


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


class RedisTier(Tier):
    name: ClassVar[str] = "redis"

    def __init__(self, url: str, capacity_bytes: int, config: RedisTierConfig | None = None,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(capacity_bytes)
        # The accounting's clock for TTL deadlines; Redis expires keys by its own.
        self.clock = clock
        self.config = config = config or RedisTierConfig()
        parts = urlsplit(url)
        self.cluster = parts.scheme in CLUSTER_SCHEMES if config.cluster is None \
            else config.cluster
        if parts.scheme in CLUSTER_SCHEMES:
            url = urlunsplit(parts._replace(scheme=CLUSTER_SCHEMES[parts.scheme]))
        elif parts.scheme not in ("redis", "rediss", "unix"):
            raise InvalidRequest(f"not a Redis URL: {without_password(url)!r}")
        if self.cluster and "{" in config.prefix:
            raise InvalidRequest(f"a cluster prefix must not hold a hash tag: {config.prefix!r}")
        self.url = url
        retry = Retry(ExponentialWithJitterBackoff(cap=config.backoff_cap_s,
                                                   base=config.backoff_base_s),
                      config.retries)
        common: dict[str, Any] = dict(socket_connect_timeout=config.connect_timeout_s,
                      socket_timeout=config.socket_timeout_s, retry=retry,
                      max_connections=config.max_connections)
        self._client: aioredis.Redis | RedisCluster = (
            RedisCluster.from_url(url, **common) if self.cluster
            else aioredis.Redis.from_url(url, **common))
        self._delete_script = self._client.register_script(_DELETE_SCRIPT)
        self._unpoint_script = self._client.register_script(_UNPOINT_SCRIPT)
        self._sizes: dict[str, int] = {}
        self._used = 0
        self._reserved = 0  # bytes of puts in flight, so concurrent puts cannot overfill
        self._expiry: dict[str, float] = {}
        self._expiry_heap: list[tuple[float, str]] = []
        self.health = Availability(log, f"redis tier at {without_password(self.url)}")
        self.breaker = CircuitBreaker("redis", cooldown_s=config.breaker_cooldown_s)
        self.observer = IGNORE

    # -- accounting --

    @property
    def used_bytes(self) -> int:
        self._purge_expired()
        return self._used

    def _account(self, key: str, nbytes: int, ttl_s: float | None, started: float) -> None:
        self._used += nbytes - self._sizes.get(key, 0)
        self._sizes[key] = nbytes
        if ttl_s is None:
            self._expiry.pop(key, None)
        else:
            # Redis counts the TTL from when it ran the SET, just after ``started``: the
            # accounting may drop the key up to one round trip before Redis does.
            deadline = started + ttl_s
            self._expiry[key] = deadline
            heapq.heappush(self._expiry_heap, (deadline, key))

    def _forget(self, key: str) -> int:
        self._expiry.pop(key, None)
        nbytes = self._sizes.pop(key, 0)
        self._used -= nbytes
        return nbytes

    def _purge_expired(self) -> None:
        now = self.clock()
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            deadline, key = heapq.heappop(self._expiry_heap)
            if self._expiry.get(key) == deadline:
                self._forget(key)

    # -- calls to the medium --

    async def _call(self, what: str, operation: Callable[[], Awaitable[T]],
                    redis_key: str | None = None) -> T:
        """Run one call (timed); ``redis_key``: the one key it touches, if it touches one."""
        started, kind = time.perf_counter(), None
        try:
            return await self._attempt(what, operation, redis_key)
        except TierFull:
            raise  # Redis answered
        except TierUnavailable as exc:
            cause = exc.__cause__
            kind = ("timeout" if isinstance(cause, TimeoutError | rexc.TimeoutError) else
                    "unavailable" if cause is None or isinstance(cause, _UNAVAILABLE_ERRORS)
                    else "other")  # e.g. WRONGTYPE: foreign data under our prefix
            raise
        finally:
            self.observer.request("redis", op_name(what), time.perf_counter() - started)
            if kind is not None:
                self.observer.error("redis", op_name(what), kind)

    async def _unavailable(self, what: str, exc: BaseException,
                           redis_key: str | None) -> TierUnavailable:
        """The error a failed call raises: for this key only when the cluster serves others."""
        self.health.failed(what, exc)
        if redis_key is not None and await self._others_serve(redis_key):
            self.breaker.succeeded()  # the cluster answers; one master is out
            return TierUnavailable(f"redis {what} failed for this key (the cluster serves "
                                   f"others): {exc!r}", whole_tier=False)
        self.breaker.failed(f"{what}: {exc!r}")
        return TierUnavailable(f"redis {what} failed: {exc!r}")

    async def _attempt(self, what: str, operation: Callable[[], Awaitable[T]],
                       redis_key: str | None) -> T:
        try:
            self.breaker.check()
        except TierUnavailable as exc:
            self.health.failed(what, exc)
            raise
        try:
            async with asyncio.timeout(self.config.op_timeout_s):
                result = await operation()
        except rexc.OutOfMemoryError as exc:
            self.breaker.succeeded()  # Redis answered
            raise TierFull(f"redis refused {what}: {exc}") from exc
        except _UNAVAILABLE_ERRORS as exc:
            raise await self._unavailable(what, exc, redis_key) from exc
        except AttributeError as exc:
            if not _dead_connection(exc):
                raise
            raise await self._unavailable(what, exc, redis_key) from exc
        except rexc.RedisError as exc:  # e.g. WRONGTYPE: foreign data under our prefix
            self.breaker.succeeded()
            raise TierUnavailable(f"redis refused {what}: {exc}") from exc
        except asyncio.CancelledError:
            self.breaker.cancelled()
            raise
        self.health.succeeded()
        self.breaker.succeeded()
        return result

    async def _others_serve(self, redis_key: str) -> bool:
        """With a cluster: whether a master other than the one owning ``redis_key``'s slot
        answers and reports ``cluster_state:ok`` (asked of all at once, so a whole cluster
        out costs one socket timeout more, once per cooldown of the tier stack)."""
        if not isinstance(self._client, RedisCluster):
            return False
        try:
            node = self._client.get_node_from_key(redis_key)
            owner = None if node is None else node.name
        except (rexc.RedisError, IndexError, KeyError):  # its slot has no known master
            owner = None
        others = [node for node in self._client.get_primaries() if node.name != owner]
        return any(await asyncio.gather(*map(self._serving, others)))

    async def _serving(self, node: ClusterNode) -> bool:
        try:
            async with asyncio.timeout(self.config.socket_timeout_s):
                info = await node.execute_command("CLUSTER INFO")
        except (*_UNAVAILABLE_ERRORS, rexc.RedisError):
            return False
        return isinstance(info, dict) and info.get("cluster_state") == "ok"  # parsed reply

    def _redis_key(self, key: str) -> str:
        return self.config.prefix + check_key(key)

    def _pointer(self, key: str) -> tuple[str, str] | None:
        """(the chain pointer's Redis key, digest hex) for a chunk's block key with
        ``chain_index``; None otherwise (a window blob, no index)."""
        if not self.config.chain_index:
            return None
        try:
            chain, digest = split_block_key(key)
        except InvalidRequest:
            return None
        return self.config.prefix + CHAIN_PREFIX + chain, digest.hex()

    async def _both(self, first: Awaitable[T], pointer: Awaitable[object] | None) -> T:
        """``first`` with a pointer update beside it in flight (one round trip for both);
        a pointer that fails is dropped: lookups then find the chunk in the bucket."""
        if pointer is None:
            return await first
        result, moved = await asyncio.gather(first, pointer, return_exceptions=True)
        if isinstance(moved, Exception):
            log.debug("redis chain pointer update failed: %r", moved)
        if isinstance(result, BaseException):
            raise result
        return result

    # -- Tier interface --

    async def put(self, key: str, value: Buffer, *, ttl_s: float | None = None) -> None:
        redis_key = self._redis_key(key)
        ttl_s = self.config.default_ttl_s if ttl_s is None else ttl_s
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidRequest(f"ttl_s must be > 0, got {ttl_s}")
        view = as_byte_view(value)
        nbytes = len(view)
        growth = nbytes - self._sizes.get(key, 0)
        if self.used_bytes + self._reserved + growth > self.capacity_bytes:
            raise TierFull(f"redis: {nbytes} B does not fit ({self.free_bytes} B free of "
                           f"{self.capacity_bytes} B)")
        px = None if ttl_s is None else max(1, math.ceil(ttl_s * 1000))
        self._reserved += nbytes
        started = self.clock()
        pointer = self._pointer(key)
        try:
            await self._call("SET", lambda: self._both(
                self._client.set(redis_key, view, px=px),
                pointer and self._client.set(pointer[0], pointer[1], px=px)), redis_key)
        finally:
            self._reserved -= nbytes
        self._account(key, nbytes, ttl_s, started)

    async def get(self, key: str) -> Buffer:
        redis_key = self._redis_key(key)
        value = await self._call("GET", lambda: self._client.get(redis_key), redis_key)
        if value is None:
            self._forget(key)  # expired, evicted by Redis, or deleted by another writer
            raise ChunkNotFound(f"redis: no value under {key!r}")
        assert isinstance(value, bytes)  # the clients do not decode responses
        if self._sizes.get(key, len(value)) != len(value):
            self._used += len(value) - self._sizes[key]  # another writer replaced it
            self._sizes[key] = len(value)
        return value

    async def delete(self, key: str) -> int:
        redis_key = self._redis_key(key)
        pointer = self._pointer(key)
        freed = await self._call("DEL", lambda: self._both(
            self._delete_script(keys=[redis_key]),
            pointer and self._unpoint_script(keys=[pointer[0]], args=[pointer[1]])),
            redis_key)
        self._forget(key)
        return int(freed)

    async def contains(self, key: str) -> bool:
        redis_key = self._redis_key(key)
        self.probes["EXISTS"] += 1
        present = bool(await self._call("EXISTS", lambda: self._client.exists(redis_key),
                                        redis_key))
        if not present:
            self._forget(key)
        return present

    async def keys(self) -> AsyncIterator[str]:
        """Every key under the prefix, whoever wrote it."""
        prefix_len = len(self.config.prefix)
        pattern = _glob_escape(self.config.prefix) + "*"
        iterator = self._client.scan_iter(match=pattern, count=self.config.scan_batch)
        while True:
            try:
                redis_key = await self._call("SCAN", iterator.__anext__)
            except StopAsyncIteration:
                return
            key = redis_key.decode()[prefix_len:]
            if not key.startswith(CHAIN_PREFIX):
                yield key

    async def _pipelined(self, command: str, redis_keys: list[str]) -> list[object]:
        """``command`` on each key in one pipeline: one round trip (with a cluster, one
        per master, all at once)."""
        async def run() -> list[object]:
            pipe = self._client.pipeline(transaction=False)
            for redis_key in redis_keys:
                pipe.execute_command(command, redis_key)
            return await pipe.execute()

        self.probes[command] += len(redis_keys)
        self.probes["round trip"] += 1
        return await self._call(command, run, redis_keys[0])

    async def find_chains(self, chains: Sequence[str]) -> list[str | None]:
        """The chunk held under each chain key: its pointer's digest (one pipeline of
        GETs), confirmed by EXISTS of the chunk itself (a second pipeline), so an
        evicted or expired chunk whose pointer outlived it is not reported."""
        if not chains:
            return []
        digests = await self._pipelined("GET", [self.config.prefix + CHAIN_PREFIX + chain
                                                for chain in chains])
        found: list[str | None] = []
        for chain, digest in zip(chains, digests, strict=True):
            key = None
            if isinstance(digest, bytes):
                try:
                    key = chain + "." + bytes.fromhex(digest.decode()).hex()
                    split_block_key(key)
                except (ValueError, InvalidRequest):  # not a pointer of ours
                    key = None
            found.append(key)
        asked = [key for key in found if key is not None]
        if not asked:
            return found
        present = iter(await self._pipelined("EXISTS", [self.config.prefix + key
                                                        for key in asked]))
        return [key if key is not None and next(present) else None for key in found]

    async def ttl_s(self, key: str) -> float | None:
        """Time left before ``key`` expires; None when it has no TTL."""
        redis_key = self._redis_key(key)
        millis = await self._call("PTTL", lambda: self._client.pttl(redis_key), redis_key)
        if millis == -2:
            raise ChunkNotFound(f"redis: no value under {key!r}")
        return None if millis == -1 else millis / 1000

    async def resync(self) -> int:
        """Rebuild the accounting from every key under the prefix; return ``used_bytes``."""
        keys = [key async for key in self.keys()]
        sizes: dict[str, int] = {}
        ttls: dict[str, int] = {}
        batch = self.config.scan_batch
        for start in range(0, len(keys), batch):
            chunk = keys[start:start + batch]

            async def measure(chunk: list[str] = chunk) -> list[int]:
                pipe = self._client.pipeline()
                for key in chunk:
                    pipe.strlen(self.config.prefix + key)
                    pipe.pttl(self.config.prefix + key)
                return await pipe.execute()

            replies = await self._call("STRLEN/PTTL", measure)
            for index, key in enumerate(chunk):
                strlen, pttl = replies[2 * index], replies[2 * index + 1]
                if pttl != -2:  # gone since the scan
                    sizes[key] = strlen
                    ttls[key] = pttl
        now = self.clock()
        self._sizes, self._used = {}, 0
        self._expiry, self._expiry_heap = {}, []
        for key, nbytes in sizes.items():
            self._account(key, nbytes, None if ttls[key] < 0 else ttls[key] / 1000, now)
        return self._used

    async def stats(self) -> TierStats:
        """Counts what this tier wrote (cheap, no scan); ``available`` is the last call's."""
        used = self.used_bytes
        return TierStats(self.name, self.capacity_bytes, used, len(self._sizes),
                         self.health.available and not self.breaker.is_open)

    async def ping(self) -> bool:
        """True when Redis answers now; never raises."""
        try:
            return bool(await self._call("PING", self._client.ping))
        except TierUnavailable:
            return False

    async def probe(self) -> bool:
        """Whether Redis serves now, asked through the breaker (so a timer calling this
        half-opens an open breaker after its cool-down, no request needed): PING, and with
        a cluster ``CLUSTER INFO`` of every master, up while one reports
        ``cluster_state:ok`` (a cluster in ``fail`` still answers PING). Never raises."""
        async def ask() -> bool:
            if not isinstance(self._client, RedisCluster):
                return bool(await self._client.ping())
            await self._client.initialize()  # a cluster down at start has no masters yet
            if not any(await asyncio.gather(*map(self._serving,
                                                 self._client.get_primaries()))):
                raise rexc.ClusterDownError("no master reports cluster_state:ok")
            return True

        try:
            return await self._call("PROBE", ask)
        except TierUnavailable:
            return False

    async def check_access(self) -> None:
        """``InvalidRequest`` when Redis answers but refuses this tier: a wrong password
        or user in the URL, or a ``redis+cluster://`` URL pointed at a Redis that is not
        a cluster. A Redis that does not answer is not refused: the tier
        starts down and the probes see it come up."""
        where = without_password(self.url)
        try:
            async with asyncio.timeout(self.config.op_timeout_s):
                if self.cluster:
                    await self._client.initialize()
                await self._client.ping()
        except (rexc.AuthenticationError, rexc.AuthorizationError,
                rexc.NoPermissionError) as exc:
            raise InvalidRequest(f"redis_url {where}: Redis refuses the credentials "
                                 f"({exc}): fix the user and password in redis_url") from None
        except rexc.RedisClusterException as exc:
            if "cluster mode is not enabled" not in str(exc).lower():
                raise InvalidRequest(f"redis_url {where}: the cluster refuses this tier "
                                     f"({exc})") from None
            raise InvalidRequest(f"redis_url {where} names a Redis Cluster (redis+cluster://) "
                                 "but that Redis is not a cluster: use redis:// for a "
                                 "single Redis") from None
        except rexc.ResponseError as exc:
            raise InvalidRequest(f"redis_url {where}: Redis refuses this tier ({exc})") from None
        except (*_UNAVAILABLE_ERRORS, rexc.RedisError) as exc:
            log.warning("redis tier at %s does not answer at start (%r): it starts down "
                        "and serves once Redis answers", where, exc)

    async def close(self) -> None:
        await self._client.aclose()
