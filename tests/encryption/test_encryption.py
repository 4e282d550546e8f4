"""Encryption at rest over real media: the bytes in the data directory, in a real
redis-server and in S3 (moto) hold no plaintext chunk bytes and no token ids; a sealed
value opens only under its own key, tenant and layout; key rotation keeps old sessions
readable; the key never shows in the config's summary, repr or the startup log."""

from __future__ import annotations

import base64
import dataclasses
import logging
import os

import numpy as np
import pytest
import redis

from kvstore.encryption.seal import Keyring, MasterKey, keyring_from_file, read_header
from kvstore.format.errors import ChunkCorrupt, DataLoss, InvalidRequest
from kvstore.format.keys import split_block_key
from kvstore.session.prefix_chunks import ChunkWrite
from kvtier import AsyncClient
from kvtier import codec as cc
from services.server.config_load import load_config
from services.server.store import open_manager
from tests.support.fleet import shared_config
from tests.support.manager import TINY, make_session
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for

KEY_A = base64.b64encode(bytes(range(32))).decode()
KEY_B = base64.b64encode(bytes(range(100, 132))).decode()
# token ids no random test data holds: their bytes are searched for in the media
TOKENS = np.arange(0x7E570000, 0x7E570000 + 40, dtype=np.uint32)


def needles(session: dict) -> list[bytes]:
    """Distinctive plaintext: a slice of every chunk's payload and of the tail, and a
    run of the token ids as stored (little-endian uint32)."""
    parts = [data for _, data in session["chunks"]] + [session["tail"]]
    return [bytes(p[len(p) // 2 : len(p) // 2 + 48]) for p in parts] + [TOKENS[8:16].tobytes()]


def files_hold(root, wanted: list[bytes]) -> list[str]:
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as handle:
                blob = handle.read()
            found += [f"{name}: {n.hex()[:16]}" for n in wanted if n in blob]
    return found


def config_for(tmp_path, key: str | None = None, **overrides):
    env = {"KVTIER_ENCRYPTION_KEY": key} if key else {}
    return load_config(preset="test", env=env,
                       overrides={"data_dir": tmp_path / "data", **overrides})


async def spill_and_demote(managers, config, tenant="acme", session_id="s1", to="object",
                           seed=1):
    manager = managers.adopt(await open_manager(config))
    session = make_session(TOKENS, seed=seed, window=False, tenant=tenant)
    await manager.spill(tenant, session_id, generation=1, ack="memory", **session)
    await manager.drain()
    await manager.demote(tenant, session_id, to)
    return manager, session


async def check_restores(manager, session, tenant="acme", session_id="s1"):
    result = await manager.restore(tenant, session_id)
    assert [bytes(c) for c in result.chunks] == [d for _, d in session["chunks"]]
    assert result.manifest.tail == session["tail"]
    assert np.array_equal(result.manifest.token_ids, TOKENS)


@pytest.mark.parametrize("key", [None, KEY_A], ids=["clear", "sealed"])
async def test_data_dir_holds_no_plaintext(tmp_path, key, managers):
    manager, session = await spill_and_demote(managers, config_for(tmp_path, key), to="disk")
    assert manager.where(session["chunks"][0][0]) == ["disk"]
    await manager.demote("acme", "s1", "object")  # on disk, then in the object directory
    await managers.close(manager)
    found = files_hold(tmp_path / "data", needles(session))
    if key is None:  # the search finds what is there: chunks, tail and token ids
        assert len(found) >= len(needles(session))
        return
    assert found == []
    manager = await open_manager(config_for(tmp_path, key))
    try:
        assert manager.where(session["chunks"][0][0]) == ["object"]
        await check_restores(manager, session)
    finally:
        await manager.close()


async def test_redis_holds_no_plaintext_and_a_moved_value_is_data_loss(tmp_path, redis_server,
                                                                       managers):
    config = config_for(tmp_path, KEY_A, redis_url=redis_server, disk_bytes=0, object_bytes=0)
    manager, session = await spill_and_demote(managers, config, to="redis")
    try:
        other = make_session(TOKENS, seed=2, window=False, tenant="evil")
        await manager.spill("evil", "s1", generation=1, ack="memory", **other)
        await manager.demote("evil", "s1", "redis")
        client = redis.Redis.from_url(redis_server)
        stored = {k: client.get(k) for k in client.keys("kvtier:*")}
        values = [v for v in stored.values() if v]
        assert len(values) >= 2 * len(session["chunks"])
        assert not [n for n in needles(session) for v in values if n in v]
        assert all(read_header(v).domain in ("tenant:acme", "tenant:evil") for v in values
                   if v.startswith(b"KVTE"))
        # evil's ciphertext copied under acme's storage key: authentication fails, and
        # with no other copy (demote dropped the host's) the restore is DATA_LOSS
        victim = next(k for k in stored if session["chunks"][0][0].encode() in k)
        donor = next(k for k in stored if other["chunks"][0][0].encode() in k)
        client.set(victim, stored[donor])
        with pytest.raises(DataLoss, match="corrupt"):
            await manager.restore("acme", "s1")
    finally:
        await managers.close(manager)


async def test_a_moved_copy_falls_through_to_an_intact_one(tmp_path, redis_server):
    config = config_for(tmp_path, KEY_A, redis_url=redis_server, object_bytes=0)
    manager = await open_manager(config)
    try:
        mine = make_session(TOKENS, seed=1, window=False, tenant="acme")
        theirs = make_session(TOKENS, seed=2, window=False, tenant="evil")
        for tenant, session in (("acme", mine), ("evil", theirs)):
            await manager.spill(tenant, "s1", generation=1, ack="durable", **session)
        redis_tier = next(t for t in manager.tiers if t.name == "redis")
        for session in (mine, theirs):
            for key, data in session["chunks"]:  # a second copy, sealed in redis
                await redis_tier.put(key, data)
    finally:
        await manager.close()
    raw = redis.Redis.from_url(redis_server)
    victim, donor = mine["chunks"][0][0], theirs["chunks"][0][0]
    raw.set(f"kvtier:{victim}", raw.get(f"kvtier:{donor}"))
    manager = await open_manager(config)  # believes redis (above disk) holds both copies
    try:
        assert manager.where(victim) == ["redis", "disk"]
        result = await manager.restore("acme", "s1")
        assert [bytes(c) for c in result.chunks] == [d for _, d in mine["chunks"]]
        assert result.chunk_tiers[0] == "disk" and manager.counters.fallthrough_corrupt["redis"]
    finally:
        await manager.close()


async def test_s3_objects_hold_no_plaintext(tmp_path, s3_server, s3_bucket, s3_credentials,
                                            monkeypatch, managers):
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    config = config_for(tmp_path, KEY_A, s3_bucket=s3_bucket, s3_endpoint=s3_server,
                        s3_region="us-east-1")
    manager, session = await spill_and_demote(managers, config, to="object")
    try:
        client = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)
        listing = client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])
        bodies = [client.get_object(Bucket=s3_bucket, Key=o["Key"])["Body"].read()
                  for o in listing]
        assert len(bodies) == len(session["chunks"])
        assert all(read_header(b).domain == "tenant:acme" for b in bodies)
        assert not [n for n in needles(session) for b in bodies if n in b]
        await check_restores(manager, session)
    finally:
        await managers.close(manager)
    assert files_hold(tmp_path / "data", needles(session)) == []  # nor the manifests


