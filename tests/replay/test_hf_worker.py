"""The transformers DeepseekV4 replayer as a replay worker (``kvtier replay-worker
--hf-model``): a real ``TransformersReplayWorker`` behind a real gRPC worker server, and
a kvtier server with ``replay_hf_workers`` resuming a DeepseekV4 session through it; a
worker of another model refuses the layout, which the server answers as
ReplayUnavailable; the same worker on its replayer's Redis Streams job stream; the
command's flags and the server's config keys. Fidelity figures belong to bench.hf; the
bounds here are loose."""

from __future__ import annotations

import argparse
import asyncio
import copy

import pytest
import torch

pytest.importorskip("transformers")

from bench.hf import compare, follow_logits, tiny_model  # noqa: E402
from kvstore.format.errors import (  # noqa: E402
    InvalidRequest,
    ModelMismatch,
    ReplayUnavailable,
)
from kvtier import AsyncClient  # noqa: E402
from kvtier.codec import as_tokens, encode_session  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    async_resume_cache,
    async_spill_cache,
    cache_streams,
    model_layout,
)
from replay.transformers_worker import TransformersReplayWorker  # noqa: E402
from services.replay.server import add_arguments, create_server, load_worker  # noqa: E402
from services.replay.streams import StreamConsumer, StreamNames, StreamReplay  # noqa: E402
from tests.support.service import config_for, running_server  # noqa: E402


async def test_a_deepseek_v4_session_resumes_through_a_transformers_replay_worker(tmp_path):
    model = tiny_model(seed=3)
    n = 300  # 75 CSA entries, 2 HCA entries and 44 tokens of an unfinished HCA block
    ids = torch.randint(0, model.config.vocab_size, (n + 17,),
                        generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(ids[None, :n], use_cache=True).past_key_values
    ref = follow_logits(model, copy.deepcopy(cache), ids[n:])
    worker = TransformersReplayWorker(tiny_model(seed=3))  # the same weights, its own copy
    other = TransformersReplayWorker(tiny_model(seed=3, sliding_window=64))
    good, good_port = await create_server("127.0.0.1:0", worker, name="hf-1")
    bad, bad_port = await create_server("127.0.0.1:0", other, name="hf-other")
    try:
        async with running_server(tmp_path / "a", replay_hf_workers=f"127.0.0.1:{good_port}"
                                  ) as (server, target), AsyncClient(target) as kv:
            await async_spill_cache(kv, "acme", "v4", model, cache, ids[:n], generation=1,
                                    ack="durable")
            resumed, tokens = await async_resume_cache(kv, "acme", "v4", model,
                                                       replay="server")
            assert worker.rebuilds == 1 and server.servicer.replays == 1
        assert torch.equal(tokens, ids[:n]) and resumed.get_seq_length() == n
        replayed = compare(ref, follow_logits(model, resumed, ids[n:]))
        assert replayed["kl_nats"] < 0.1  # loose: random weights, R = 128

        # a worker whose model is another DeepseekV4 (another window) cannot rebuild it:
        # the same weights under another config are another model
        async with running_server(tmp_path / "b", replay_hf_workers=f"127.0.0.1:{bad_port}"
                                  ) as (_, target), AsyncClient(target) as kv:
            await async_spill_cache(kv, "acme", "v4", model, cache, ids[:n], generation=1)
            with pytest.raises(ModelMismatch, match="another config"):
                await async_resume_cache(kv, "acme", "v4", model, replay="server")
            # and, the session stating no model, its layout is not the worker's
            await async_spill_cache(kv, "acme", "bare", model, cache, ids[:n], generation=1,
                                    model_fingerprint="")
            with pytest.raises(ReplayUnavailable, match="cannot rebuild layout"):
                await async_resume_cache(kv, "acme", "bare", model, replay="server",
                                         model_fingerprint="")
        assert other.rebuilds == 0
    finally:
        await good.stop(0)
        await bad.stop(0)
        await worker.close()
        await other.close()


async def test_the_worker_command_builds_the_transformers_replayer(tmp_path, capsys):
    from services import cli

    config_json = tmp_path / "config.json"
    tiny_model().config.to_json_file(config_json)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    worker = load_worker(parser.parse_args(["--hf-model", str(config_json), "--hf-seed", "3"]))
    try:
        assert isinstance(worker, TransformersReplayWorker)
        assert worker.replayer == "transformers-deepseek-v4"
        want = tiny_model(seed=3).state_dict()  # the seed draws the server's weights too
        assert all(torch.equal(got, want[name])
                   for name, got in worker.model.state_dict().items())
    finally:
        await worker.close()
    assert cli.main(["replay-worker", "--hf-model", str(tmp_path / "none.json"),
                     "--listen", "127.0.0.1:0"]) == 2
    assert "no transformers model at" in capsys.readouterr().err
    assert cli.main(["replay-worker", "--hf-model", str(config_json), "--weights",
                     str(tmp_path / "w.safetensors"), "--listen", "127.0.0.1:0"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_the_server_config_routes_transformers_layouts_to_hf_workers(tmp_path):
    config = config_for(tmp_path, replay="remote", replay_hf_workers="10.0.0.9:50052")
    assert config.replay_hf_workers == ("10.0.0.9:50052",)
    assert "transformers-deepseek-v4" in config.replay_layouts
    with pytest.raises(InvalidRequest, match="set one"):
        config_for(tmp_path, replay_hf_model=str(tmp_path / "config.json"),
                   replay_hf_workers="10.0.0.9:50052")


async def test_a_transformers_worker_serves_its_replayers_job_stream(redis_server):
    model = tiny_model(seed=3)
    n = 300
    ids = torch.randint(0, model.config.vocab_size, (n,),
                        generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(ids[None], use_cache=True).past_key_values
    spec = model_layout(model)
    tokens = as_tokens(ids)
    enc = encode_session(spec, tokens, cache_streams(spec, model, cache, n), scope="t")
    chunks = [enc.chunks[i] for i in range(len(enc.keys))]
    worker = TransformersReplayWorker(model)
    names = StreamNames(stream="h:jobs", group="h-group", reply_prefix="h:reply:")
    consumer = StreamConsumer(redis_server, worker, consumer="hf", block_ms=200,
                              names=names.for_replayer(worker.replayer))
    await consumer.ensure_group()
    serving = asyncio.create_task(consumer.run())
    backend = StreamReplay(redis_server, names=names, timeout_s=60)
    try:
        result = await backend.rebuild(spec, tokens, chunks, enc.tail)
        assert worker.rebuilds == 1  # counted before its reply is pushed
        direct = await worker.rebuild(spec, tokens, chunks, enc.tail)
        assert result.window == direct.window
        assert result.replayed_tokens == direct.replayed_tokens
    finally:
        consumer.stop()
        await serving
        await consumer.close()
        await backend.close()
        await worker.close()
