"""KVTierStorage against SGLang 0.5.23's own code: its host pools (MHA and MLA, every
layout), its backend factory and its fault injector, over a real kvtier server, with
SGLang's HiCacheFile on the same keys as the reference answer."""

from __future__ import annotations

import itertools
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from kvstore.format.chunk import FLAG_ZSTD, HEADER_DTYPE  # noqa: E402
from kvtier import shm  # noqa: E402
from kvtier.integrations.sglang.pages import KV_POOL, PageFormat, key_tokens  # noqa: E402
from kvtier.integrations.sglang.storage import KVTierStorage  # noqa: E402
from testing.sglang_pools import (  # noqa: E402
    KINDS,
    KVTIER,
    LAYOUTS,
    backend,
    fill_random,
    host_pool,
    page_indices,
    storage_config,
)
from tests.support.service import threaded_server  # noqa: E402

FINGERPRINT = "test-model@1"


def kvtier_backend(server: str, kind: str, layout: str, pool, **options):
    extra = {**KVTIER, "server": server, "model_fingerprint": FINGERPRINT,
             "tenant": "acme", "timeout_ms": 5000}
    extra.update({k: v for k, v in options.items() if k not in ("tp_rank", "tp_size")})
    ranks = {k: v for k, v in options.items() if k in ("tp_rank", "tp_size")}
    return backend("dynamic", pool, storage_config(kind, layout, extra, **ranks))


def file_backend(path, kind: str, layout: str, pool):
    return backend("file", pool, storage_config(kind, layout, {"file_storage_path": str(path)}))


def keys(n: int) -> list[str]:
    run = uuid.uuid4().hex  # every test its own pages on the shared server
    return [f"{run}-{i}" for i in range(n)]


def page(pool, slot_page: int) -> torch.Tensor:
    return pool.get_data_page(slot_page * pool.page_size, flat=True).clone()


@pytest.mark.parametrize("kind,layout", list(itertools.product(KINDS, LAYOUTS)))
def test_pages_round_trip_through_the_host_pool_as_hicache_file_answers(
        kvtier_server, tmp_path, kind, layout):
    source, target, reference = (host_pool(kind, layout) for _ in range(3))
    pages = fill_random(source, 4, seed=1)
    store = kvtier_backend(kvtier_server.target, kind, layout, source)
    files = file_backend(tmp_path, kind, layout, source)
    assert isinstance(store, KVTierStorage)
    stored, absent = keys(4), keys(1)[0]
    # pages 0, 1 and 3 stored: 2 is a gap
    written = [stored[0], stored[1], stored[3]]
    assert store.batch_set_v1(written, page_indices(source, [0, 1, 3])) == [True] * 3
    assert files.batch_set(written, [page(source, p) for p in (0, 1, 3)])
    store.register_mem_pool_host(target)
    files.register_mem_pool_host(reference)

    asked = [*stored, absent]
    assert store.batch_exists(asked) == files.batch_exists(asked) == 2
    assert [store.exists(k) for k in asked] == [files.exists(k) for k in asked]
    got = store.batch_get_v1(asked, page_indices(target, [0, 1, 2, 3, 4]))
    dummies = [reference.get_dummy_flat_data_page() for _ in asked]
    expected = [d is not None for d in files.batch_get(asked, dummies)]
    assert got == expected == [True, True, False, True, False]
    for slot, p in ((0, 0), (1, 1), (3, 3)):
        assert torch.equal(page(target, slot).view(torch.uint8), pages[p].view(torch.uint8))
    assert not page(target, 2).view(torch.uint8).any()  # a miss leaves its slot alone

    # the legacy calls: flat pages in and out
    flat = [target.get_dummy_flat_data_page() for _ in asked]
    legacy = store.batch_get(asked, flat)
    assert [t is not None for t in legacy] == expected
    assert torch.equal(legacy[3].view(torch.uint8), pages[3].view(torch.uint8))
    assert store.get(absent, target.get_dummy_flat_data_page()) is None
    assert store.set(stored[2], page(source, 2))
    assert store.batch_exists(asked) == 4


def test_v1_calls_answer_one_bool_per_key_never_none(kvtier_server):
    pool = host_pool("mha", "page_first")
    store = kvtier_backend(kvtier_server.target, "mha", "page_first", pool)
    # host indices that do not fit the keys: every key a miss, not an exception or None
    assert store.batch_get_v1(keys(2), page_indices(pool, [0])) == [False, False]
    assert store.batch_set_v1(keys(2), page_indices(pool, [0])) == [False, False]
    assert store.batch_get_v1([], page_indices(pool, [])) == []
    # a legacy set of no page, or of a page of another size: False, not an exception
    assert store.set(keys(1)[0], None) is False
    assert store.batch_set(keys(2), [page(pool, 0), page(pool, 0)[:8]]) is False


