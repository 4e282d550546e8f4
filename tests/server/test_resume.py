"""Resume over a real server with in-process bounded replay through the bundled model's
architecture (random weights saved to a tmp file): a held window comes back as spilled;
a dropped one (evicted, or lost in a restart) is rebuilt, exactly when every token is
replayed."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvstore.format.registry import get_layout
from kvtier import AsyncClient
from kvtier.codec import decode_window
from model.checkpoint import load, save
from model.config import BUNDLED
from model.infer import prefill, replay
from model.net import KVTierLM
from replay import ReplayWorker
from replay.state_codec import encode_window, state_to_chunks
from services.replay.server import create_server as create_worker_server
from services.replay.streams import StreamConsumer
from tests.support.fleet import assert_same_window
from tests.support.service import running_server

SPEC = get_layout("kvtier-bundled")
TOKENS = 150  # more than R = 128, and 150 % 4 = 2 pending rows


@pytest.fixture(scope="module")
def model_and_state(tmp_path_factory):
    torch.manual_seed(0)
    model = KVTierLM(BUNDLED).eval()
    weights = tmp_path_factory.mktemp("weights") / "model.safetensors"
    save(model, weights)
    ids = torch.randint(0, BUNDLED.vocab, (TOKENS,), generator=torch.Generator().manual_seed(1))
    # The server's model is the saved one (fp16 weights): prefill with exactly that.
    state, _ = prefill(load(weights), ids, logits="none")
    return weights, ids, state_to_chunks(SPEC, state)


async def test_resume_replays_a_dropped_window_even_across_a_restart(tmp_path,
                                                                     model_and_state):
    weights, ids, (chunks, tail, window) = model_and_state
    options = {"replay_weights": str(weights), "replay": "in-process"}
    async with running_server(tmp_path, **options) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "s1", SPEC, ids, chunks=[c for _, c in chunks], tail=tail,
                       window=window, generation=1)
        held = await kv.resume("acme", "s1")
        assert not held.replayed and bytes(held.window_blob) == window

        await kv.evict("acme", "s1", "disk")  # the window cannot live on disk: dropped
        rebuilt = await kv.resume("acme", "s1", replay_tokens=TOKENS)
        assert rebuilt.replayed and rebuilt.replay_tokens == TOKENS
        assert_same_window(rebuilt.window_blob, window, rebuilt.token_ids)
        assert rebuilt.window is not None and not rebuilt.replay_needed
        assert (await kv.stat()).replays == 1
        # The rebuilt window was kept in the session: a second resume does not replay.
        again = await kv.resume("acme", "s1")
        assert not again.replayed and bytes(again.window_blob) == bytes(rebuilt.window_blob)
        assert again.generation == 1 and (await kv.stat()).replays == 1

    # A restart loses the host tier, so the window; the chunks came back from disk.
    async with running_server(tmp_path, **options) as (server, target), \
            AsyncClient(target) as kv:
        # the default R, the layout's stated one (256), is capped at the 150 tokens
        bounded = await kv.resume("acme", "s1")
        assert bounded.replayed and bounded.replay_tokens == TOKENS < SPEC.replay_tokens
        assert_same_window(bounded.window_blob, window, bounded.token_ids)
        window_streams, start = decode_window(SPEC, bounded.token_ids, bounded.window_blob)
        assert start == TOKENS - BUNDLED.window
        assert window_streams["enc.window.k"].codes.shape[1] == BUNDLED.window
        assert server.metrics.registry.get_sample_value("kvtier_replays_total") == 1
        assert server.metrics.registry.get_sample_value("kvtier_replay_seconds_count") == 1


async def test_a_resume_replays_the_layouts_stated_r_by_default_and_a_shorter_one_on_request(
        tmp_path, model_and_state):
    weights, _, _ = model_and_state
    model = load(weights)
    n = 2 * SPEC.replay_tokens  # longer than the stated R, so the default is bounded
    ids = torch.randint(0, BUNDLED.vocab, (n,), generator=torch.Generator().manual_seed(2))
    state = prefill(model, ids, logits="none")[0]
    chunks, tail, _ = state_to_chunks(SPEC, state)
    # the server's own default R (replay_tokens) is not what a stated layout uses
    options = {"replay_weights": str(weights), "replay": "in-process", "replay_tokens": 64}
    async with running_server(tmp_path, **options) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "s1", SPEC, ids, chunks=[c for _, c in chunks], tail=tail,
                       generation=1)  # no window: replay needed
        # a shorter R is honoured (a full window of W rows, kept: faster, less faithful)
        short = await kv.resume("acme", "s1", replay_tokens=SPEC.window_tokens)
        assert short.replayed and short.replay_tokens == SPEC.window_tokens
        assert (await kv.restore("acme", "s1")).window_replayed_tokens == SPEC.window_tokens
        # by default, the stated R: the kept shorter replay is rebuilt with it, and kept
        stated = await kv.resume("acme", "s1")
        assert stated.replayed and stated.replay_tokens == SPEC.replay_tokens == 256
        want = encode_streams(replay(model, state, SPEC.replay_tokens))
        mine, _ = decode_window(SPEC, stated.token_ids, stated.window_blob)
        assert all(torch.equal(mine[name].codes, codes) for name, codes in want.items())
        again = await kv.resume("acme", "s1")
        assert not again.replayed and again.window_replayed_tokens == SPEC.replay_tokens


async def test_concurrent_resumes_share_replay_model_calls(tmp_path, model_and_state):
    weights, _, _ = model_and_state
    model = load(weights)
    sessions = {}
    for i, n in enumerate((140, 150, 170, 190)):
        ids = torch.randint(0, BUNDLED.vocab, (n,), generator=torch.Generator().manual_seed(i))
        state = prefill(model, ids, logits="none")[0]
        sessions[f"s{i}"] = ids, state_to_chunks(SPEC, state), replay(model, state, 128)
    options = {"replay_weights": str(weights), "replay": "in-process"}
    async with running_server(tmp_path, **options) as (server, target), \
            AsyncClient(target) as kv:
        for name, (ids, (chunks, tail, _), _) in sessions.items():
            await kv.spill("acme", name, SPEC, ids, chunks=[c for _, c in chunks], tail=tail,
                           generation=1)  # no window: every resume replays
        worker = await server.servicer.replay.worker()  # the weights load here
        hold_until_all_queued(worker, len(sessions))
        # one R for all (a batch shares one); by default each would replay all its tokens
        resumed = await asyncio.gather(*(kv.resume("acme", name, replay_tokens=128)
                                         for name in sessions))
        # The first call took the first arrival(s); the rest queued behind it and share one.
        assert worker.rebuilds == 4 and worker.model_calls <= 2
        batch_sizes = server.metrics.registry.get_sample_value("kvtier_replay_batch_size_sum")
        assert batch_sizes > 4  # each resume observes the size of the call that served it
        for (_, _, want), got in zip(sessions.values(), resumed, strict=True):
            assert got.replayed and got.replay_tokens == 128
            mine, _ = decode_window(SPEC, got.token_ids, got.window_blob)
            for name, data in encode_streams(want).items():
                # one batched call against one session's: equal up to a rounding flip
                assert (mine[name].codes.float() - data.float()).abs().max() <= 1, name


def hold_until_all_queued(worker: ReplayWorker, jobs: int) -> None:
    """Hold the worker's first model call until ``jobs`` rebuilds have reached it (in that
    call or queued behind it), however the requests' arrivals are spread in time."""
    rebuild_batch = worker._rebuild_batch

    def gated(batch):
        deadline = time.monotonic() + 60
        while len(batch) + len(worker._queue) < jobs:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(batch) + len(worker._queue)} rebuilds came")
            time.sleep(0.001)
        worker._rebuild_batch = rebuild_batch  # later calls run as they would
        return rebuild_batch(batch)

    worker._rebuild_batch = gated