def test_a_sealed_value_opens_only_under_its_key_domain_and_layout():
    ring = Keyring([MasterKey("k1", bytes(32))])
    sealed = ring.seal("abc.01", "tenant:acme", b"secret kv", 7)
    assert ring.open("abc.01", sealed)[1] == b"secret kv"
    with pytest.raises(ChunkCorrupt, match="authentication"):
        ring.open("abc.02", sealed)  # another storage key
    for old, new in ((b"tenant:acme", b"tenant:evil"), (b"\x07\x00", b"\x08\x00")):
        forged = sealed.replace(old, new, 1)  # the domain, or the layout hash
        with pytest.raises(ChunkCorrupt):
            ring.open("abc.01", forged)
    with pytest.raises(ChunkCorrupt, match="not hold"):
        Keyring([MasterKey("k2", bytes(32))]).open("abc.01", sealed)
    assert ring.seal("abc.01", "tenant:acme", b"secret kv", 7) != sealed  # fresh nonce


async def test_rotation_keeps_old_sessions_and_seals_new_ones_with_the_new_key(tmp_path,
                                                                             managers):
    key_file = tmp_path / "keys.toml"
    key_file.write_text(f'[[key]]\nid = "2026-11"\nmaterial = "{KEY_A}"\n')
    config = config_for(tmp_path, encryption_key_file=str(key_file), object_bytes=0)
    manager, old = await spill_and_demote(managers, config, to="disk")
    await managers.close(manager)
    key_file.write_text(f'[[key]]\nid = "2026-11"\nmaterial = "{KEY_A}"\n'
                        f'[[key]]\nid = "2026-12"\nmaterial = "{KEY_B}"\ncurrent = true\n')
    assert keyring_from_file(key_file).current == "2026-12"
    manager = await open_manager(config)
    try:
        await check_restores(manager, old)
        new = make_session(TOKENS, seed=3, window=False, tenant="acme")
        await manager.spill("acme", "s2", generation=1, ack="durable", **new)
        disk = next(t for t in manager.tiers if t.name == "disk")
        ids = {read_header(await disk.inner.get(k)).key_id
               for k in (old["chunks"][0][0], new["chunks"][0][0])}
        assert ids == {"2026-11", "2026-12"}
    finally:
        await manager.close()


