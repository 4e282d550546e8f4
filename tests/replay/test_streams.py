"""Replay jobs through Redis Streams (real redis-server): a job goes to one worker of the
group and its reply comes back; a job carries its layout's JSON, on the stream of its
layout's replayer; a bad job is answered with its error; a job taken by a worker process
that is then killed is retried by another worker after the idle timeout; a job delivered
too many times is answered with an error instead of tried again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from kvstore.format.errors import InvalidRequest, TierUnavailable
from kvstore.format.layout import BaselineKV
from model.checkpoint import save
from model.infer import replay
from replay.state_codec import encode_window, state_to_chunks
from replay.worker import ReplayWorker
from services.replay.streams import StreamConsumer, StreamNames, StreamReplay
from tests.support.replay import TINY_SPEC, tiny_model, tiny_session

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@contextlib.asynccontextmanager
async def consuming(url: str, worker: ReplayWorker, name: str, names: StreamNames, **kw):
    consumer = StreamConsumer(url, worker, consumer=name, names=names, block_ms=200, **kw)
    await consumer.ensure_group()
    task = asyncio.create_task(consumer.run())
    try:
        yield consumer
    finally:
        consumer.stop()
        await task
        await consumer.close()


async def test_jobs_are_served_by_the_group_and_answered(model, redis_server, opened):
    state, chunks, tail = tiny_session(model, 45)
    names = StreamNames(stream="t:jobs", group="t-group", reply_prefix="t:reply:")
    worker = ReplayWorker(model, default_tokens=12)
    backend = StreamReplay(redis_server, names=names, timeout_s=10)
    try:
        async with consuming(redis_server, worker, "a", names) as a, \
                consuming(redis_server, worker, "b", names) as b:
            results = await asyncio.gather(*(
                backend.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail)
                for _ in range(4)))
            want = encode_window(TINY_SPEC, replay(model, state.without_window(), 12))
            assert all(r.window == want and r.replayed_tokens == 12 for r in results)
            assert await answered(a, b) == 4  # each job answered once
            with pytest.raises(InvalidRequest, match="replay_tokens"):
                await backend.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail,
                                      100_000)
        inspect = redis.Redis.from_url(redis_server)
        assert inspect.xlen("t:jobs") == 0  # acknowledged jobs are deleted
        assert inspect.xpending("t:jobs", "t-group")["pending"] == 0
        assert not inspect.keys("t:reply:*")  # replies were taken
    finally:
        await backend.close()
        await worker.close()
    # no worker at all: the caller gets a clear error after its timeout
    lonely = opened.adopt(StreamReplay(redis_server, names=StreamNames(stream="t:none"),
                                       timeout_s=1))
    with pytest.raises(TierUnavailable, match="no replay worker answered"):
        await lonely.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail)
    await opened.close(lonely)


async def test_a_job_carries_its_layout_to_the_stream_of_its_replayer(model, redis_server):
    # a layout this process never registered (as a worker elsewhere would not have)
    spec = replace(TINY_SPEC, name="engine-tiny-s", baseline=BaselineKV(2, 2, 16))
    state, _, _ = tiny_session(model, 45)
    encoded, tail, _ = state_to_chunks(spec, state)
    chunks = [c for _, c in encoded]
    names = StreamNames(stream="l:jobs", group="l-group", reply_prefix="l:reply:")
    worker = ReplayWorker(model, default_tokens=12)
    backend = StreamReplay(redis_server, names=names, timeout_s=10)
    impatient = StreamReplay(redis_server, names=names, timeout_s=1)
    inspect = redis.Redis.from_url(redis_server)
    try:
        async with consuming(redis_server, worker, "a", names) as a:
            result = await backend.rebuild(spec, state.token_ids, chunks, tail)
            assert result.window == encode_window(spec, replay(model, state.without_window(),
                                                               12))
            # a transformers layout's job waits on that replayer's own stream, which a
            # bundled worker never reads
            with pytest.raises(TierUnavailable, match="no replay worker answered"):
                await impatient.rebuild(replace(spec, replayer="transformers-deepseek-v4"),
                                        state.token_ids, chunks, tail)
            assert await answered(a) == 1
        assert inspect.xlen("l:jobs:transformers-deepseek-v4") == 1
        assert inspect.xlen("l:jobs") == 0
        # what `kvtier replay-worker --hf-model --redis-url ...` reads by default
        assert StreamNames.with_overrides(replayer="transformers-deepseek-v4").stream == \
            "kvtier:replay:jobs:transformers-deepseek-v4"
    finally:
        await backend.close()
        await impatient.close()
        await worker.close()


async def test_queued_jobs_are_taken_as_a_batch(model, redis_server):
    sessions = [tiny_session(model, n, seed=n) for n in (40, 44, 48, 52)]
    names = StreamNames(stream="q:jobs", group="q-group", reply_prefix="q:reply:")
    worker = ReplayWorker(model, default_tokens=12)
    backend = StreamReplay(redis_server, names=names, timeout_s=10)
    try:
        jobs = [asyncio.create_task(backend.rebuild(TINY_SPEC.layout_id, s.token_ids, c, t))
                for s, c, t in sessions]
        inspect = redis.Redis.from_url(redis_server)
        deadline = time.monotonic() + 10
        while inspect.xlen("q:jobs") < len(jobs):  # all queued before any worker reads
            assert time.monotonic() < deadline, "the jobs were never queued"
            await asyncio.sleep(0.01)
        async with consuming(redis_server, worker, "solo", names) as consumer:
            results = await asyncio.gather(*jobs)
            assert await answered(consumer) == len(jobs)
        assert worker.model_calls == 1  # one read of the stream, one model call
        assert all(r.batch_size == len(jobs) for r in results)  # told through the reply
        for (state, _, _), result in zip(sessions, results, strict=True):
            assert result.window == encode_window(
                TINY_SPEC, replay(model, state.without_window(), 12))
    finally:
        await backend.close()
        await worker.close()


async def answered(*consumers: StreamConsumer, wait_s: float = 5.0) -> int:
    """Jobs the consumers answered (each counts a job just after pushing its reply)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not sum(c.done for c in consumers):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    return sum(c.done for c in consumers)


