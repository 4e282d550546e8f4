"""The worker side against a real server, without an engine: blocks saved from one paged
cache load bit for bit into another's blocks layer by layer, a gap in the store ends a
load (that block and every later one are load errors), a request's saves over a failed
load are dropped and reported; saves never hold a block and never wait: with the writer
stuck on a hung server, saves beyond the queue are skipped and counted, and a finished
session request is released in the step that copies its blocks."""

import logging
import os
import threading
import time
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.model_executor.models.utils import extract_layer_index  # noqa: E402

import kvtier  # noqa: E402
from kvtier.integrations.breaker import Link  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig  # noqa: E402
from kvtier.integrations.vllm.layout import CacheShape, rank_layout  # noqa: E402
from kvtier.integrations.vllm.metadata import (  # noqa: E402
    KVTierConnectorMetadata,
    LoadPlan,
    SavePlan,
    SpillPlan,
)
from kvtier.integrations.vllm.repack import PagedLayout  # noqa: E402
from kvtier.integrations.vllm.stats import StatsCounter  # noqa: E402
from kvtier.integrations.vllm.transfers import Store  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402
from tests.support.service import threaded_server  # noqa: E402

BS, H, D, LAYERS, BLOCKS = 16, 2, 16, 2, 8
SHAPE = CacheShape(LAYERS, H, D, BS, 1000, torch.bfloat16, 1, "cpu_attn.vec")
SPEC = rank_layout(SHAPE, 0, "auto")  # engine pages
PORTABLE = rank_layout(SHAPE, 0, "portable")  # token-major K and V
INT4 = rank_layout(SHAPE, 0, "int4")  # token-major K and V, int4
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
TOKENS = [(11 * i) % 991 + 1 for i in range(3 * BS)]


@pytest.fixture(scope="module")
def client(kvtier_server):
    with kvtier.Client(kvtier_server.target) as c:
        for spec in (SPEC, PORTABLE, INT4):
            c.register_layout(spec)
        yield c


def worker(target: str, seed: int | None, *, depth: int = 8, spec=SPEC):
    """A worker side over a fresh CPU cache (random when ``seed`` is given, else zeros),
    storing under ``spec``, its link up (as if the server had just answered)."""
    config = ConnectorConfig.from_extra({"server": target, "tenant": "worker",
                                         "model_fingerprint": "worker-test", "ack": "durable",
                                         "save_queue_depth": depth, "probe_interval_s": 600})
    g = torch.Generator().manual_seed(seed or 0)
    caches = {name: (torch.randn(BLOCKS, H, BS, 2 * D, generator=g) if seed is not None
                     else torch.zeros(BLOCKS, H, BS, 2 * D)).to(torch.bfloat16)
              for name in NAMES}
    paged = PagedLayout("cpu", H, D, BS, pages=spec.streams[0].format == "page")
    link = Link(kvtier.Client(target, timeout_s=5), [spec], server=target, failures=3,
                probe_interval_s=600, logger=logging.getLogger("test"))
    link.breaker.succeeded()
    side = WorkerSide(lambda group, layers, p, stats: Store(link.client, config, spec, p,
                                                            layers, torch.bfloat16, stats),
                      [SHAPE], 0, {0: paged}, link, queue_depth=depth)
    side.register_kv_caches(caches, extract_layer_index)
    return side, caches


def run_step(side, caches, meta: KVTierConnectorMetadata, finished=()):
    """One step as vLLM's model runner drives it; (load errors, finished sends)."""
    side.start_load_kv(meta)
    for name in NAMES:
        side.wait_for_layer_load(name)
        side.save_kv_layer(meta, name, caches[name])
    side.wait_for_save(meta)
    done, _ = side.get_finished(set(finished))
    return side.get_block_ids_with_load_errors(), done or set()


