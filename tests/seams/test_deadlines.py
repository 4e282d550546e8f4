"""Remote dependencies that stall (stopped by SIGSTOP: connections are accepted, nothing
answers) cost at most their deadline, then fail fast behind a circuit breaker that marks
the tier down, and recover after the cool-down once they answer again: moto's S3 server
in its own process under a fleet's server, a redis-server under the Redis tier, a replay
worker's endpoint under the remote replay backend; and the breaker's state machine and
the bounded blocking calls on their own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import boto3
import pytest

import kvtier
from kvstore.format.errors import InvalidRequest, TierUnavailable
from kvstore.remote.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvstore.remote.calls import BlockingCalls
from kvstore.tiers.redis import REDIS_PRESETS, RedisTier, RedisTierConfig
from kvtier import AsyncClient, RetryPolicy
from services.replay.remote import RemoteReplay
from tests.support.replay import TINY_SPEC, tiny_model, tiny_session
from tests.support.servers import LOOPBACK, MotoServer, free_port
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    running_server,
    streams_for,
    tokens_for,
    window_for,
)

DEADLINE_S = 0.5  # the configured total deadline; bounds below are ratios of it
BOUND_S = 3 * DEADLINE_S
COOLDOWN_S = 1.0
TOKENS = LAYOUT.chunk_tokens * 2 + 20
NO_RETRY = RetryPolicy(attempts=1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the breaker and the bounded calls, alone --


def test_breaker_opens_fails_fast_probes_once_and_closes():
    clock = FakeClock()
    breaker = CircuitBreaker("dep", cooldown_s=5.0, clock=clock)
    assert breaker.state == CLOSED and breaker.allow()
    breaker.failed("stalled")
    assert breaker.state == OPEN and breaker.is_open and breaker.opened == 1
    with pytest.raises(TierUnavailable, match="dep is down .*circuit open.*stalled"):
        breaker.check()
    clock.now = 4.9
    assert not breaker.allow()
    clock.now = 5.0
    assert breaker.state == HALF_OPEN
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # everyone else still fails fast while it is out
    breaker.failed("still stalled")  # the probe failed: open for another cool-down
    assert breaker.state == OPEN and breaker.opened == 1
    clock.now = 9.9
    assert not breaker.allow()
    clock.now = 10.0
    assert breaker.allow()
    breaker.succeeded()
    assert breaker.state == CLOSED and not breaker.is_open
    assert breaker.allow() and breaker.allow()


def test_breaker_threshold_cancelled_probe_and_lost_probe():
    clock = FakeClock()
    breaker = CircuitBreaker("dep", cooldown_s=2.0, threshold=3, clock=clock)
    breaker.failed("a")
    breaker.failed("b")
    breaker.succeeded()  # consecutive failures only
    breaker.failed("c")
    breaker.failed("d")
    assert breaker.state == CLOSED
    breaker.failed("e")
    assert breaker.state == OPEN
    clock.now = 2.0
    assert breaker.allow()
    breaker.cancelled()  # the probe's caller went away: the next call probes at once
    assert breaker.allow()
    assert not breaker.allow()
    clock.now = 4.0  # that probe never reported: after a cool-down another may go
    assert breaker.allow()
    with pytest.raises(ValueError):
        CircuitBreaker("dep", cooldown_s=0)


async def test_blocking_calls_keep_their_deadline_and_bound_their_threads():
    release = threading.Event()
    breaker = CircuitBreaker("slow", cooldown_s=60)
    calls = BlockingCalls(breaker, deadline_s=DEADLINE_S, max_threads=2,
                          is_outage=lambda exc: isinstance(exc, OSError))
    try:
        started = time.monotonic()
        with pytest.raises(TierUnavailable, match=r"slow GET did not answer within 0.5 s"):
            await calls.run("GET", release.wait, 30)
        assert time.monotonic() - started < BOUND_S
        assert breaker.is_open and calls.busy == 1  # its thread is still blocked
        with pytest.raises(TierUnavailable, match="circuit open"):
            await calls.run("GET", lambda: 1)  # fails fast: nothing runs
        breaker.succeeded()
        with pytest.raises(TierUnavailable):
            await calls.run("GET", release.wait, 30)
        assert calls.busy == 2
        breaker.succeeded()
        # both threads stalled: a third call waits for one within its deadline, no longer
        started = time.monotonic()
        with pytest.raises(TierUnavailable, match="all 2 connections stayed busy"):
            await calls.run("GET", lambda: 1)
        assert time.monotonic() - started < BOUND_S and calls.busy == 2
        release.set()
        for _ in range(100):
            if calls.busy == 0:
                break
            await asyncio.sleep(0.01)
        assert calls.busy == 0
        assert await calls.run("GET", lambda x: x + 1, 1) == 2
        # a burst larger than the pool queues for its threads: every call answers
        burst = await asyncio.gather(*(calls.run("GET", time.sleep, 0.01) for _ in range(20)))
        assert burst == [None] * 20 and calls.busy == 0
        with pytest.raises(KeyError):  # the dependency's answer: not an outage
            await calls.run("GET", {}.__getitem__, "missing")
        assert not breaker.is_open
        with pytest.raises(ConnectionRefusedError):
            await calls.run("GET", _refuse)
        assert breaker.is_open
    finally:
        release.set()
        calls.close()


def _refuse() -> None:
    raise ConnectionRefusedError("refused")


# -- a stalled S3 store under a fleet's server --


@pytest.fixture
def stallable_s3(monkeypatch):
    """(process, URL, bucket) of a moto S3 server in a process of its own, with one empty
    bucket and its credentials in this process's environment."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MotoServer.CREDENTIALS["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY",
                       MotoServer.CREDENTIALS["aws_secret_access_key"])
    bucket = f"kvtier-stall-{uuid.uuid4().hex[:8]}"
    with moto_process() as (process, url):
        boto3.client("s3", endpoint_url=url, **MotoServer.CREDENTIALS).create_bucket(
            Bucket=bucket)
        yield process, url, bucket


