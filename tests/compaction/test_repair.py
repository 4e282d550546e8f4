"""``kvtier repair``: the disk index rebuilt from the segments, and a corrupt index refused.

Sessions are spilled durably, some deleted, the LMDB environment is damaged (seeded
random byte flips in data.mdb, or data.mdb removed), then: opening the tier as a
writer either works or raises IndexCorrupt naming the repair (in a child process per
trial, so an abort in mdb.c would show as a signal, not kill pytest), and after
``kvtier repair`` every session restores bit-exact, deleted ones stay deleted.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.format.errors import IndexCorrupt
from kvstore.session.manager import TierManager
from kvstore.session.manifest import MANIFEST_PREFIX, SessionManifest, manifest_key
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk.index import DiskIndex, SegState
from kvstore.tiers.disk.lock import WRITER_LOCK, DirLock
from kvstore.tiers.host import HostTier
from stress.faults.repair_trials import opens_in_child
from tests.support.manager import make_session, random_tokens, running_manager

MB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
KEPT = [f"s{i}" for i in range(5)]
DELETED = ["gone0", "gone1"]

def chunk_bytes(args: dict) -> list[bytes]:
    return [bytes(c) for _, c in args["chunks"]]


async def build(disk_dir: Path) -> dict[str, dict]:
    sessions = {name: make_session(random_tokens(16 * 5 + i, seed=40 + i), window=False)
                for i, name in enumerate(KEPT + DELETED)}
    disk = DiskTier(disk_dir, 64 * MB, segment_bytes=16 << 10)
    async with running_manager([HostTier(MB), disk], disk.meta) as manager:
        for name, args in sessions.items():
            await manager.spill("t", name, generation=1, ack="durable", **args)
        for name in DELETED:
            await manager.delete("t", name)
    return {name: sessions[name] for name in KEPT}


def run_repair(disk_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "repair", "--data-dir",
                           str(disk_dir), "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


async def check_restores(disk_dir: Path, sessions: dict[str, dict]) -> None:
    disk = DiskTier(disk_dir, 64 * MB, segment_bytes=16 << 10)
    manager = await TierManager.open([HostTier(MB), disk], disk.meta)
    try:
        for name, args in sessions.items():
            result = await manager.restore("t", name)
            assert [bytes(c) for c in result.chunks] == chunk_bytes(args)
            assert result.chunk_tiers == ["disk"] * len(args["chunks"])
            assert bytes(result.manifest.tail) == bytes(args["tail"])
        listed = sorted(m.session_id for m in await manager.list_sessions("t"))
        assert listed == sorted(sessions)  # the deleted ones stay deleted
        await manager.delete("t", KEPT[0])  # reference counts were recounted
        assert await manager.restore("t", KEPT[1])
    finally:
        await manager.close()


async def test_repair_after_data_mdb_is_deleted(tmp_path):
    disk_dir = tmp_path / "disk"
    sessions = await build(disk_dir)
    (disk_dir / "index" / "data.mdb").unlink()
    segments = sorted(p.name for p in (disk_dir / "segments").iterdir())
    with pytest.raises(IndexCorrupt, match="kvtier repair"):
        DiskTier(disk_dir, 64 * MB)  # not an empty index that would remove every segment
    assert sorted(p.name for p in (disk_dir / "segments").iterdir()) == segments

    done = run_repair(disk_dir)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert sorted(report["sessions"]) == [f"t/{name}" for name in KEPT]
    assert report["incomplete"] == [] and report["corrupt_manifests"] == []
    assert Path(report["moved_aside"]).is_dir()  # kept, never deleted
    await check_restores(disk_dir, sessions)


async def test_each_manifest_is_stored_once_and_repair_brings_back_its_latest(tmp_path):
    """A manifest's bytes live in its segment record alone (the index names the key with
    an empty value); a new generation supersedes it (a demotion does not rewrite it), and
    a repair from the segments alone brings back the newer one, byte for byte."""
    disk_dir = tmp_path / "disk"
    names = ["a", "b", "c"]
    first = {name: make_session(random_tokens(16 * 4 + i, seed=50 + i))
             for i, name in enumerate(names)}
    sessions = {name: make_session(random_tokens(16 * 5 + i, seed=60 + i))
                for i, name in enumerate(names)}
    disk = DiskTier(disk_dir, 64 * MB, segment_bytes=16 << 10)
    async with running_manager([HostTier(MB), disk], disk.meta) as manager:
        for name in names:
            await manager.spill("t", name, generation=1, ack="durable", **first[name])
            await manager.spill("t", name, generation=2, ack="durable", **sessions[name])
            assert (await manager.get_manifest("t", name)).window_key is not None
            before = await disk.meta.get(manifest_key("t", name))
            await manager.demote("t", name, "disk")  # the window goes, the record stays
            assert await disk.meta.get(manifest_key("t", name)) == before
            assert (await manager.get_manifest("t", name)).window_key is None
        stored = {name: await disk.meta.get(manifest_key("t", name)) for name in names}
    assert all(SessionManifest.decode(raw).generation == 2 for raw in stored.values())
    index = DiskIndex(disk_dir / "index", map_size=1 << 30)
    try:
        rows = index.meta_scan(MANIFEST_PREFIX.encode())
    finally:
        index.close()
    assert [(key, value) for key, value, _ in rows] == [
        (manifest_key("t", name).encode(), b"") for name in names]
    assert all(entry is not None and entry.value_len > len(stored[key.decode().split("/")[-1]])
               for key, _, entry in rows)  # the record: sequence number + the manifest

    (disk_dir / "index" / "data.mdb").unlink()
    done = run_repair(disk_dir)
    assert done.returncode == 0, done.stderr
    assert sorted(json.loads(done.stdout)["sessions"]) == [f"t/{name}" for name in names]
    disk = DiskTier(disk_dir, 64 * MB, segment_bytes=16 << 10)
    async with running_manager([HostTier(MB), disk], disk.meta) as manager:
        for name, args in sessions.items():
            assert await disk.meta.get(manifest_key("t", name)) == stored[name]
            result = await manager.restore("t", name)
            assert [bytes(c) for c in result.chunks] == chunk_bytes(args)
            assert result.replay_needed and result.window is None


async def test_repair_reports_orphans_and_keeps_them(tmp_path, opened):
    disk_dir = tmp_path / "disk"
    disk = opened.adopt(DiskTier(disk_dir, 64 * MB))
    await disk.put("lonely-chunk", b"nobody names me")
    await opened.close(disk)
    shutil.rmtree(disk_dir / "index")
    done = run_repair(disk_dir)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["orphans"] == ["lonely-chunk"]
    disk = opened.adopt(DiskTier(disk_dir, 64 * MB))
    assert bytes(await disk.get("lonely-chunk")) == b"nobody names me"
    await opened.close(disk)


def test_repair_refuses_beside_a_live_writer(tmp_path):
    disk_dir = tmp_path / "disk"
    (disk_dir / "segments").mkdir(parents=True)
    lock = DirLock(disk_dir / WRITER_LOCK, "the disk tier's writer lock")
    lock.acquire()
    try:
        done = run_repair(disk_dir)
    finally:
        lock.release()
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "writer lock" in done.stderr


async def flip_campaign(tmp_path: Path, trials: int, flips: int) -> None:
    pristine = tmp_path / "pristine"
    sessions = await build(pristine)
    outcomes = []
    for trial in range(trials):
        disk_dir = tmp_path / f"trial{trial}"
        shutil.copytree(pristine, disk_dir)
        data = disk_dir / "index" / "data.mdb"
        raw = bytearray(data.read_bytes())
        rng = random.Random(trial)
        for _ in range(flips):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        data.write_bytes(bytes(raw))
        opened = opens_in_child(disk_dir)  # an mdb.c abort would kill this process
        assert opened in ("opened", "corrupt"), (trial, opened)
        outcomes.append(opened)
        done = run_repair(disk_dir)
        assert done.returncode == 0, (trial, done.stderr)
        await check_restores(disk_dir, sessions)
        shutil.rmtree(disk_dir)
    assert len(outcomes) == trials


async def test_byte_flips_in_the_index_are_refused_then_repaired(tmp_path):
    await flip_campaign(tmp_path, trials=4, flips=8)


@pytest.mark.slow
async def test_byte_flip_campaign(tmp_path):
    await flip_campaign(tmp_path, trials=35, flips=16)


def test_serve_on_a_corrupt_index_says_one_line(tmp_path):
    disk_dir = tmp_path / "data" / "disk"
    (tmp_path / "data").mkdir(mode=0o700)  # as the server keeps it: no warning to tighten it
    (disk_dir / "index").mkdir(parents=True)
    (disk_dir / "index" / "data.mdb").write_bytes(b"\xff" * 16384)
    done = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--data-dir",
                           str(tmp_path / "data"), "--listen", "127.0.0.1:0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "kvtier repair --data-dir" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


async def test_a_segment_size_below_its_entries_is_refused_not_cut(tmp_path):
    """A flipped bit that lowers a segment's committed end in the index once made the
    writer's open cut committed records off the segment file, beyond any repair."""
    disk_dir = tmp_path / "disk"
    sessions = await build(disk_dir)
    index = DiskIndex(disk_dir / "index", map_size=1 << 30)
    info = next(i for i in index.all_segments() if i.state == SegState.SEALED)
    info.file_bytes -= 16
    index.set_segments([info])
    index.close()
    files = {p.name: p.read_bytes() for p in (disk_dir / "segments").iterdir()}
    with pytest.raises(IndexCorrupt, match="kvtier repair"):
        DiskTier(disk_dir, 64 * MB)
    assert {p.name: p.read_bytes() for p in (disk_dir / "segments").iterdir()} == files
    assert run_repair(disk_dir).returncode == 0
    await check_restores(disk_dir, sessions)


async def test_a_session_whose_chunks_the_log_lost_is_data_loss_not_a_clean_repair(tmp_path):
    disk_dir = tmp_path / "disk"
    sessions = await build(disk_dir)
    disk = DiskTier(disk_dir, 64 * MB, writer=False)
    try:  # a segment holding a chunk of a session whose manifest lies in another one
        for name, args in sessions.items():
            (_, _, record), = disk.index.meta_scan(manifest_key("t", name).encode(),
                                                   exact=True)
            chunk = next((key for key, _ in args["chunks"]
                          if disk.index.lookup(key.encode()).seg_id != record.seg_id), None)
            if chunk is not None:
                lost = disk.index.lookup(chunk.encode()).seg_id
                break
    finally:
        await disk.close()
    next(p for p in (disk_dir / "segments").iterdir() if int(p.stem) == lost).unlink()
    shutil.rmtree(disk_dir / "index")
    done = run_repair(disk_dir)
    assert done.returncode == 1 and "DATA_LOSS" in done.stderr, done.stderr
    report = json.loads(done.stdout)
    assert any(line.startswith(f"t/{name}: ") for line in report["lost"])
    assert f"t/{name}" in report["incomplete"]