def wait_held(client, tokens, tokens_held: int, spec=SPEC) -> None:
    deadline = time.monotonic() + 30
    while client.lookup("worker", spec, tokens, model="worker-test") < tokens_held:
        assert time.monotonic() < deadline, "the saves did not land"
        time.sleep(0.05)


@pytest.mark.parametrize("spec", [SPEC, PORTABLE], ids=["pages", "token-major"])
def test_saved_blocks_load_bit_for_bit_into_other_blocks(client, kvtier_server, spec):
    source, src = worker(kvtier_server.target, seed=1, spec=spec)
    errors, _ = run_step(source, src, KVTierConnectorMetadata(
        saves=[SavePlan("w", tuple(TOKENS), 0, (3, 5, 6))]))
    assert errors == set()
    wait_held(client, TOKENS, 3 * BS, spec)
    target, dst = worker(kvtier_server.target, seed=None, spec=spec)
    errors, _ = run_step(target, dst, KVTierConnectorMetadata(
        loads=[LoadPlan("r", tuple(TOKENS), 0, (1, 2, 4))]))
    assert errors == set()
    for name in NAMES:
        assert torch.equal(dst[name][[1, 2, 4]].view(torch.int16),
                           src[name][[3, 5, 6]].view(torch.int16))
        assert not dst[name][[0, 3, 5, 6, 7]].any()  # no other block touched
    stats = target.take_stats().data
    assert (stats["loads"], stats["loaded_tokens"], stats["load_error_blocks"]) == (1, 48, 0)


@pytest.mark.skipif(not kvtier.shm.available(), reason="no /dev/shm")
@pytest.mark.parametrize("spec", [SPEC, PORTABLE], ids=["pages", "token-major"])
def test_blocks_held_in_host_ram_load_in_place_from_the_servers_slabs(tmp_path, spec):
    """A host tier that holds the blocks: the second load reads them where they lie in
    the server's shared memory (pinned under a read lease, released after), bit for bit."""
    with threaded_server(tmp_path, host_bytes=64 << 20, object_bytes=0) as live, \
            kvtier.Client(live.target) as c:
        c.register_layout(spec)
        source, src = worker(live.target, seed=1, spec=spec)
        errors, _ = run_step(source, src, KVTierConnectorMetadata(
            saves=[SavePlan("w", tuple(TOKENS), 0, (3, 5, 6))]))
        assert errors == set()
        wait_held(c, TOKENS, 3 * BS, spec)
        metrics = live.server.servicer.metrics
        for n in range(2):  # the first moves them into the tenant's slabs
            target, dst = worker(live.target, seed=None, spec=spec)
            errors, _ = run_step(target, dst, KVTierConnectorMetadata(
                loads=[LoadPlan(f"r{n}", tuple(TOKENS), 0, (1, 2, 4))]))
            assert errors == set()
            for name in NAMES:
                assert torch.equal(dst[name][[1, 2, 4]].view(torch.int16),
                                   src[name][[3, 5, 6]].view(torch.int16))
                assert not dst[name][[0, 3, 5, 6, 7]].any()
        assert metrics.restore_bytes.labels("in_place")._value.get() > 0
        deadline = time.monotonic() + 10
        while live.server.servicer.leases.reads:  # released off the engine's path
            assert time.monotonic() < deadline, "the read leases were not released"
            time.sleep(0.02)