@contextlib.contextmanager
def moto_process():
    """moto's S3 server in a process of its own (so it can be stopped); its URL."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", LOOPBACK,
                                "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://{LOOPBACK}:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection((LOOPBACK, port), timeout=1):
                    break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, \
                    "moto server did not start"
                time.sleep(0.1)
        yield process, url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait(timeout=10)


async def _scrape(port: int) -> dict[str, float]:
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("kvtier_")}


async def _spill(kv, sid: str, seed: int, ack: str):
    await kv.spill("acme", sid, LAYOUT.name, tokens_for(TOKENS, seed=seed),
                   streams_for(LAYOUT, TOKENS, seed=seed),
                   window=window_for(LAYOUT, TOKENS, seed=seed), generation=1, ack=ack)


async def test_a_stalled_object_store_costs_one_deadline_then_fails_fast(
        tmp_path, stallable_s3):
    moto, url, bucket = stallable_s3
    async with running_server(
            tmp_path, s3_endpoint=url, s3_bucket=bucket, s3_region="us-east-1",
            metadata="shared", node_id="n1", s3_deadline_s=DEADLINE_S,
            s3_read_timeout_s=2.0, breaker_cooldown_s=COOLDOWN_S) as (server, target), \
            AsyncClient(target, retry=NO_RETRY) as kv:
        port = server.start_metrics(0, "127.0.0.1")
        await _spill(kv, "held", 1, "durable")  # in host memory and in the bucket
        os.kill(moto.pid, signal.SIGSTOP)

        # A resume of a session held in memory: its manifest read from the bucket
        # waits one deadline at most, then this node's copy is served.
        started = time.monotonic()
        resumed = await kv.resume("acme", "held")
        assert time.monotonic() - started < BOUND_S
        assert_streams_equal(resumed.persistent, streams_for(LAYOUT, TOKENS, seed=1))
        assert resumed.window is not None

        # A durable spill: UNAVAILABLE within the deadline's bound, with a message.
        started = time.monotonic()
        with pytest.raises(kvtier.TierUnavailable) as raised:
            await _spill(kv, "new", 2, "durable")
        assert time.monotonic() - started < BOUND_S
        assert str(raised.value).startswith("UNAVAILABLE")
        assert "object" in str(raised.value)
        await kv.stat()  # refreshes the snapshot the endpoint exports
        samples = await _scrape(port)
        assert samples['kvtier_breaker_open{dependency="object"}'] == 1
        assert samples['kvtier_tier_up{tier="object"}'] == 0

        # While open: no call waits on the store; a resume of the held session too.
        with pytest.raises(kvtier.TierUnavailable, match="circuit open"):
            await _spill(kv, "new", 2, "durable")
        started = time.monotonic()
        resumed = await kv.resume("acme", "held")
        assert time.monotonic() - started < BOUND_S
        assert_streams_equal(resumed.persistent, streams_for(LAYOUT, TOKENS, seed=1))

        os.kill(moto.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while True:  # after the cool-down one probe closes the breaker
            try:
                await _spill(kv, "new", 2, "durable")
                break
            except kvtier.TierUnavailable:
                assert time.monotonic() < deadline, "the object tier never came back"
                await asyncio.sleep(0.2)
        await kv.stat()
        samples = await _scrape(port)
        assert samples['kvtier_breaker_open{dependency="object"}'] == 0
        assert samples['kvtier_tier_up{tier="object"}'] == 1
        for sid, seed in (("held", 1), ("new", 2)):  # nothing acked was lost
            restored = await kv.restore("acme", sid)
            assert_streams_equal(restored.persistent,
                                 streams_for(LAYOUT, TOKENS, seed=seed))


async def test_a_stalled_object_tier_is_routed_around_when_the_disk_is_durable(
        tmp_path, stallable_s3):
    moto, url, bucket = stallable_s3
    async with running_server(
            tmp_path, s3_endpoint=url, s3_bucket=bucket, s3_region="us-east-1",
            s3_deadline_s=DEADLINE_S, s3_read_timeout_s=2.0,
            breaker_cooldown_s=COOLDOWN_S) as (server, target), \
            AsyncClient(target, retry=NO_RETRY) as kv:
        await _spill(kv, "held", 1, "memory")
        await server.manager.drain()
        os.kill(moto.pid, signal.SIGSTOP)
        started = time.monotonic()
        resumed = await kv.resume("acme", "held")
        await _spill(kv, "new", 2, "durable")  # acked by the disk tier
        assert time.monotonic() - started < BOUND_S
        assert_streams_equal(resumed.persistent, streams_for(LAYOUT, TOKENS, seed=1))
        # Moving a session down to the object tier needs the store: it waits one
        # deadline, then the next attempt fails at once, sending nothing.
        objects = server.manager.tiers[-1]
        started = time.monotonic()
        with pytest.raises(kvtier.TierUnavailable, match="did not answer within 0.5 s"):
            await kv.evict("acme", "held", "object")
        assert time.monotonic() - started < BOUND_S
        assert objects.breaker.is_open
        stalled_calls = objects.remote.busy
        with pytest.raises(kvtier.TierUnavailable):
            await kv.evict("acme", "held", "object")
        assert objects.remote.busy == stalled_calls
        assert (await kv.stat()).tiers[-1].available is False
        os.kill(moto.pid, signal.SIGCONT)
        restored = await kv.restore("acme", "new")
        assert_streams_equal(restored.persistent, streams_for(LAYOUT, TOKENS, seed=2))


# -- a stalled redis-server under the Redis tier --


async def test_a_stalled_redis_costs_one_deadline_then_fails_fast(redis_server_factory):
    redis = redis_server_factory()
    tier = RedisTier(redis.url, 1 << 20, RedisTierConfig(
        connect_timeout_s=0.2, socket_timeout_s=0.3, retries=1, op_timeout_s=DEADLINE_S,
        breaker_cooldown_s=COOLDOWN_S))
    try:
        await tier.put("k1", b"v" * 100)
        os.kill(redis.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TierUnavailable, match="redis GET failed"):
            await tier.get("k1")
        assert time.monotonic() - started < BOUND_S
        assert tier.breaker.is_open and not (await tier.stats()).available
        with pytest.raises(TierUnavailable, match="circuit open"):
            await tier.put("k2", b"w")  # fails fast, nothing sent
        assert not await tier.ping()

        os.kill(redis.process.pid, signal.SIGCONT)
        await asyncio.sleep(COOLDOWN_S)
        assert await tier.get("k1") == b"v" * 100  # the probe, then closed
        assert not tier.breaker.is_open and (await tier.stats()).available
        await tier.put("k2", b"w")
        assert await tier.get("k2") == b"w"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(redis.process.pid, signal.SIGCONT)
        await tier.close()


# -- a stalled replay worker --


@contextlib.contextmanager
def stopped_endpoint():
    """host:port of a process that accepted the port and was then stopped (SIGSTOP)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(64)\n"
        "print('ready', flush=True); time.sleep(600)\n"), str(port)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        os.kill(process.pid, signal.SIGSTOP)
        yield f"{LOOPBACK}:{port}"
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait(timeout=10)


