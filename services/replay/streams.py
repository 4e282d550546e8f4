"""Replay jobs spread over several workers through a Redis Streams consumer group.

Client side (a replay backend, same call as ``ReplayWorker.rebuild``)::

    backend = StreamReplay("redis://redis:6379/0")
    result = await backend.rebuild(layout_id, token_ids, chunks, tail, replay_tokens)

Worker side (``kvtier replay-worker --redis-url ...`` runs one)::

    await StreamConsumer(url, worker, consumer="gpu-3").run()

A job is one stream entry (XADD): the ``ReplayRequest`` protobuf (with the layout's JSON)
and the key of its reply list, on the stream of its layout's replayer
(``StreamNames.for_replayer``). Workers of one group take entries with XREADGROUP, so
each job goes to one worker; the worker pushes the reply (LPUSH, with a TTL), then XACKs
and deletes the entry. A job its worker never acknowledged (the worker died) is taken over
by another worker with XAUTOCLAIM once it has been idle ``claim_idle_ms``; after
``max_deliveries`` the job is answered with an error instead of being tried again. The
client waits on its reply list with BLPOP. The client's calls to Redis have deadlines
(``queue_timeout_s`` for the XADD and the connection, ``timeout_s`` more for the reply)
and a circuit breaker (``kvstore.remote.breaker``, dependency "replay-queue"): a job queue that
is unreachable or stalled costs one deadline, then every rebuild fails fast with
``TierUnavailable`` until one call probes it after the cool-down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.format.errors import (
    InvalidRequest,
    KVTierError,
    ServerError,
    TierUnavailable,
    error_for,
    error_name,
    status_name,
)
from kvstore.format.layout import LayoutSpec
from kvstore.remote.breaker import CircuitBreaker
from proto import kvtier_pb2 as pb
from replay.state_codec import Buffer
from replay.worker import ReplayResult
from services.replay.messages import Worker, decode_request, replay_request

log = logging.getLogger(__name__)
REPLY_OK, REPLY_ERROR = b"\x00", b"\x01"  # first byte of a reply list item


@dataclass(frozen=True)
class StreamNames:
    stream: str = "kvtier:replay:jobs"
    group: str = "kvtier-replay"
    reply_prefix: str = "kvtier:replay:reply:"

    @classmethod
    def with_overrides(cls, *, replayer: str = "bundled", **names: str | None) -> StreamNames:
        return replace(cls().for_replayer(replayer), **{k: v for k, v in names.items() if v})

    def for_replayer(self, replayer: str) -> StreamNames:
        """Where jobs of layouts of ``replayer`` go: the bundled model's on ``stream``,
        any other replayer's on ``stream:<replayer>``, so each job reaches a worker that
        runs its model (``kvtier replay-worker --hf-model`` reads
        ``kvtier:replay:jobs:transformers-deepseek-v4``)."""
        return self if replayer == "bundled" else replace(self, stream=f"{self.stream}:{replayer}")


def connect(url: str, *, connect_timeout_s: float = 5.0) -> aioredis.Redis:
    """A client that retries dropped connections (redis-py's own retry) a few times."""
    return aioredis.from_url(url, retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 4),
                             retry_on_error=[RedisConnectionError, RedisTimeoutError],
                             socket_connect_timeout=connect_timeout_s)


class StreamReplay:
    def __init__(self, redis_url: str, *, names: StreamNames = StreamNames(),
                 timeout_s: float = 120.0, queue_timeout_s: float = 5.0,
                 breaker_cooldown_s: float = 5.0) -> None:
        self.redis = connect(redis_url, connect_timeout_s=queue_timeout_s)
        self.names = names
        self.timeout_s, self.queue_timeout_s = timeout_s, queue_timeout_s
        self.breaker = CircuitBreaker("replay-queue", cooldown_s=breaker_cooldown_s)

    def breakers(self) -> list[CircuitBreaker]:
        return [self.breaker]

    async def rebuild(self, layout: str | LayoutSpec, token_ids, chunks: Sequence[Buffer],
                      tail: Buffer, replay_tokens: int | None = None, *,
                      model_fingerprint: str = "") -> ReplayResult:
        request = replay_request(layout, token_ids, chunks, tail, replay_tokens,
                                 model_fingerprint)
        reply_key = self.names.reply_prefix + request.job_id
        stream = (self.names.for_replayer(layout.replayer).stream
                  if isinstance(layout, LayoutSpec) else self.names.stream)
        started = time.perf_counter()
        self.breaker.check()
        wait = max(1, round(self.timeout_s))  # BLPOP takes whole seconds
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await self.redis.xadd(stream, {
                    "request": request.SerializeToString(), "reply_to": reply_key})
            async with asyncio.timeout(wait + self.queue_timeout_s):
                answer: Any = await self.redis.blpop([reply_key], timeout=wait)  # (key, value)
        except (RedisConnectionError, RedisTimeoutError, TimeoutError) as exc:
            self.breaker.failed(f"{exc!r}")
            raise TierUnavailable(f"replay job queue unreachable or stalled: {exc!r}") from exc
        except asyncio.CancelledError:
            self.breaker.cancelled()
            raise
        self.breaker.succeeded()
        if answer is None:
            raise TierUnavailable(f"no replay worker answered job {request.job_id} within "
                                  f"{self.timeout_s:.0f}s")
        reply = parse_reply(answer[1])
        return ReplayResult(reply.window, reply.replayed_tokens, time.perf_counter() - started,
                            reply.batch_size or 1)

    async def close(self) -> None:
        await self.redis.aclose()