def test_int4_blocks_load_within_half_a_step_of_what_was_saved(client, kvtier_server):
    """value_format int4: what a load writes into the engine's pages is within half a
    step of what was saved (a group's absmax / 7 / 2, a group being a token's K or V of
    one head), plus the rounding to the engine's bf16; nothing else is touched."""
    tokens = [(13 * i) % 977 + 3 for i in range(2 * BS)]
    source, src = worker(kvtier_server.target, seed=4, spec=INT4)
    errors, _ = run_step(source, src, KVTierConnectorMetadata(
        saves=[SavePlan("q", tuple(tokens), 0, (2, 6))]))
    assert errors == set()
    wait_held(client, tokens, 2 * BS, INT4)
    target, dst = worker(kvtier_server.target, seed=None, spec=INT4)
    errors, _ = run_step(target, dst, KVTierConnectorMetadata(
        loads=[LoadPlan("l", tuple(tokens), 0, (0, 3))]))
    assert errors == set()
    for name in NAMES:
        saved, loaded = src[name][[2, 6]].float(), dst[name][[0, 3]].float()
        # (blocks, H, BS, 2 D) in the engine's arrangement: a block's head holds its
        # tokens' groups, each with a step of at most the head's absmax / 7
        step = saved.abs().amax((-2, -1), keepdim=True) / 7
        assert ((loaded - saved).abs() <= step / 2 * 1.01 + saved.abs() * 2.0 ** -8).all()
        assert not torch.equal(loaded, saved)  # 4 bits, not a copy
        assert not dst[name][[1, 2, 4, 5, 6, 7]].any()


def test_pages_of_one_block_arrangement_are_not_found_by_another(client, kvtier_server):
    """Pages saved by an engine whose blocks are laid out one way (vec) are not found by
    one that lays them out another way (amx): another layout id, other chunk keys; its
    load of them is a load error for every block, and nothing is written."""
    amx = rank_layout(replace(SHAPE, arrangement="cpu_attn.amx"), 0, "auto")
    client.register_layout(amx)
    assert amx.layout_id != SPEC.layout_id
    tokens = [(19 * i) % 971 + 5 for i in range(2 * BS)]
    source, src = worker(kvtier_server.target, seed=7)
    run_step(source, src, KVTierConnectorMetadata(
        saves=[SavePlan("v", tuple(tokens), 0, (0, 1))]))
    wait_held(client, tokens, 2 * BS)
    assert client.lookup("worker", SPEC, tokens, model="worker-test") == 2 * BS
    assert client.lookup("worker", amx, tokens, model="worker-test") == 0
    target, dst = worker(kvtier_server.target, seed=None, spec=amx)
    errors, _ = run_step(target, dst, KVTierConnectorMetadata(
        loads=[LoadPlan("a", tuple(tokens), 0, (2, 3))]))
    assert errors == {2, 3}
    assert not any(dst[name].any() for name in NAMES)


def test_a_gap_ends_the_load_and_saves_over_it_are_dropped(client, kvtier_server):
    source, src = worker(kvtier_server.target, seed=2)
    other = [(13 * i) % 983 + 2 for i in range(3 * BS)]
    run_step(source, src, KVTierConnectorMetadata(
        saves=[SavePlan("w0", tuple(other[:BS]), 0, (4,))]))
    wait_held(client, other[:BS], BS)  # only its first block is held
    target, dst = worker(kvtier_server.target, seed=None)
    meta = KVTierConnectorMetadata(loads=[LoadPlan("g", tuple(other), 0, (0, 1, 2))],
                                   saves=[SavePlan("g", tuple(other) + (5,) * BS, 3, (3,))])
    errors, _ = run_step(target, dst, meta)
    assert errors == {1, 2}
    assert dst[NAMES[0]][0].any() and not dst[NAMES[0]][[1, 2]].any()
    assert target.build_connector_worker_meta().unsaved == {"g": 3 * BS}
    assert target.build_connector_worker_meta() is None  # reported once
    assert target.take_stats().data["load_error_blocks"] == 2
    # a store that does not answer fails the whole load, and no forward waits forever
    dead = kvtier.Client("127.0.0.1:9", retry=kvtier.RetryPolicy(attempts=1), timeout_s=1)
    live = target.store.client
    try:
        target.store.client = dead
        errors, _ = run_step(target, dst, KVTierConnectorMetadata(
            loads=[LoadPlan("x", tuple(TOKENS), 0, (5, 6, 7))]))
        assert errors == {5, 6, 7}
    finally:
        target.store.client = live
        dead.close()


