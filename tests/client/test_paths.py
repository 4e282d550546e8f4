"""The client's paths: layer-by-layer restore, shared memory vs inline bytes, sending
only new chunks, recovery when the server lost what the client skipped, retries while
the server is down, and concurrent clients."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstore.format.chunk import StreamData
from kvstore.format.chunk_run import PackedRun
from kvtier import AsyncClient, Client, shm
from tests.support.servers import free_port
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    config_for,
    running_server,
    streams_for,
    tokens_for,
    window_for,
)

TOKENS = 2 * LAYOUT.chunk_tokens + 36
ROOT = Path(__file__).resolve().parents[2]


def _shm_names() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("kvtier-")}


async def test_layer_by_layer_restore_matches_the_whole_session(tmp_path):
    tokens = tokens_for(TOKENS)
    persistent = streams_for(LAYOUT, TOKENS)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, generation=1)
        slices = [s async for s in kv.restore_layers("acme", "s1")]
    order = [(s.stream, s.layer) for s in slices]
    streams = LAYOUT.persistent_streams
    assert order == [(s.name, layer) for layer in range(max(s.layers for s in streams))
                     for s in streams if layer < s.layers]
    for piece in slices:
        whole = persistent[piece.stream]
        assert torch.equal(piece.data.codes, whole.codes[piece.layer])
        assert torch.equal(piece.data.scales, whole.scales[piece.layer])


async def test_shared_memory_gives_identical_tensors_and_leaks_nothing(tmp_path):
    tokens = tokens_for(TOKENS)
    persistent = streams_for(LAYOUT, TOKENS)
    window = window_for(LAYOUT, TOKENS)
    created = set()  # by this test's server (other runs may share /dev/shm)
    async with running_server(tmp_path) as (server, target):
        results = {}
        for use_shm in (True, False):
            async with AsyncClient(target, shared_memory=use_shm) as kv:
                session = f"shm-{use_shm}"
                await kv.spill("acme", session, LAYOUT.name, tokens, persistent,
                               window=window, generation=1)
                results[use_shm] = await kv.restore("acme", session)
                # over shared memory the chunks come out in one copy, packed as they lay
                assert isinstance(results[use_shm].chunks, PackedRun) == use_shm
                if use_shm:  # again: the client offers back the segment it keeps
                    results["again"] = await kv.restore("acme", session)
                    resumed = await kv.resume("acme", session)
                    assert_streams_equal(resumed.persistent, persistent)
                    # One warm segment, leased for the spill, served every restore too.
                    created = {lease.name for lease in server.servicer.leases}
                    assert len(created) == 1 and created <= _shm_names()
            assert not len(server.servicer.leases)  # released when the client closed
            assert not created & _shm_names()
        samples = server.metrics.registry.get_sample_value
        assert samples("kvtier_spill_bytes_total", {"path": "shm"}) > 0
        assert samples("kvtier_restore_bytes_total", {"path": "shm"}) > 0
        assert samples("kvtier_restore_bytes_total", {"path": "grpc"}) > 0
    for restored in results.values():
        assert_streams_equal(restored.persistent, persistent)
        assert_streams_equal(restored.window, window)
    assert created and not created & _shm_names()


async def test_a_restarted_server_leases_afresh_without_falling_back(tmp_path):
    tokens = tokens_for(TOKENS)
    persistent = streams_for(LAYOUT, TOKENS)
    config = config_for(tmp_path, listen=f"127.0.0.1:{free_port()}")
    from services.server.server import create_server

    server, port = await create_server(config)
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as kv:
            await kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, generation=1,
                           ack="durable")
            await server.stop(0.5)  # our lease ends with it
            server, _ = await create_server(config)
            restored = await kv.restore("acme", "s1")  # offers the lost lease: refused
            assert kv.shared_memory
            assert len(server.servicer.leases) == 1  # a fresh one served the restore
    finally:
        await server.stop(0.5)
    assert_streams_equal(restored.persistent, persistent)


async def test_spill_sends_only_new_chunks_and_recovers_when_they_are_gone(tmp_path):
    tokens = tokens_for(3 * LAYOUT.chunk_tokens + 10)
    full = streams_for(LAYOUT, len(tokens))

    def prefix(n: int) -> dict[str, StreamData]:
        out = {}
        for s in LAYOUT.persistent_streams:
            e = s.entries_for(n)
            out[s.name] = StreamData(full[s.name].codes[:, :e], full[s.name].scales[:, :e])
        return out

    first = LAYOUT.chunk_tokens + 10
    # retention off: the delete below must free the chunks, not keep them as cache
    async with running_server(tmp_path, retain_unreferenced=False) as (_, target), \
            AsyncClient(target) as kv, \
            AsyncClient(target) as other:
        r1 = await kv.spill("acme", "s1", LAYOUT.name, tokens[:first], prefix(first),
                            generation=1)
        assert r1.chunks_sent == 1
        r2 = await kv.spill("acme", "s1", LAYOUT.name, tokens, full, generation=2)
        assert (r2.chunks_sent, r2.chunks_deduped) == (2, 1)
        await other.delete("acme", "s1")  # the server no longer holds chunk 0 ...
        r3 = await kv.spill("acme", "s1", LAYOUT.name, tokens, full, generation=3)
        assert r3.chunks_sent == 3  # ... so the client was told and sent everything
        assert_streams_equal((await kv.restore("acme", "s1")).persistent, full)


async def test_calls_are_retried_until_the_server_is_up(tmp_path):
    port = free_port()
    tokens = tokens_for(TOKENS)
    persistent = streams_for(LAYOUT, TOKENS)
    from services.server.server import create_server

    async def start_late():
        await asyncio.sleep(0.3)
        return await create_server(config_for(tmp_path, listen=f"127.0.0.1:{port}"))

    starting = asyncio.create_task(start_late())
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as kv:
            result = await kv.spill("acme", "s1", LAYOUT.name, tokens, persistent,
                                    generation=1)
    finally:
        server, _ = await starting
        await server.stop(0.5)
    assert result.generation == 1


async def test_a_layer_stream_is_retried_until_the_server_is_up(tmp_path):
    port = free_port()
    tokens = tokens_for(TOKENS)
    persistent = streams_for(LAYOUT, TOKENS)
    from services.server.server import create_server

    config = config_for(tmp_path, listen=f"127.0.0.1:{port}")
    server, _ = await create_server(config)
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as kv:
            await kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, generation=1,
                           ack="durable")
    finally:
        await server.stop(0.5)

    async def start_late():
        await asyncio.sleep(0.3)
        return await create_server(config)

    starting = asyncio.create_task(start_late())
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as kv:
            layers = [piece async for piece in kv.restore_layers("acme", "s1")]
    finally:
        server, _ = await starting
        await server.stop(0.5)
    got = {(p.stream, p.layer) for p in layers}
    assert len(got) == len(layers)  # each layer once
    assert got == {(s.name, i) for s in LAYOUT.persistent_streams for i in range(s.layers)}
    for piece in layers:
        assert torch.equal(piece.data.codes, persistent[piece.stream].codes[piece.layer])


async def test_concurrent_clients(tmp_path):
    async with running_server(tmp_path) as (_, target):
        async def worker(i: int) -> None:
            tokens = tokens_for(TOKENS, seed=i)
            persistent = streams_for(LAYOUT, TOKENS, seed=i)
            async with AsyncClient(target) as kv:
                for generation in (1, 2):
                    await kv.spill("acme", f"w{i}", LAYOUT.name, tokens, persistent,
                                   generation=generation)
                    restored = await kv.restore("acme", f"w{i}")
                    assert restored.generation == generation
                    assert_streams_equal(restored.persistent, persistent)

        await asyncio.gather(*(worker(i) for i in range(6)))
        async with AsyncClient(target) as kv:
            assert len(await kv.list("acme")) == 6


def test_blocking_client(tmp_path):
    tokens = tokens_for(TOKENS)
    persistent = streams_for(LAYOUT, TOKENS)

    async def main():
        async with running_server(tmp_path) as (_, target):
            def use() -> None:
                with Client(target) as kv:
                    kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, generation=1)
                    assert_streams_equal(kv.restore("acme", "s1").persistent, persistent)
                    assert len(list(kv.restore_layers("acme", "s1"))) == 5
                    assert kv.stat().sessions == 1

            await asyncio.to_thread(use)

    asyncio.run(main())


def _private_shm_server(data_dir) -> tuple[subprocess.Popen, str]:
    """``kvtier serve`` in its own mount namespace with a private /dev/shm: on one host,
    yet unable to see the client's segments, as if it ran on another machine."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip("needs unshare -m (root or user namespaces)")
    serve = f"{sys.executable} -m services.cli serve --preset test --data-dir {data_dir}"
    script = f"mount -t tmpfs tmpfs /dev/shm && exec {serve} --log-level WARNING"
    process = subprocess.Popen(["unshare", "-m", "sh", "-c", script], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line.startswith("kvtier serving on "):
        process.kill()
        raise AssertionError(f"server did not start: {line!r}")
    return process, line.split()[-1]


@pytest.mark.slow  # a server process importing torch: ~10 s on the dev machine
def test_shared_memory_falls_back_to_inline_bytes_when_dev_shm_differs(tmp_path):
    tokens = tokens_for(TOKENS)
    persistent = streams_for(LAYOUT, TOKENS)
    process, target = _private_shm_server(tmp_path)
    try:
        with Client(target) as kv:  # loopback: it tries shared memory first
            assert kv.shared_memory
            kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, generation=1)
            assert not kv.shared_memory  # the server's segment is not mapped here
            assert_streams_equal(kv.restore("acme", "s1").persistent, persistent)
        with Client(target) as kv:  # a restore first: its reply segment is not here either
            assert_streams_equal(kv.restore("acme", "s1").persistent, persistent)
            assert not kv.shared_memory
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