def encode_streams(state) -> dict[str, torch.Tensor]:
    """The window codes of a state, in decode_window's stream layout."""
    blob = encode_window(SPEC, state)
    return {name: data.codes for name, data in decode_window(
        SPEC, state.token_ids.numpy(), blob)[0].items()}


async def test_resume_through_remote_workers_and_redis_streams(tmp_path, model_and_state,
                                                               redis_server):
    weights, ids, (chunks, tail, window) = model_and_state
    worker = ReplayWorker(load(weights))
    worker_server, worker_port = await create_worker_server("127.0.0.1:0", worker)
    consumer = StreamConsumer(redis_server, worker, consumer="w1", block_ms=200)
    await consumer.ensure_group()
    consuming = asyncio.create_task(consumer.run())
    try:
        for mode, options in (("remote", {"replay_workers": f"127.0.0.1:{worker_port}"}),
                              ("streams", {"replay_redis_url": redis_server})):
            async with running_server(tmp_path / mode, replay=mode, **options) as (_, target), \
                    AsyncClient(target) as kv:
                await kv.spill("acme", "s1", SPEC, ids, chunks=[c for _, c in chunks],
                               tail=tail, generation=1)  # no window: replay needed
                resumed = await kv.resume("acme", "s1", replay_tokens=TOKENS)
                assert resumed.replayed, mode
                assert_same_window(resumed.window_blob, window, resumed.token_ids)
        assert consumer.done == 1
    finally:
        consuming.cancel()
        await asyncio.gather(consuming, return_exceptions=True)
        await consumer.close()
        await worker_server.stop(0.5)
        await worker.close()