def test_a_chunk_damaged_in_the_store_ends_the_load(client, kvtier_server):
    """Chunk 1 of 3 corrupted on disk: block 0 loads bit for bit, blocks 1 and 2 are load
    errors (nothing after a bad chunk is used), and no other block is touched."""
    source, src = worker(kvtier_server.target, seed=4)
    tokens = [(17 * i) % 977 + 3 for i in range(3 * BS)]
    run_step(source, src, KVTierConnectorMetadata(
        saves=[SavePlan("d", tuple(tokens), 0, (0, 1, 2))]))
    wait_held(client, tokens, 3 * BS)
    damaged = bytes(client.read_chunks("worker", SPEC, tokens,
                                       model_fingerprint="worker-test").chunks[1])
    hits = 0
    for segment in (kvtier_server.data_dir / "disk" / "segments").iterdir():
        raw = bytearray(segment.read_bytes())
        at = raw.find(damaged)
        if at >= 0:
            raw[at + len(damaged) // 2] ^= 0xFF
            segment.write_bytes(bytes(raw))
            hits += 1
    assert hits == 1
    target, dst = worker(kvtier_server.target, seed=None)
    errors, _ = run_step(target, dst, KVTierConnectorMetadata(
        loads=[LoadPlan("d2", tuple(tokens), 0, (5, 3, 7))]))
    assert errors == {3, 7}
    for name in NAMES:
        assert torch.equal(dst[name][5].view(torch.int16), src[name][0].view(torch.int16))
        assert not dst[name][[0, 1, 2, 3, 4, 6, 7]].any()


def test_compressed_pages_are_decoded_and_written_as_they_were():
    """Page chunks that cannot be read in place (zstd-compressed) are decoded one by one
    and go into the blocks byte for byte, as the in-place ones do."""
    from kvstore.format.chunk import encode_chunk
    from kvtier.integrations.vllm import values
    from kvtier.integrations.vllm.transfers import _streams, gathered

    g = torch.Generator().manual_seed(9)
    src = torch.randn(BLOCKS, H, BS, 2 * D, generator=g).to(torch.bfloat16)
    paged = PagedLayout("cpu", H, D, BS, pages=True)
    store = Store(None, None, SPEC, paged, [src] * LAYERS, torch.bfloat16, StatsCounter())
    index = store.block_index([6, 2])
    pages = gathered([paged.take(layer, index) for layer in store.layers],
                     store)["page"]  # (layers, 2, page bytes)
    chunks = [encode_chunk(SPEC, i * BS, TOKENS[i * BS:(i + 1) * BS],
                           {"page": values.encode(SPEC.stream("page"), pages[:, i:i + 1])},
                           zstd_level=3) for i in range(2)]
    [(start, streams)] = _streams(store, chunks, LoadPlan("z", tuple(TOKENS), 0, (0, 1)))
    assert start == 0  # decoded: one run
    target = torch.zeros_like(src)
    paged.put_pages(target, torch.tensor([1, 4]), streams["page"][0])
    assert torch.equal(target[[1, 4]].view(torch.int16), src[[6, 2]].view(torch.int16))
    assert not target[[0, 2, 3, 5, 6, 7]].any()


def test_chunks_lying_in_stretches_are_read_in_runs_without_a_copy():
    """Uncompressed chunks where a server's slabs put them: evenly spaced in stretches
    (slots of one slab), one elsewhere. Each stretch is one view of where they lie, and
    the pages are those of the chunks."""
    import numpy as np

    from kvstore.format.chunk import encode_chunk
    from kvtier.integrations.vllm import values
    from kvtier.integrations.vllm.transfers import _streams, gathered

    g = torch.Generator().manual_seed(4)
    src = torch.randn(BLOCKS, H, BS, 2 * D, generator=g).to(torch.bfloat16)
    paged = PagedLayout("cpu", H, D, BS, pages=True)
    store = Store(None, None, SPEC, paged, [src] * LAYERS, torch.bfloat16, StatsCounter())
    pages = gathered([paged.take(layer, store.block_index([5, 1, 7, 2]))
                      for layer in store.layers], store)["page"]  # (layers, 4, page bytes)
    tokens = TOKENS + TOKENS[:BS]
    chunks = [encode_chunk(SPEC, i * BS, tokens[i * BS:(i + 1) * BS], {"page": values.encode(
        SPEC.stream("page"), pages[:, i:i + 1])}) for i in range(4)]
    size, step = len(chunks[0]), len(chunks[0]) + 64  # a slot: the chunk rounded up
    slab = np.zeros(12 * step, np.uint8)
    places = [0, step, 2 * step, 9 * step]  # three in a stretch, the last elsewhere
    for chunk, at in zip(chunks, places, strict=True):
        slab[at:at + size] = np.frombuffer(chunk, np.uint8)
    views = [memoryview(slab)[at:at + size] for at in places]
    runs = _streams(store, views, LoadPlan("z", tuple(tokens), 0, (0, 1, 2, 3)))
    assert [start for start, _ in runs] == [0, 3]
    first = runs[0][1]["page"][0]  # layer 0's pages of the stretch, where they lie
    assert first.untyped_storage().data_ptr() == slab.ctypes.data
    got = torch.cat([streams["page"][0].reshape(-1) for _, streams in runs])
    assert torch.equal(got, pages[0].reshape(-1))


def test_saves_beyond_the_queue_are_skipped_and_no_block_waits_for_a_hung_server(
        hung_server):
    """The writer stuck on a server that never answers, a queue of one: the first save is
    being written, the second waits, every later one is skipped and counted (that
    request's later saves too), and a finished session request is released in the step
    that copies its blocks, its spill skipped."""
    side, caches = worker(hung_server, seed=3, depth=1)
    try:
        for i, req in enumerate(("a", "b", "c")):
            run_step(side, caches, KVTierConnectorMetadata(
                saves=[SavePlan(req, tuple(TOKENS[:BS]), 0, (i,))]))
            time.sleep(0.2)  # the writer takes "a" off the queue and blocks on it
        _, done = run_step(side, caches, KVTierConnectorMetadata(
            saves=[SavePlan("c", tuple(TOKENS[:2 * BS]), 1, (4,))],
            spills=[SpillPlan("s", "chat", 1, tuple(TOKENS[:20]), (5, 6))], delayed=["s"]),
            finished={"s"})
        assert done == {"s"}  # released at once: its blocks were copied, or skipped
        assert side.take_stats().data["saves_skipped"] == 3  # c twice, s's spill
    finally:
        side.shutdown()


def test_while_kvtier_is_down_a_step_copies_no_block_and_counts_its_saves_skipped(
        client, kvtier_server, monkeypatch):
    side, caches = worker(kvtier_server.target, seed=5)
    try:
        for _ in range(3):  # the breaker's threshold: an outage
            side.link.breaker.failed()
        assert not side.link.up
        copies = []
        take = PagedLayout.take
        monkeypatch.setattr(PagedLayout, "take",
                            lambda self, *a: copies.append(1) or take(self, *a))
        tokens = tuple(TOKENS[:2 * BS])
        fresh = tuple(t + 3 for t in tokens)  # tokens no other test stores
        run_step(side, caches, KVTierConnectorMetadata(
            saves=[SavePlan("a", tokens, 0, (0, 1)), SavePlan("b", tokens, 0, (2, 3))]))
        assert copies == []  # the forward path copied nothing for saves that cannot go
        assert side.take_stats().data["saves_skipped"] == 2  # one per request
        side.link.succeeded()  # back up: "a" stays abandoned (a gap), a new request saves
        run_step(side, caches, KVTierConnectorMetadata(
            saves=[SavePlan("a", tuple(TOKENS[:3 * BS]), 2, (4,)),
                   SavePlan("c", fresh, 0, (5, 6))]))
        assert side.take_stats().data["saves_skipped"] == 1
        wait_held(client, list(fresh), 2 * BS)
    finally:
        side.shutdown()


@pytest.mark.parametrize("kind", ["cpu", "nhd"])
def test_pages_laid_out_in_place_are_the_chunks_the_encoder_makes(kind):
    from kvtier.integrations.vllm.transfers import gathered, page_chunks

    g = torch.Generator().manual_seed(9)
    # cpu: (blocks, H, BS, 2D); nhd: (2, blocks, BS, H, D), its blocks on axis 1
    shape = (BLOCKS, H, BS, 2 * D) if kind == "cpu" else (2, BLOCKS, BS, H, D)
    layers = [torch.randn(*shape, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    paged = PagedLayout(kind, H, D, BS, pages=True)
    store = Store(None, None, SPEC, paged, layers, torch.bfloat16, StatsCounter())
    index = store.block_index([6, 1, 3])  # blocks out of order: chunks 1, 2, 3
    raw = [paged.take(layer, index) for layer in layers]
    tokens = TOKENS + TOKENS[:BS]
    made = page_chunks(raw, store, tokens, BS)
    assert [bytes(c) for c in made] == store.encode_blocks(gathered(raw, store), tokens, BS,
                                                           3 * BS)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs thread affinity and two CPUs")
def test_a_background_thread_leaves_the_forwards_cores_and_yields_to_it():
    from kvtier.integrations.vllm.worker import off_forward_cores

    forward = {min(os.sched_getaffinity(0))}
    seen = {}

    def background():
        os.sched_setaffinity(0, forward)  # as a thread started by vLLM's bound worker
        off_forward_cores(forward, niceness=5)
        seen["cpus"] = os.sched_getaffinity(0)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        off_forward_cores(None)  # unbound: stays where it is
        seen["unbound"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen["cpus"] and not seen["cpus"] & forward
    assert seen["nice"] == os.getpriority(os.PRIO_PROCESS, 0) + 5 or seen["nice"] == 19
    assert seen["unbound"] == seen["cpus"]
    assert os.sched_getaffinity(0) != seen["cpus"]  # the calling thread was not moved


# DeepSeek-V4's compressed global group (tests/vllm/test_deepseek_v4.py, GROUPS[3]): three
# layers of one shared allocation, each a strided view of its real page bytes; vLLM pads
# each page (8,640 / 37,440 / 1,728 B), so a block of the buffer is 47,808 B.
LATENT_BLOCK = 256
LATENT_PAGES = (8448, 37376, 1168)  # 64 x 132 B, 64 x 584 B, 2 x 584 B: 1,168 / 256 is no int
LATENT_NAMES = ("model.layers.1.attn.indexer.k_cache", "model.layers.1.attn",
                "model.layers.2.attn")
LATENT = CacheShape(3, 1, 512, LATENT_BLOCK, 1000, torch.uint8, 1, "raw",
                    layer_names=LATENT_NAMES, spec_name="MLAAttentionSpec",
                    page_bytes=LATENT_PAGES)
LATENT_SPEC = rank_layout(LATENT, 0, "auto")


def latent_views(buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The worker's views of one (blocks, 47,808) uint8 buffer: (blocks, 1, entries, bytes)."""
    at, views = 0, {}
    for name, page, padded, entry in zip(LATENT_NAMES, LATENT_PAGES, (8640, 37440, 1728),
                                         (132, 584, 584), strict=True):
        views[name] = buffer[:, at:at + page].view(buffer.shape[0], 1, page // entry, entry)
        at += padded
    return views


def latent_worker(target: str, buffer: torch.Tensor) -> WorkerSide:
    config = ConnectorConfig.from_extra({"server": target, "tenant": "worker",
                                         "model_fingerprint": "worker-test", "ack": "durable",
                                         "probe_interval_s": 600})
    link = Link(kvtier.Client(target, timeout_s=5), [LATENT_SPEC], server=target, failures=3,
                probe_interval_s=600, logger=logging.getLogger("test"))
    link.breaker.succeeded()
    paged = PagedLayout("raw", 1, 512, LATENT_BLOCK, pages=True)
    side = WorkerSide(lambda group, layers, p, stats: Store(link.client, config, LATENT_SPEC,
                                                            p, layers, torch.uint8, stats),
                      [LATENT], 0, {0: paged}, link, queue_depth=8)
    side.register_kv_caches(latent_views(buffer), extract_layer_index)
    return side


def test_latent_pages_without_per_layer_hooks_are_saved_after_and_loaded_before_the_forward(
        client, kvtier_server):
    """Layers vLLM never names in a per-layer hook (DeepSeek-V4's): their blocks are saved
    after the forward pass (``wait_for_save``) and a load is written before it
    (``start_load_kv`` returns with the blocks in), each layer's real page bytes (1,168 B
    a block included) bit for bit, the padding between them never touched; a chunk damaged
    in the store ends the load there: that block and the next are load errors, unwritten."""
    client.register_layout(LATENT_SPEC)
    assert [s.entry_shape for s in LATENT_SPEC.streams] == [(1, p) for p in LATENT_PAGES]
    g = torch.Generator().manual_seed(11)
    src = torch.randint(0, 256, (BLOCKS, 47808), generator=g, dtype=torch.uint8)
    tokens = [(23 * i) % 967 + 4 for i in range(3 * LATENT_BLOCK)]
    source = latent_worker(kvtier_server.target, src)
    meta = KVTierConnectorMetadata(saves=[SavePlan("l", tuple(tokens), 0, (6, 1, 4))])
    source.start_load_kv(meta)
    source.wait_for_save(meta)  # no hook ran: the blocks are copied out here
    assert source.build_connector_worker_meta() is None  # nothing left unsaved
    wait_held(client, tokens, 3 * LATENT_BLOCK, LATENT_SPEC)
    chunks = client.read_chunks("worker", LATENT_SPEC, tokens,
                                model_fingerprint="worker-test").chunks
    real = torch.zeros(47808, dtype=torch.bool)  # a block's page bytes, not its padding
    real[:8448] = real[8640:8640 + 37376] = real[8640 + 37440:8640 + 37440 + 1168] = True

    def load(blocks: tuple[int, ...]) -> tuple[torch.Tensor, set[int]]:
        """What the forward pass reads once ``start_load_kv`` returned; the load errors."""
        dst = torch.zeros_like(src)
        target = latent_worker(kvtier_server.target, dst)
        meta = KVTierConnectorMetadata(loads=[LoadPlan("r", tuple(tokens), 0, blocks)])
        target.start_load_kv(meta)
        seen = dst.clone()
        target.wait_for_save(meta)
        return seen, target.get_block_ids_with_load_errors()

    seen, errors = load((2, 7, 0))
    assert errors == set()
    for block, saved in ((2, 6), (7, 1), (0, 4)):
        assert torch.equal(seen[block, real], src[saved, real])
    assert not seen[:, ~real].any() and not seen[[1, 3, 4, 5, 6]].any()
    damaged = bytes(chunks[1])
    hits = 0
    for segment in (kvtier_server.data_dir / "disk" / "segments").iterdir():
        raw = bytearray(segment.read_bytes())
        at = raw.find(damaged)
        if at >= 0:
            raw[at + len(damaged) - 100] ^= 0xFF  # in the 1,168 B page, the chunk's last
            segment.write_bytes(bytes(raw))
            hits += 1
    assert hits == 1
    seen, errors = load((3, 5, 2))
    assert errors == {5, 2}
    assert torch.equal(seen[3, real], src[6, real]) and not seen[3, ~real].any()
    assert not seen[[0, 1, 2, 4, 5, 6, 7]].any()