def start_worker_process(weights: Path, url: str, names: StreamNames) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "replay-worker", "--listen", "127.0.0.1:0",
         "--weights", str(weights), "--redis-url", url, "--stream", names.stream,
         "--group", names.group, "--consumer", "doomed", "--log-level", "WARNING"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def test_a_killed_workers_job_is_retried_by_another(model, redis_server, tmp_path,
                                                         opened):
    state, chunks, tail = tiny_session(model, 45)
    names = StreamNames(stream="k:jobs", group="k-group", reply_prefix="k:reply:")
    weights = tmp_path / "tiny.safetensors"
    save(model, weights)
    inspect = redis.Redis.from_url(redis_server)
    doomed = start_worker_process(weights, redis_server, names)
    try:
        line = await asyncio.to_thread(doomed.stdout.readline)
        assert "serving" in line, line
        # wait until it blocks in XREADGROUP, then freeze it: the job is delivered to it
        deadline = time.monotonic() + 30
        while not any(c.get("cmd") == "xreadgroup" for c in inspect.client_list()):
            assert time.monotonic() < deadline, "the worker process never waited for jobs"
            await asyncio.sleep(0.05)
        doomed.send_signal(signal.SIGSTOP)
        backend = opened.adopt(StreamReplay(redis_server, names=names, timeout_s=30))
        job = asyncio.create_task(backend.rebuild(TINY_SPEC.layout_id, state.token_ids,
                                                  chunks, tail, 12))
        deadline = time.monotonic() + 10
        while inspect.xpending(names.stream, names.group)["pending"] == 0:
            assert time.monotonic() < deadline, "the job was never delivered"
            await asyncio.sleep(0.02)
        owner = inspect.xpending_range(names.stream, names.group, "-", "+", 1)[0]
        assert owner["consumer"] == b"doomed"
        doomed.kill()  # SIGKILL: the job stays pending, never acknowledged
        doomed.wait(timeout=10)
        worker = opened.adopt(ReplayWorker(model))
        async with consuming(redis_server, worker, "rescuer", names, claim_idle_ms=300) as r:
            result = await asyncio.wait_for(job, 20)
            assert await answered(r) == 1
        assert result.window == encode_window(TINY_SPEC,
                                              replay(model, state.without_window(), 12))
        assert inspect.xpending(names.stream, names.group)["pending"] == 0
        await opened.close(backend)
        await opened.close(worker)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(timeout=10)



async def test_a_job_that_keeps_killing_workers_is_answered_with_an_error(model, redis_server,
                                                                         opened):
    state, chunks, tail = tiny_session(model, 45)
    names = StreamNames(stream="p:jobs", group="p-group", reply_prefix="p:reply:")
    inspect = redis.Redis.from_url(redis_server)
    inspect.xgroup_create(names.stream, names.group, id="0", mkstream=True)
    backend = opened.adopt(StreamReplay(redis_server, names=names, timeout_s=20))
    job = asyncio.create_task(backend.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks,
                                              tail))
    deadline = time.monotonic() + 10
    while not inspect.xlen(names.stream):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    # three workers took it and died: delivered three times, never acknowledged
    taken = inspect.xreadgroup(names.group, "ghost", {names.stream: ">"}, count=1)
    entry_id = taken[0][1][0][0]
    inspect.xclaim(names.stream, names.group, "ghost", 0, [entry_id], retrycount=3)
    worker = opened.adopt(ReplayWorker(model))
    async with consuming(redis_server, worker, "survivor", names, claim_idle_ms=0,
                         max_deliveries=3):
        with pytest.raises(TierUnavailable, match="giving up"):
            await asyncio.wait_for(job, 15)
    assert inspect.xpending(names.stream, names.group)["pending"] == 0
    await opened.close(backend)
    await opened.close(worker)
