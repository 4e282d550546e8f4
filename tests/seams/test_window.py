"""Resume's replay_tokens against the stored window: a window rebuilt by a short replay
never stands in for a longer one or for the engine's own, a partial one (a replay
shorter than W) is never kept as the session's, a Resume that asks for more rebuilds it,
and every reply says how the window it returns was made.

Over a real server with in-process replay through the tiny model (W = 8, m = 4;
tests.replay_support), sessions spilled without a window so that a Resume replays; the
store's own rules (which window is kept, across hbm and host, in a fleet of two nodes
over moto's S3 server) through real tier managers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct

import pytest
import xxhash

from kvstore.format.errors import InvalidRequest
from kvstore.session.manager import TierManager
from kvstore.session.manifest import SessionManifest
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.host import HostTier
from kvtier import AsyncClient
from model.config import TINY
from model.infer import replay
from replay.state_codec import encode_window, state_from_chunks, state_to_chunks
from replay.worker import ReplayWorker
from services.server.config import ServerConfig
from services.server.store import open_manager
from tests.support.manager import WINDOW_TOKENS, make_session, random_tokens, tier_keys
from tests.support.replay import TINY_SPEC, tiny_model, tiny_session
from tests.support.service import running_server

N = 148  # more than R = 128, a multiple of m (no pending rows: R = 1 may replay)
MB = 1 << 20


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def session(model):
    """(state, chunks, tail, the engine's own window blob) of a prefilled session."""
    state, chunks, tail = tiny_session(model, N)
    return state, chunks, tail, state_to_chunks(TINY_SPEC, state)[2]


@contextlib.asynccontextmanager
async def serving(tmp_path, model):
    """A real server replaying through ``model``, and a client of it."""
    worker = ReplayWorker(model)
    try:
        async with running_server(tmp_path) as (server, target), AsyncClient(target) as kv:
            server.servicer.use_replay(worker, frozenset({TINY_SPEC.replayer}))
            yield kv
    finally:
        await worker.close()


async def spill(kv, name: str, session, *, window: bool = False) -> None:
    state, chunks, tail, blob = session
    await kv.spill("t", name, TINY_SPEC.layout_id, state.token_ids, chunks=chunks, tail=tail,
                   window=blob if window else None, generation=1)


def window_len(got) -> int:
    """Tokens the returned window holds, decoded as a replay worker would."""
    ready = state_from_chunks(TINY, got.token_ids, got.chunks, got.tail, got.window_blob,
                              spec=TINY_SPEC)
    return ready.window_len


async def test_a_longer_resume_rebuilds_the_window_a_short_one_left(tmp_path, model, session):
    async with serving(tmp_path, model) as kv:
        await spill(kv, "s1", session)
        await spill(kv, "fresh", session)
        short = await kv.resume("t", "s1", decode=False, replay_tokens=1)
        assert short.replayed and short.replay_tokens == 1
        assert window_len(short) == 1

        longer = await kv.resume("t", "s1", decode=False, replay_tokens=128)
        assert longer.replayed and longer.replay_tokens == 128
        fresh = await kv.resume("t", "fresh", decode=False, replay_tokens=128)
        assert fresh.replayed
        assert bytes(longer.window_blob) == bytes(fresh.window_blob)
        want = encode_window(TINY_SPEC, replay(model, session[0].without_window(), 128))
        assert bytes(longer.window_blob) == want
        assert window_len(longer) == TINY_SPEC.window_tokens

        # The longer window replaced the short one: it is what comes back now.
        again = await kv.resume("t", "s1", decode=False, replay_tokens=128)
        assert not again.replayed and bytes(again.window_blob) == want
        assert (await kv.stat()).replays == 3
        assert short.window_replayed_tokens == 1 and short.window_partial
        assert longer.window_replayed_tokens == 128 and not longer.window_partial
        assert again.window_replayed_tokens == 128 and not again.window_partial


async def test_a_shorter_resume_keeps_the_longer_window(tmp_path, model, session):
    async with serving(tmp_path, model) as kv:
        await spill(kv, "s1", session)
        full = await kv.resume("t", "s1", decode=False, replay_tokens=128)
        assert full.replayed and full.replay_tokens == 128
        short = await kv.resume("t", "s1", decode=False, replay_tokens=1)
        assert not short.replayed and bytes(short.window_blob) == bytes(full.window_blob)
        assert short.window_replayed_tokens == 128 and not short.window_partial
        restored = await kv.restore("t", "s1", decode=False)
        assert bytes(restored.window_blob) == bytes(full.window_blob)
        assert restored.window_replayed_tokens == 128

        # The engine's own window outranks every replay, even one of every token.
        _, _, _, blob = session
        await spill(kv, "own", session, window=True)
        for r in (1, 128, N, 8192):
            got = await kv.resume("t", "own", decode=False, replay_tokens=r)
            assert not got.replayed and bytes(got.window_blob) == blob
            assert got.window_replayed_tokens == 0 and not got.window_partial
        assert (await kv.stat()).replays == 1


async def test_a_short_replays_window_is_the_resumes_not_the_sessions(tmp_path, model,
                                                                      session):
    async with serving(tmp_path, model) as kv:
        await spill(kv, "s1", session)
        short = await kv.resume("t", "s1", decode=False, replay_tokens=1)
        assert short.replayed and short.window_partial and window_len(short) == 1
        # not kept: a Restore states no window, as a Resume with R = 128 would rebuild it
        restored = await kv.restore("t", "s1", decode=False)
        assert restored.window_blob is None and restored.replay_needed
        assert restored.window_replayed_tokens == 0 and not restored.window_partial
        plain = await kv.restore("t", "s1", want_window=False, decode=False)
        assert plain.replay_needed and plain.window_replayed_tokens == 0
        full = await kv.resume("t", "s1", decode=False, replay_tokens=TINY_SPEC.window_tokens)
        assert full.replayed and not full.window_partial
        kept = await kv.restore("t", "s1", decode=False)
        assert bytes(kept.window_blob) == bytes(full.window_blob)
        assert kept.window_replayed_tokens == TINY_SPEC.window_tokens and not kept.replay_needed
        assert window_len(kept) == TINY_SPEC.window_tokens

        await spill(kv, "own", session, window=True)
        own = await kv.restore("t", "own", decode=False)
        assert own.window_replayed_tokens == 0 and not own.window_partial


async def test_a_fork_carries_how_its_window_was_made(tmp_path, model, session):
    async with serving(tmp_path, model) as kv:
        await spill(kv, "s1", session)
        await spill(kv, "fresh", session)
        w = TINY_SPEC.window_tokens  # the shortest replay whose window is kept
        await kv.resume("t", "s1", decode=False, replay_tokens=w)
        forked = await kv.fork("t", "s1", "f1", upto_tokens=N)
        assert forked.window_kept
        restored = await kv.restore("t", "f1", decode=False)

        rebuilt = await kv.resume("t", "f1", decode=False, replay_tokens=128)
        assert rebuilt.replayed and rebuilt.replay_tokens == 128
        fresh = await kv.resume("t", "fresh", decode=False, replay_tokens=128)
        assert bytes(rebuilt.window_blob) == bytes(fresh.window_blob)
        # the source keeps its own shorter replay's window until it is asked for more
        source = await kv.restore("t", "s1", decode=False)
        assert restored.window_replayed_tokens == w and not restored.window_partial
        assert source.window_replayed_tokens == w and window_len(source) == w


async def test_concurrent_short_and_long_resumes_leave_the_long_window(tmp_path, model,
                                                                        session):
    async with serving(tmp_path, model) as kv:
        await spill(kv, "s1", session)
        await spill(kv, "fresh", session)
        await asyncio.gather(*(kv.resume("t", "s1", decode=False, replay_tokens=r)
                               for r in (1, 128, 1, 1)))
        fresh = await kv.resume("t", "fresh", decode=False, replay_tokens=128)
        kept = await kv.resume("t", "s1", decode=False, replay_tokens=128)
        assert not kept.replayed and bytes(kept.window_blob) == bytes(fresh.window_blob)


async def test_replay_tokens_is_bounded_with_clear_errors(tmp_path, model):
    pending = tiny_session(model, N + 2, seed=3)  # 2 pending rows: a replay needs R >= 2
    async with serving(tmp_path, model) as kv:
        await spill(kv, "s1", (*pending, None))
        with pytest.raises(InvalidRequest, match="exceeds 8192"):
            await kv.resume("t", "s1", decode=False, replay_tokens=8193)
        with pytest.raises(InvalidRequest, match="shorter than the 2 tokens of the unfinished"):
            await kv.resume("t", "s1", decode=False, replay_tokens=1)
        assert (await kv.restore("t", "s1", decode=False)).replay_needed  # nothing stored
        default = await kv.resume("t", "s1", decode=False)  # 0: the server's R = 128
        assert default.replayed and default.replay_tokens == 128
        every = await kv.resume("t", "s1", decode=False, replay_tokens=8192)  # capped at n
        assert every.replayed and every.replay_tokens == N + 2
        assert every.window_replayed_tokens == N + 2 and not every.window_partial


async def test_the_store_keeps_the_window_of_largest_coverage_across_tiers(tmp_path):
    disk = DiskTier(tmp_path / "disk", 64 * MB)
    manager = await TierManager.open([HBMTier(MB, device="cpu"), HostTier(MB), disk],
                                     disk.meta)
    try:
        args = make_session(random_tokens(16 * 3 + 6, seed=5))
        n = len(args["token_ids"])
        await manager.spill("t", "s", generation=1, **{**args, "window": None})
        blob = args["window"]

        w = WINDOW_TOKENS
        # a partial window (a replay shorter than W) is never kept
        assert await manager.store_window("t", "s", 1, blob, replayed_tokens=w - 1) is None
        assert (await manager.get_manifest("t", "s")).window_key is None
        assert await manager.store_window("t", "s", 1, blob, replayed_tokens=w) == "hbm"
        first = await manager.get_manifest("t", "s")
        assert first.window_replayed == w and first.window_coverage == w
        assert await manager.store_window("t", "s", 1, blob, replayed_tokens=20) == "hbm"
        longer = await manager.get_manifest("t", "s")
        assert longer.window_replayed == 20 and longer.window_key != first.window_key
        assert first.window_key not in await tier_keys(manager.tiers[0])  # replaced
        for shorter in (1, 4, 20):  # nothing shorter, nor as long, replaces it
            assert await manager.store_window("t", "s", 1, blob, replayed_tokens=shorter)
            kept = await manager.get_manifest("t", "s")
            assert (kept.window_key, kept.window_replayed) == (longer.window_key, 20)

        demoted = await manager.demote("t", "s", "host")  # hbm -> host: still that window
        assert demoted.window_tier == "host" and demoted.window_replayed == 20
        assert bytes((await manager.restore("t", "s")).window) == bytes(blob)
        every = await manager.store_window("t", "s", 1, blob, replayed_tokens=n)
        assert every is not None and (await manager.get_manifest("t", "s")).window_coverage == n

        dropped = await manager.demote("t", "s", "disk")  # no window below the memory
        assert dropped.window_key is None and dropped.window_replayed == 0
        for bad in (0, n + 1):
            with pytest.raises(InvalidRequest, match="replayed_tokens must lie in"):
                await manager.store_window("t", "s", 1, blob, replayed_tokens=bad)
    finally:
        await manager.close()


def test_a_manifest_states_how_its_window_was_made():
    made = SessionManifest(tenant="t", session_id="s", layout_id=TINY_SPEC.layout_id,
                           generation=1, token_ids=list(range(40)), chunk_keys=(),
                           chunk_sizes=(), window_tier="host", window_key="win/t/s/1r5",
                           window_replayed=5)
    assert SessionManifest.decode(made.encode()).window_replayed == 5
    assert made.window_coverage == 5
    assert made.evolve(window_replayed=0).window_coverage == 40  # the engine's own
    assert made.evolve(window_replayed=400).window_coverage == 40  # every token
    gone = made.evolve(window_tier=None, window_key=None)
    assert gone.window_replayed == 0  # describes no window
    remote = made.evolve(window_tier=None, window_key=None, remote_window=("host", "k"))
    assert remote.window_replayed == 5  # another node's window, as that node made it
    # A manifest written before the field existed names the engine's own window.
    old = SessionManifest.decode(without_field(made.encode(), "window_replayed"))
    assert old.window_replayed == 0 and old.window_key == "win/t/s/1r5"
    with pytest.raises(InvalidRequest, match="window_replayed"):
        made.evolve(window_replayed=-1)


def without_field(encoded: bytes, name: str) -> bytes:
    """A manifest encoding (docs in kvstore.session.manifest) with ``name`` left out of its JSON."""
    magic, version, size = struct.unpack_from("<4sHI", encoded)
    head = json.loads(encoded[10:10 + size])
    del head[name]
    body = json.dumps(head, separators=(",", ":")).encode()
    out = struct.pack("<4sHI", magic, version, len(body)) + body + encoded[10 + size:-8]
    return out + struct.pack("<Q", xxhash.xxh3_64_intdigest(out))


@pytest.fixture
def node_config(tmp_path, s3_server, s3_bucket, s3_credentials, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])

    def make(node: str) -> ServerConfig:
        return ServerConfig(data_dir=tmp_path / node, host_bytes=8 * MB, disk_bytes=64 * MB,
                            object_bytes=1 << 30, s3_endpoint=s3_server, s3_bucket=s3_bucket,
                            s3_region=s3_credentials["region_name"],
                            object_compression_level=-1, metadata="shared", node_id=node)
    return make