async def test_a_stalled_replay_worker_is_skipped_after_one_timeout():
    from replay.worker import ReplayWorker
    from services.replay.server import create_server

    model = tiny_model()
    state, chunks, tail = tiny_session(model, 45)
    worker = ReplayWorker(model, default_tokens=16)
    server, port = await create_server("127.0.0.1:0", worker, name="live")
    with stopped_endpoint() as stalled:
        backend = RemoteReplay([stalled, f"127.0.0.1:{port}"], timeout_s=DEADLINE_S,
                               breaker_cooldown_s=60)
        only_stalled = RemoteReplay([stalled], timeout_s=DEADLINE_S, breaker_cooldown_s=60)
        try:
            for _ in range(4):  # whichever worker's turn it is, the live one answers
                result = await backend.rebuild(TINY_SPEC.layout_id, state.token_ids,
                                               chunks, tail)
                assert result.replayed_tokens == 16 and backend.last_worker == "live"
            down, live = backend.breakers()
            assert down.dependency == f"replay:{stalled}"
            assert down.is_open and down.opened == 1  # tried once, then skipped
            assert not live.is_open

            started = time.monotonic()
            with pytest.raises(TierUnavailable, match="DEADLINE_EXCEEDED"):
                await only_stalled.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail)
            assert time.monotonic() - started < BOUND_S
            with pytest.raises(TierUnavailable, match="circuit open"):
                await only_stalled.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail)
        finally:
            await backend.close()
            await only_stalled.close()
            await server.stop(0)
            await worker.close()