def v2_pools(kind: str, layout: str):
    return {PoolName.KV: host_pool(kind, layout), PoolName.MAMBA: host_pool("mha", layout),
            PoolName.SWA: host_pool("mha", layout)}


def register_v2(store, pools) -> None:
    """As SGLang's controller: every pool (the KV one too) by its name."""
    for name, pool in pools.items():
        store.register_mem_host_pool_v2(pool, name)


@pytest.mark.parametrize("kind", KINDS)
def test_v2_hits_under_every_policy_are_hicache_files(kvtier_server, tmp_path, kind):
    layout = "page_first"
    pools = v2_pools(kind, layout)
    for n, pool in enumerate(pools.values()):
        fill_random(pool, 6, seed=10 + n)
    store = kvtier_backend(kvtier_server.target, kind, layout, pools[PoolName.KV])
    files = file_backend(tmp_path, kind, layout, pools[PoolName.KV])
    for b in (store, files):
        register_v2(b, pools)
    page_keys = keys(6)
    # KV pages 0-4 (5 missing); Mamba pages 0-2 and 4 (3 missing); SWA pages 1-4
    present = {PoolName.KV: [0, 1, 2, 3, 4], PoolName.MAMBA: [0, 1, 2, 4],
               PoolName.SWA: [1, 2, 3, 4]}
    transfers = [PoolTransfer(name=name, keys=[page_keys[p] for p in at],
                              host_indices=page_indices(pools[name], at))
                 for name, at in present.items()]
    assert store.batch_set_v2(transfers) == files.batch_set_v2(transfers) == {
        str(name): [True] * len(at) for name, at in present.items()}

    cases = [
        [PoolTransfer(PoolName.MAMBA, keys=page_keys[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES)],
        [PoolTransfer(PoolName.MAMBA, keys=page_keys[:2], hit_policy=PoolHitPolicy.TRAILING_PAGES)],
        [PoolTransfer(PoolName.MAMBA, keys=page_keys, hit_policy=PoolHitPolicy.ALL_PAGES)],
        [PoolTransfer(PoolName.SWA, keys=page_keys, hit_policy=PoolHitPolicy.ALL_PAGES)],
        [PoolTransfer(PoolName.SWA, keys=page_keys[:2], hit_policy=PoolHitPolicy.TRAILING_PAGES),
         PoolTransfer(PoolName.MAMBA, keys=page_keys[:1],
                      hit_policy=PoolHitPolicy.TRAILING_PAGES)],
        [],
    ]
    for case in cases:
        ours = store.batch_exists_v2(page_keys, case)
        theirs = files.batch_exists_v2(page_keys, case)
        assert (ours.kv_hit_pages, ours.extra_pool_hit_pages, ours.restorable_prefix_pages) == (
            theirs.kv_hit_pages, theirs.extra_pool_hit_pages, theirs.restorable_prefix_pages), case
    # a partial hit: the reference agrees it is one
    assert files.batch_exists_v2(page_keys, cases[2]).kv_hit_pages == 3

    targets = {name: host_pool(kind if name == PoolName.KV else "mha", layout)
               for name in pools}
    for b in (store, files):
        b.register_mem_pool_host(targets[PoolName.KV])
        register_v2(b, targets)
    reads = [PoolTransfer(name=name, keys=page_keys, host_indices=page_indices(targets[name],
                                                                                range(6)))
             for name in pools]
    got = store.batch_get_v2(reads)
    assert got == files.batch_get_v2(reads)
    for name, at in present.items():
        assert got[str(name)] == [p in at for p in range(6)]
        for p in at:
            assert torch.equal(page(targets[name], p).view(torch.uint8),
                               page(pools[name], p).view(torch.uint8))


def rpcs(live, method: str) -> float:
    """Calls of ``method`` the server answered so far (every status)."""
    return sum(sample.value for metric in live.server.servicer.metrics.requests.collect()
               for sample in metric.samples
               if sample.name.endswith("_total") and sample.labels["method"].endswith(method))


def test_a_batch_of_pages_is_one_call_each_way(kvtier_server):
    """SGLang's batches (v1 and v2, every pool) cost one kvtier call a layout, not one a
    page; a page missing among them is a miss alone."""
    pool, target = host_pool("mha", "page_first"), host_pool("mha", "page_first")
    fill_random(pool, 16, seed=6)
    store = kvtier_backend(kvtier_server.target, "mha", "page_first", pool)
    page_keys = keys(17)
    before = {m: rpcs(kvtier_server, m) for m in ("WriteChunks", "ReadChunks", "Lookup")}
    assert store.batch_set_v1(page_keys[:16], page_indices(pool, range(16))) == [True] * 16
    assert store.batch_exists(page_keys) == 16
    store.register_mem_pool_host(target)
    got = store.batch_get_v1(page_keys[15:] + page_keys[:15],
                             page_indices(target, range(17)))
    assert got == [True, False] + [True] * 15
    after = {m: rpcs(kvtier_server, m) - before[m] for m in before}
    assert after == {"WriteChunks": 1, "ReadChunks": 1, "Lookup": 1}
    # a key twice in one call: written once, both answered
    twice = keys(1) * 2
    assert store.batch_set_v1(twice, page_indices(pool, [3, 3])) == [True, True]
    assert store.batch_exists(twice) == 2
    for p in range(15):
        assert torch.equal(page(target, p + 2).view(torch.uint8),
                           page(pool, p).view(torch.uint8))

    pools = v2_pools("mha", "page_first")  # three pools of one page size: one layout
    for n, one in enumerate(pools.values()):
        fill_random(one, 4, seed=20 + n)
    v2 = kvtier_backend(kvtier_server.target, "mha", "page_first", pools[PoolName.KV])
    register_v2(v2, pools)
    v2_keys = keys(4)
    transfers = [PoolTransfer(name=name, keys=v2_keys, host_indices=page_indices(one, range(4)))
                 for name, one in pools.items()]
    before = {m: rpcs(kvtier_server, m) for m in ("WriteChunks", "ReadChunks", "Lookup")}
    assert v2.batch_set_v2(transfers) == {str(name): [True] * 4 for name in pools}
    hit = v2.batch_exists_v2(v2_keys, [PoolTransfer(PoolName.MAMBA, keys=v2_keys,
                                                    hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert hit.kv_hit_pages == 4
    assert v2.batch_get_v2(transfers) == {str(name): [True] * 4 for name in pools}
    after = {m: rpcs(kvtier_server, m) - before[m] for m in before}
    assert after == {"WriteChunks": 1, "ReadChunks": 1, "Lookup": 1}


@pytest.mark.skipif(not shm.available(), reason="no /dev/shm")
def test_pages_held_in_host_ram_load_in_place_from_the_servers_slabs(tmp_path):
    """A host tier that holds the pages: a get reads them where they lie in the server's
    shared memory (pinned under a read lease, released after), bit for bit."""
    with threaded_server(tmp_path, host_bytes=64 << 20, object_bytes=0) as live:
        pool, target = host_pool("mha", "page_first"), host_pool("mha", "page_first")
        fill_random(pool, 8, seed=9)
        store = kvtier_backend(live.target, "mha", "page_first", pool)
        page_keys = keys(8)
        assert store.batch_set_v1(page_keys, page_indices(pool, range(8))) == [True] * 8
        store.register_mem_pool_host(target)
        for _ in range(2):  # the first moves them into the tenant's slabs
            got = store.batch_get_v1(page_keys, page_indices(target, range(8)))
            assert got == [True] * 8
            for p in range(8):
                assert torch.equal(page(target, p).view(torch.uint8),
                                   page(pool, p).view(torch.uint8))
        assert live.server.servicer.metrics.restore_bytes.labels("in_place")._value.get() > 0
        deadline = time.monotonic() + 10
        while live.server.servicer.leases.reads:  # released off SGLang's thread
            assert time.monotonic() < deadline, "the read leases were not released"
            time.sleep(0.02)
        store.close()


def test_block_groups_count_whole_groups_from_the_start_and_never_gate_the_kv_hit(
        kvtier_server):
    layout = "page_first"
    pools = v2_pools("mha", layout)
    for pool in pools.values():
        fill_random(pool, 6)
    store = kvtier_backend(kvtier_server.target, "mha", layout, pools[PoolName.KV])
    register_v2(store, pools)
    page_keys = keys(6)
    store.batch_set_v1(page_keys[:4], page_indices(pools[PoolName.KV], range(4)))
    # the pool's own keys: groups of 2; groups 0 and 1 whole, group 2 missing its last key
    store.batch_set_v2([PoolTransfer(PoolName.SWA, keys=page_keys[:5],
                                     host_indices=page_indices(pools[PoolName.SWA], range(5)))])
    groups = PoolTransfer(PoolName.SWA, keys=page_keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS,
                          block_pages=3, group_pages=2)
    result = store.batch_exists_v2(page_keys, [groups])
    assert result.kv_hit_pages == 4 and result.restorable_prefix_pages == [1, 2, 3, 4]
    assert result.extra_pool_hit_pages == {PoolName.KV: 4, str(PoolName.SWA): 6}
    bad = PoolTransfer(PoolName.SWA, keys=page_keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    assert store.batch_exists_v2(page_keys, [bad]).kv_hit_pages == 0  # no geometry: no hit


def test_mha_pages_are_per_tp_rank_and_mla_pages_shared_written_by_one_rank(kvtier_server):
    page_keys = keys(2)
    for kind in KINDS:
        pools = [host_pool(kind, "page_first") for _ in range(2)]
        data = fill_random(pools[1], 2, seed=3)
        ranks = [kvtier_backend(kvtier_server.target, kind, "page_first", pool, tp_rank=r,
                                tp_size=2) for r, pool in enumerate(pools)]
        at = page_indices(pools[1], [0, 1])
        assert ranks[1].batch_set_v1(page_keys, at) == [True, True]
        if kind == "mha":  # rank 1's heads are not rank 0's
            assert ranks[0].batch_exists(page_keys) == 0
            assert ranks[1].batch_exists(page_keys) == 2
            continue
        # MLA rank 1 is not its shard's writer: nothing was stored
        assert ranks[0].batch_exists(page_keys) == ranks[1].batch_exists(page_keys) == 0
        fill_random(pools[0], 2, seed=3)
        assert ranks[0].batch_set_v1(page_keys, at) == [True, True]
        target = host_pool(kind, "page_first")
        ranks[1].register_mem_pool_host(target)
        assert ranks[1].batch_get_v1(page_keys, page_indices(target, [0, 1])) == [True, True]
        assert torch.equal(page(target, 1).view(torch.uint8), data[1].view(torch.uint8))


def test_a_page_of_another_model_or_tenant_is_a_miss(kvtier_server):
    pool = host_pool("mha", "page_first")
    fill_random(pool, 1)
    page_keys = keys(1)
    store = kvtier_backend(kvtier_server.target, "mha", "page_first", pool)
    assert store.batch_set_v1(page_keys, page_indices(pool, [0])) == [True]
    other_model = kvtier_backend(kvtier_server.target, "mha", "page_first", pool,
                                 model_fingerprint="other-model@1")
    other_tenant = kvtier_backend(kvtier_server.target, "mha", "page_first", pool,
                                  tenant="beta")
    for other in (other_model, other_tenant):
        assert other.batch_exists(page_keys) == 0
        assert other.batch_get_v1(page_keys, page_indices(pool, [1])) == [False]
    assert store.batch_exists(page_keys) == 1


def test_a_corrupt_page_is_a_miss_and_the_others_still_load(kvtier_server):
    pool, target = host_pool("mha", "page_first"), host_pool("mha", "page_first")
    pages = fill_random(pool, 3, seed=4)
    store = kvtier_backend(kvtier_server.target, "mha", "page_first", pool)
    page_keys = keys(3)
    assert store.batch_set_v1(page_keys, page_indices(pool, range(3))) == [True] * 3
    # page 1's bytes flipped where the server keeps them
    marker = pages[1].view(torch.uint8).numpy().tobytes()
    hits = 0
    for segment in (kvtier_server.data_dir / "disk" / "segments").iterdir():
        raw = bytearray(segment.read_bytes())
        at = raw.find(marker)
        if at >= 0:
            raw[at + len(marker) // 2] ^= 0xFF
            segment.write_bytes(bytes(raw))
            hits += 1
    assert hits == 1
    store.register_mem_pool_host(target)
    assert store.batch_get_v1(page_keys, page_indices(target, range(3))) == [True, False, True]
    assert not page(target, 1).view(torch.uint8).any()
    assert torch.equal(page(target, 2).view(torch.uint8), pages[2].view(torch.uint8))


def test_random_failures_and_delays_lose_nothing_and_return_nothing_wrong(
        kvtier_server, monkeypatch):
    pool, target = host_pool("mha", "layer_first"), host_pool("mha", "layer_first")
    pages = fill_random(pool, 8, seed=5)
    page_keys = keys(8)
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    flaky = kvtier_backend(kvtier_server.target, "mha", "layer_first", pool)
    assert not isinstance(flaky, KVTierStorage)  # SGLang's injector wraps it
    stored: set[int] = set()
    for _ in range(20):  # the backup thread's way: each batch until it lands
        todo = [p for p in range(8) if p not in stored]
        done = flaky.batch_set_v1([page_keys[p] for p in todo], page_indices(pool, todo))
        stored.update(p for p, ok in zip(todo, done, strict=True) if ok)
    flaky.register_mem_pool_host(target)
    loaded: set[int] = set()
    for _ in range(20):
        got = flaky.batch_get_v1(page_keys, page_indices(target, range(8)))
        for p, ok in enumerate(got):
            if ok:  # whatever it says it loaded is the page's bytes
                assert torch.equal(page(target, p).view(torch.uint8), pages[p].view(torch.uint8))
                loaded.add(p)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE")
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY")
    steady = kvtier_backend(kvtier_server.target, "mha", "layer_first", pool)
    assert stored == set(range(8)) and loaded == set(range(8))
    assert steady.batch_exists(page_keys) == 8


@pytest.mark.parametrize("server", ["hung", "down"])
def test_a_hung_or_down_server_gives_misses_within_the_deadline(request, server):
    pool = host_pool("mha", "page_first")
    fill_random(pool, 2)
    target = request.getfixturevalue(f"{server}_server")
    store = kvtier_backend(target, "mha", "page_first", pool, timeout_ms=100)
    page_keys = keys(2)
    at = page_indices(pool, [0, 1])
    started = time.monotonic()
    answers = [store.batch_set_v1(page_keys, at), store.batch_get_v1(page_keys, at),
               store.batch_exists(page_keys), store.get(page_keys[0], page(pool, 0)),
               store.batch_set(page_keys, [page(pool, 0), page(pool, 1)]),
               store.batch_exists_v2(page_keys).kv_hit_pages]
    # six calls of a 100 ms deadline: far from the client's own 60 s
    assert time.monotonic() - started < 30
    assert answers == [[False, False], [False, False], 0, None, False, 0]
    assert store.breaker.is_open  # later calls answer at once, sending nothing


def test_extra_config_errors_name_the_key(kvtier_server):
    pool = host_pool("mha", "page_first")
    with pytest.raises(ValueError, match="timeout_msec"):
        kvtier_backend(kvtier_server.target, "mha", "page_first", pool, timeout_msec=5)
    with pytest.raises(ValueError, match="model_fingerprint is required"):
        kvtier_backend(kvtier_server.target, "mha", "page_first", pool, model_fingerprint="")
    with pytest.raises(ValueError, match="timeout_ms"):
        kvtier_backend(kvtier_server.target, "mha", "page_first", pool, timeout_ms="soon")


def test_prefix_keys_do_not_change_a_page(kvtier_server):
    """SGLang's keys are already chained over the tokens before them: a page is the same
    object whatever prefix a call names."""
    pool = host_pool("mha", "page_first")
    fill_random(pool, 2)
    page_keys = keys(2)
    store = kvtier_backend(kvtier_server.target, "mha", "page_first", pool)
    store.batch_set_v1(page_keys, page_indices(pool, [0, 1]),
                       HiCacheStorageExtraInfo(prefix_keys=["a", "b"]))
    assert store.batch_exists(page_keys[1:], HiCacheStorageExtraInfo(prefix_keys=None)) == 1


def test_a_chunk_gives_its_page_only_uncompressed_and_of_the_pools_size():
    pool = host_pool("mha", "page_first")
    fill_random(pool, 1, seed=6)
    fmt = PageFormat.of(KV_POOL, pool)
    source = page(pool, 0)
    chunk = fmt.encode(source, key_tokens("a page"))
    payload = fmt.payload(chunk)
    assert payload is not None
    assert bytes(payload) == source.view(torch.uint8).numpy().tobytes()
    flagged = bytearray(chunk)
    np.frombuffer(flagged, HEADER_DTYPE, count=1)["flags"] |= FLAG_ZSTD
    assert fmt.payload(flagged) is None  # zstd bytes are not the page's
    assert fmt.payload(chunk[:-1]) is None
    assert fmt.payload(chunk + b"\0") is None