async def test_a_short_replay_on_another_node_leaves_a_longer_window_named(node_config,
                                                                           managers):
    a, b = [managers.adopt(await open_manager(node_config(name))) for name in "ab"]
    try:
        args = make_session(random_tokens(16 * 3 + 6, seed=7), tenant="acme")
        n = len(args["token_ids"])
        await a.spill("acme", "s1", generation=1, ack="durable", **args)
        on_a = await a.get_manifest("acme", "s1")
        # b sees no window of its own (a's is in a's memory) and replays; a shorter
        # window of b's does not take the session from a's own.
        assert await b.store_window("acme", "s1", 1, args["window"],
                                    replayed_tokens=WINDOW_TOKENS) is None
        still = await a.get_manifest("acme", "s1")
        assert (still.node_id, still.window_key, still.window_replayed) == \
            ("a", on_a.window_key, 0)
        assert (await b.get_manifest("acme", "s1")).remote_window is not None
        # A replay of every token is as good, and here: the session's window moves to b.
        assert await b.store_window("acme", "s1", 1, args["window"],
                                    replayed_tokens=n) == "host"
        moved = await a.get_manifest("acme", "s1")
        assert moved.node_id == "b" and moved.window_key is None
        assert moved.remote_window is not None and moved.window_replayed == n

        # b's replay of 20 tokens outranks a's of 10; a's of 30 takes the window to a.
        await a.spill("acme", "s2", generation=1, ack="durable", **{**args, "window": None})
        assert await b.store_window("acme", "s2", 1, args["window"], replayed_tokens=20)
        assert await a.store_window("acme", "s2", 1, args["window"], replayed_tokens=10) is None
        assert (await b.get_manifest("acme", "s2")).window_replayed == 20
        assert await a.store_window("acme", "s2", 1, args["window"],
                                    replayed_tokens=30) == "host"
        assert (await b.get_manifest("acme", "s2")).node_id == "a"
    finally:
        for manager in (a, b):
            await managers.close(manager)


@pytest.mark.parametrize("pending", [0, 3], ids=["whole-entries", "pending-rows"])
async def test_a_whole_fork_copies_the_window_whatever_its_pending_rows(tmp_path, pending):
    from tests.support.service import LAYOUT, streams_for, tokens_for, window_for

    n = 2 * LAYOUT.chunk_tokens + 80 + pending  # m = 4: the last `pending` tokens unfinished
    window = window_for(LAYOUT, n)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "src", LAYOUT, tokens_for(n), streams_for(LAYOUT, n),
                       window=window, generation=1, ack="durable")
        source = await kv.restore("acme", "src")
        reply = await kv.fork("acme", "src", "copy", upto_tokens=n)
        assert reply.num_tokens == n and reply.window_kept
        copy = await kv.restore("acme", "copy")
        assert copy.window_tier == "host"
        assert bytes(copy.window_blob) == bytes(source.window_blob)