async def test_a_stalled_replay_job_queue_costs_one_deadline(redis_server_factory):
    from services.replay.streams import StreamNames, StreamReplay

    redis = redis_server_factory()
    model = tiny_model()
    state, chunks, tail = tiny_session(model, 45)
    backend = StreamReplay(redis.url, names=StreamNames(stream="t:stall"), timeout_s=30,
                           queue_timeout_s=DEADLINE_S, breaker_cooldown_s=60)
    os.kill(redis.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TierUnavailable, match="replay job queue unreachable or stalled"):
            await backend.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail)
        assert time.monotonic() - started < BOUND_S
        assert backend.breakers()[0].is_open
        with pytest.raises(TierUnavailable, match="replay-queue is down .*circuit open"):
            await backend.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail)
    finally:
        os.kill(redis.process.pid, signal.SIGCONT)
        await backend.close()


# -- the config keys reach every dependency --


async def test_deadline_keys_reach_every_dependency(tmp_path, opened):
    from services.server.replay_backend import make_replay_backend
    from services.server.store import build_tiers
    from tests.support.service import config_for

    config = config_for(tmp_path, redis_url="redis://127.0.0.1:1/0", s3_bucket="kvtier-cfg",
                        s3_endpoint="http://127.0.0.1:1", s3_connect_timeout_s=0.3,
                        s3_read_timeout_s=0.6, s3_deadline_s=0.7, redis_deadline_s=0.8,
                        redis_socket_timeout_s=0.4, replay="remote",
                        replay_workers=("127.0.0.1:1",), replay_timeout_s=0.9,
                        breaker_cooldown_s=2.5)
    tiers: list = []
    build_tiers(config, tiers)
    for tier in tiers:
        opened.adopt(tier)
    by_name = {tier.name: tier for tier in tiers}
    objects, redis = by_name["object"], by_name["redis"]
    client_config = objects.s3_location()[0].meta.config
    assert (client_config.connect_timeout, client_config.read_timeout) == (0.3, 0.6)
    assert objects.remote.deadline_s == 0.7 and objects.breaker.cooldown_s == 2.5
    assert redis.config.op_timeout_s == 0.8 and redis.config.socket_timeout_s == 0.4
    assert redis.config.connect_timeout_s == REDIS_PRESETS["datacenter"].connect_timeout_s
    assert redis.breaker.cooldown_s == 2.5
    backend = opened.adopt(make_replay_backend(config)[0])
    assert backend.timeout_s == 0.9
    assert [b.cooldown_s for b in backend.breakers()] == [2.5]
    await opened.close(backend)
    for tier in tiers:
        await opened.close(tier)
    for key in ("s3_deadline_s", "replay_timeout_s", "breaker_cooldown_s"):
        with pytest.raises(InvalidRequest, match=key):
            config_for(tmp_path, **{key: 0})
    with pytest.raises(InvalidRequest, match="redis_deadline_s"):
        config_for(tmp_path, redis_deadline_s=-1)