def parse_reply(item: bytes) -> pb.ReplayReply:
    kind, body = item[:1], item[1:]
    if kind == REPLY_OK:
        return pb.ReplayReply.FromString(body)
    if kind == REPLY_ERROR:
        error = json.loads(body)
        raise error_for(error["code"], "replay worker: " + error["message"], error["error"])
    raise TierUnavailable(f"unreadable replay reply (first byte {kind!r})")


def error_reply(exc: KVTierError) -> bytes:
    """A job's failure as gRPC would carry it: the status code name and the class name
    from the one table (``kvstore.format.errors``), and the message."""
    return REPLY_ERROR + json.dumps({"code": status_name(exc), "error": error_name(exc),
                                     "message": str(exc)}).encode()


class StreamConsumer:
    """One worker's share of the job stream: claim abandoned jobs, else read new ones."""

    def __init__(self, redis_url: str, worker: Worker, *, consumer: str,
                 names: StreamNames = StreamNames(), claim_idle_ms: int | None = None,
                 block_ms: int = 5000, max_deliveries: int = 3,
                 reply_ttl_s: int = 300) -> None:
        if not consumer:
            raise InvalidRequest("a stream consumer needs a name unique among its group")
        self.redis = connect(redis_url)
        self.worker = worker
        self.consumer = consumer
        self.names = names
        self.claim_idle_ms = 30_000 if claim_idle_ms is None else claim_idle_ms
        self.block_ms = block_ms
        self.max_deliveries = max_deliveries
        self.reply_ttl_s = reply_ttl_s
        self.done = 0
        self._stopping = asyncio.Event()

    async def ensure_group(self) -> None:
        try:
            # from id 0: jobs queued before the first worker started are served too
            await self.redis.xgroup_create(self.names.stream, self.names.group, id="0",
                                           mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def run(self) -> None:
        """Serve until ``stop()``; a Redis outage is waited out, not fatal. (Stop, don't
        cancel: a redis-py command cancelled mid-read can leave the task hanging.)"""
        while not self._stopping.is_set():
            try:
                await self.ensure_group()
                while not self._stopping.is_set():
                    await self.step()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                log.warning("replay job stream unreachable (%s); retrying in 1s", exc)
                await asyncio.sleep(1.0)

    def stop(self) -> None:
        """Finish the job in hand (and the current ``block_ms`` wait), then leave run()."""
        self._stopping.set()

    async def step(self) -> int:
        """Handle the next jobs (an abandoned one first, else up to a batch of new ones);
        returns how many were handled."""
        names = self.names
        _, claimed, _ = await self.redis.xautoclaim(
            names.stream, names.group, self.consumer, self.claim_idle_ms, "0-0", count=1)
        if claimed:
            entry_id, fields = claimed[0]
            if await self._deliveries(entry_id) > self.max_deliveries:
                await self._answer(entry_id, fields, error_reply(TierUnavailable(
                    f"replay job failed on {self.max_deliveries} workers; giving up")))
                return 1
            log.info("taking over replay job %s from a worker that did not finish it",
                     entry_id)
            await self._handle(entry_id, fields)
            return 1
        # Up to a batch of jobs at once: handled together, they share model calls.
        # redis-py's stubs type replies loosely (bytes | str | int): these are RESP2's
        read: Any = await self.redis.xreadgroup(names.group, self.consumer, {names.stream: ">"},
                                           count=self.worker.max_batch, block=self.block_ms)
        entries = [entry for _, batch in read or () for entry in batch]
        await asyncio.gather(*(self._handle(entry_id, fields) for entry_id, fields in entries))
        return len(entries)

    async def _deliveries(self, entry_id) -> int:
        pending: Any = await self.redis.xpending_range(self.names.stream, self.names.group,
                                                  entry_id, entry_id, 1)
        return pending[0]["times_delivered"] if pending else 0

    async def _handle(self, entry_id, fields: dict) -> None:
        try:
            request = pb.ReplayRequest.FromString(fields[b"request"])
            layout, tokens, chunks = decode_request(request)
            result = await self.worker.rebuild(layout, tokens, chunks,
                                               request.tail, request.replay_tokens or None,
                                               model_fingerprint=request.model_fingerprint)
            reply = REPLY_OK + pb.ReplayReply(
                window=result.window, replayed_tokens=result.replayed_tokens,
                seconds=result.seconds, worker=self.consumer,
                batch_size=result.batch_size).SerializeToString()
        except KVTierError as exc:  # the job's fault: answered, not retried
            reply = error_reply(exc)
        except Exception as exc:  # a job always gets an answer and the loop goes on
            log.exception("replay job %s failed", entry_id)
            reply = error_reply(ServerError(f"replay job failed: {exc!r}"))
        await self._answer(entry_id, fields, reply)

    async def _answer(self, entry_id, fields: dict, reply: bytes) -> None:
        names = self.names
        async with self.redis.pipeline(transaction=True) as pipe:
            reply_key = fields.get(b"reply_to")
            if reply_key:
                pipe.lpush(reply_key, reply)
                pipe.expire(reply_key, self.reply_ttl_s)
            pipe.xack(names.stream, names.group, entry_id)
            pipe.xdel(names.stream, entry_id)
            await pipe.execute()
        self.done += 1

    async def close(self) -> None:
        await self.redis.aclose()
