"""ReplayWorker: the rebuilt window is exactly what model.infer.replay gives, R is taken
from the request or the default and validated, bad input is refused, and the event loop
keeps running while the model computes."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.errors import ChunkCorrupt, InvalidRequest, LayoutMismatch, UnknownLayout
from model.infer import decode_step, replay
from replay.state_codec import encode_window, state_from_chunks
from replay.worker import ReplayWorker
from tests.replay_support import TINY_SPEC, tiny_model, tiny_session


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
        # the worker is still fine after all that
        assert (await worker.rebuild(TINY_SPEC.layout_id, ids, chunks, tail, 8)
                ).replayed_tokens == 8
    finally:
        await worker.close()


async def test_event_loop_runs_while_the_model_computes(model):
    state, chunks, tail = tiny_session(model, 200, seed=3)
    worker = ReplayWorker(model)
    ticks = 0
    done = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    try:
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        ticks = 0
        results = await asyncio.gather(*(
            worker.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail, 200)
            for _ in range(6)))
        done.set()
        await task
        assert len({r.window for r in results}) == 1  # concurrent rebuilds agree
        # six replays of 200 tokens: a blocked loop would tick once or twice in between
        assert ticks >= 6 * 3
    finally:
        await worker.close()
