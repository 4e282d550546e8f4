"""ReplayWorker: the rebuilt window is exactly what model.infer.replay gives, R is taken
from the request or the default and validated, bad input is refused, and the event loop
keeps running while the model computes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvstore.format.errors import ChunkCorrupt, InvalidRequest, LayoutMismatch, UnknownLayout
from model.infer import decode_step, replay
from replay.state_codec import encode_window, state_from_chunks
from replay.worker import ReplayWorker
from tests.support.replay import TINY_SPEC, tiny_model, tiny_session


@pytest.fixture(scope="module")
def model():
    return tiny_model()


async def test_rebuilt_window_is_the_models_replay(model):
    state, chunks, tail = tiny_session(model, 45)  # 2 chunks, a tail, 1 pending row
    worker = ReplayWorker(model, default_tokens=12)
    try:
        result = await worker.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail)
        assert result.replayed_tokens == 12 and result.seconds > 0
        expected = replay(model, state.without_window(), 12)
        assert result.window == encode_window(TINY_SPEC, expected)
        # and the session is ready to decode: same logits as the in-memory replayed state
        ready = state_from_chunks(model.cfg, state.token_ids, chunks, tail, result.window,
                                  spec=TINY_SPEC)
        assert decode_step(model, ready, 5).equal(decode_step(model, expected, 5))
        # a request's own R wins over the default; R past the session is capped
        assert (await worker.rebuild(TINY_SPEC, state.token_ids, chunks, tail, 5)
                ).replayed_tokens == 5
        assert (await worker.rebuild(TINY_SPEC.name, state.token_ids, chunks, tail, 1000)
                ).replayed_tokens == 45
    finally:
        await worker.close()


async def test_bad_requests_are_refused(model):
    state, chunks, tail = tiny_session(model, 45)
    worker = ReplayWorker(model, default_tokens=16, max_tokens=64)
    ids = state.token_ids
    try:
        for bad_r in (-1, 65, 2.5):
            with pytest.raises(InvalidRequest, match="replay_tokens"):
                await worker.rebuild(TINY_SPEC.layout_id, ids, chunks, tail, bad_r)
        state2, chunks2, tail2 = tiny_session(model, 47)  # 3 pending rows
        with pytest.raises(InvalidRequest, match="unfinished block"):
            await worker.rebuild(TINY_SPEC.layout_id, state2.token_ids, chunks2, tail2, 2)
        with pytest.raises(UnknownLayout):
            await worker.rebuild("no-such-layout", ids, chunks, tail)
        with pytest.raises(LayoutMismatch, match="does not describe this model"):
            await worker.rebuild("kvtier-bundled", ids, chunks, tail)
        with pytest.raises(InvalidRequest, match="without tokens"):
            await worker.rebuild(TINY_SPEC.layout_id, [], [], b"")
        broken = bytearray(chunks[0])
        broken[-1] ^= 1
        with pytest.raises(ChunkCorrupt):
            await worker.rebuild(TINY_SPEC.layout_id, ids, [bytes(broken), chunks[1]], tail)
        with pytest.raises(LayoutMismatch, match="other token ids"):
            await worker.rebuild(TINY_SPEC.layout_id, ids.flip(0), chunks, tail)
        outside = ids.clone()
        outside[-1] = TINY_SPEC.vocab_size  # past the embedding: refused, not an IndexError
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            await worker.rebuild(TINY_SPEC.layout_id, outside, chunks, tail)
        # the worker is still fine after all that
        assert (await worker.rebuild(TINY_SPEC.layout_id, ids, chunks, tail, 8)
                ).replayed_tokens == 8
    finally:
        await worker.close()


async def test_event_loop_runs_while_the_model_computes(model):
    state, chunks, tail = tiny_session(model, 200, seed=3)
    worker = ReplayWorker(model)
    computing, loop_ran = threading.Event(), threading.Event()
    rebuild_batch = worker._rebuild_batch

    def gated(batch):  # holds the model call until the event loop has run meanwhile
        computing.set()
        if not loop_ran.wait(10):
            raise AssertionError("the event loop did not run while the model computed")
        return rebuild_batch(batch)

    worker._rebuild_batch = gated
    try:
        rebuilds = [asyncio.create_task(worker.rebuild(TINY_SPEC.layout_id, state.token_ids,
                                                       chunks, tail, 200)) for _ in range(6)]
        while not computing.is_set():
            await asyncio.sleep(0.001)  # the loop turns while the compute thread waits
        loop_ran.set()
        results = await asyncio.gather(*rebuilds)
        assert len({r.window for r in results}) == 1  # concurrent rebuilds agree
    finally:
        await worker.close()


async def test_concurrent_rebuilds_share_model_calls(model):
    sessions = [tiny_session(model, n, seed=n) for n in (45, 61, 52, 70, 48)]
    far = tiny_session(model, 300, seed=9)  # over 2x longer: not padded into their batch
    worker = ReplayWorker(model, default_tokens=16, max_batch=4)
    try:
        broken = bytearray(sessions[2][1][0])
        broken[-1] ^= 1
        requests = [(s.token_ids, chunks, tail) for s, chunks, tail in sessions]
        requests[2] = (requests[2][0], [bytes(broken), *sessions[2][1][1:]], requests[2][2])
        requests.append((far[0].token_ids, far[1], far[2]))
        results = await asyncio.gather(
            *(worker.rebuild(TINY_SPEC.layout_id, *request) for request in requests),
            return_exceptions=True)
        # All six queue before the compute thread starts: the first four share a call
        # (max_batch), the fifth goes alone after them, and so does the long one.
        assert worker.model_calls == 3 and worker.rebuilds == 5
        assert isinstance(results[2], ChunkCorrupt)  # a bad job fails alone
        assert [r.batch_size for i, r in enumerate(results) if i != 2] == [3, 3, 3, 1, 1]
        for i, (state, _, _) in enumerate([*sessions, far]):
            if i != 2:
                want = encode_window(TINY_SPEC, replay(model, state.without_window(), 16))
                assert results[i].window == want and results[i].replayed_tokens == 16
    finally:
        await worker.close()


async def test_a_cancelled_caller_leaves_the_others_their_results(model):
    sessions = [tiny_session(model, n, seed=n) for n in (40, 44, 48)]
    worker = ReplayWorker(model, default_tokens=16)
    try:
        tasks = [asyncio.create_task(worker.rebuild(TINY_SPEC.layout_id, s.token_ids, c, t))
                 for s, c, t in sessions]
        await asyncio.sleep(0)  # all three queued; the compute thread has not taken them
        tasks[1].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[1], asyncio.CancelledError)
        assert results[0].batch_size == 2 and results[2].batch_size == 2
        assert worker.model_calls == 1 and worker.rebuilds == 2
    finally:
        await worker.close()


async def test_a_batch_holds_at_most_batch_tokens_of_context(model, monkeypatch):
    monkeypatch.setattr("replay.worker.BATCH_TOKENS", 100)
    sessions = [tiny_session(model, n, seed=n) for n in (45, 48, 50)]
    worker = ReplayWorker(model, default_tokens=16)
    try:
        results = await asyncio.gather(*(worker.rebuild(TINY_SPEC.layout_id, s.token_ids,
                                                        c, t) for s, c, t in sessions))
        assert [r.batch_size for r in results] == [2, 2, 1]  # 2 x 48 fits, 3 x 50 does not
        assert worker.model_calls == 2
    finally:
        await worker.close()