async def test_the_key_is_never_shown(tmp_path):
    config = config_for(tmp_path, KEY_A)
    assert config.encrypts and KEY_A not in repr(config)
    assert config.summary()["encryption_key"] == "<secret>"
    assert KEY_A not in str(config.summary())
    with pytest.raises(InvalidRequest, match="not both"):
        await open_manager(config.replace(encryption_key_file=str(tmp_path / "k.toml")))
    with pytest.raises(InvalidRequest, match="32 bytes"):
        Keyring([MasterKey("short", b"x" * 16)])
    assert "material" not in repr(MasterKey("k", bytes(32)))
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[[key]]\nid = "k"\nmaterial = "{KEY_A}"\n junk = \n')
    with pytest.raises(InvalidRequest) as info:
        keyring_from_file(bad)
    assert KEY_A not in str(info.value)


async def test_startup_log_names_the_key_ids_not_the_key(tmp_path, caplog, managers):
    caplog.set_level(logging.DEBUG)
    manager = managers.adopt(await open_manager(config_for(tmp_path, KEY_A)))
    await managers.close(manager)
    assert "encryption at rest: on" in caplog.text and KEY_A not in caplog.text


def _prefix(count: int, seed: int):
    """(tokens, encoded chunks) of ``count`` whole chunks of the service tests' layout."""
    tokens = cc.as_tokens(tokens_for(count * LAYOUT.chunk_tokens, seed=seed))
    streams = streams_for(LAYOUT, count * LAYOUT.chunk_tokens, seed=seed)
    return tokens, cc.encode_chunks(LAYOUT, tokens, streams)


async def test_written_chunks_are_sealed_and_survive_a_restart_with_either_ack(tmp_path):
    """WriteChunks names its chunks' domain to the encrypting tiers as a spill does: the
    old main failed every durable ack (UNAVAILABLE, the domain unknown) and wrote back no
    memory-acked chunk, so after a restart ReadChunks found none."""
    key_file = tmp_path / "keys.toml"
    key_file.write_text(f'[[key]]\nid = "2026-11"\nmaterial = "{KEY_A}"\n')
    sealed = {"encryption_key_file": str(key_file)}
    durable, memory = _prefix(4, seed=1), _prefix(4, seed=2)
    async with running_server(tmp_path / "data", **sealed) as (server, target), \
            AsyncClient(target) as kv:
        for (tokens, chunks), ack in ((durable, "durable"), (memory, "memory")):
            written = await kv.write_chunks("acme", LAYOUT.name, tokens, chunks, ack=ack)
            assert written.chunks_written == 4 and written.durable == (ack == "durable")
        await server.manager.drain()
        assert server.manager.counters.writeback_failed == 0
    wanted = [bytes(c[len(c) // 2: len(c) // 2 + 48]) for _, chunks in (durable, memory)
              for c in chunks]
    assert files_hold(tmp_path / "data", wanted) == []  # on disk, sealed
    async with running_server(tmp_path / "data", **sealed) as (_, target), \
            AsyncClient(target) as kv:
        for tokens, chunks in (durable, memory):
            got = await kv.read_chunks("acme", LAYOUT.name, tokens)
            assert not got.missing
            assert [bytes(got.chunks[i]) for i in range(4)] == chunks


async def test_a_sealed_fleets_written_chunks_reach_the_bucket(tmp_path, s3_server, s3_bucket,
                                                               s3_credentials, monkeypatch):
    """Shared metadata: the bucket is the durable tier; chunks one node wrote (either
    ack) are read by another node from the bucket, sealed there."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])

    def node(name: str):
        return dataclasses.replace(
            shared_config(tmp_path, s3_server, s3_bucket, s3_credentials["region_name"],
                          name), encryption_key=KEY_A, retain_unreferenced=True)

    whole = 2 * TINY.chunk_tokens
    tokens = {"durable": TOKENS[:whole], "memory": TOKENS[:whole] + 64}  # two prefixes
    sessions = {ack: make_session(tokens[ack], seed=5, window=False, tenant="acme")
                for ack in tokens}
    writer = await open_manager(node("a"))
    try:
        for ack, session in sessions.items():
            written = await writer.write_chunks(ChunkWrite(
                tenant="acme", layout_id=TINY.layout_id, token_ids=tokens[ack],
                first_chunk=0, digests=[split_block_key(k)[1] for k, _ in session["chunks"]],
                chunks={i: data for i, (_, data) in enumerate(session["chunks"])}, ack=ack))
            assert written.written == len(session["chunks"])
        await writer.drain()
        assert writer.counters.writeback_failed == 0
    finally:
        await writer.close()
    reader = await open_manager(node("b"))
    try:
        for ack, session in sessions.items():
            got = await reader.read_chunks("acme", TINY.layout_id, tokens[ack], first_chunk=0,
                                           count=len(session["chunks"]))
            assert [r.missing for r in got] == [""] * len(got), ack
            assert [bytes(r.data) for r in got] == [d for _, d in session["chunks"]]
            assert {r.tier for r in got} == {"object"}
    finally:
        await reader.close()
