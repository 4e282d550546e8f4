"""Disk tier under damage and crashes: torn tails, lost and flipped bytes, stray
segment files, a SIGKILLed durable writer, a full file system, and a compactor in
another process beside a live writer. Real files, real subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.format.errors import ChunkCorrupt, ChunkNotFound, ChunkTruncated
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk.index import SegState
from kvstore.tiers.disk.segments import HEADER_SIZE, encode_header, segment_path, value_view
from tests.support.closing import Opened

REPO = Path(__file__).resolve().parents[2]


def value_for(key: str) -> bytes:
    rng = random.Random(key)
    return rng.randbytes(rng.randint(100, 6000))


async def filled(opened: Opened, path: Path, count: int, **kwargs
                 ) -> tuple[DiskTier, dict[str, bytes]]:
    tier = opened.adopt(DiskTier(path, 1 << 26,
                                 segment_bytes=kwargs.pop("segment_bytes", 1 << 20), **kwargs))
    model = {f"k{i:03d}": value_for(f"k{i}") for i in range(count)}
    for key, value in model.items():
        await tier.put(key, value, durable=False)
    await tier.flush()
    return tier, model


def active_segment(tier: DiskTier):
    return next(s for s in tier.segments() if s.state == SegState.ACTIVE)


async def test_torn_tail_is_cut_and_uncommitted_records_discarded(tmp_path, opened):
    tier, model = await filled(opened, tmp_path, 20)
    active = active_segment(tier)
    await opened.close(tier)
    path = segment_path(tmp_path / "segments", active.seg_id)
    whole = value_view(b"never committed")
    header, _ = encode_header(b"ghost", whole)
    torn = value_view(os.urandom(3000))
    torn_header, _ = encode_header(b"torn", torn)
    with open(path, "ab") as segment:  # a crash after these writes, before any commit
        segment.write(header + b"ghost" + bytes(whole))
        segment.write((torn_header + b"torn" + bytes(torn))[:1500])

    tier = opened.adopt(DiskTier(tmp_path, 1 << 26))
    assert tier.recovery.uncommitted_records == 1
    assert tier.recovery.torn_bytes == 1500
    assert path.stat().st_size == active.file_bytes
    assert not await tier.contains("ghost")
    for key, value in model.items():
        assert bytes(await tier.get(key)) == value
    await tier.put("next", b"appended after recovery")
    await opened.close(tier)
    tier = opened.adopt(DiskTier(tmp_path, 1 << 26))
    assert bytes(await tier.get("next")) == b"appended after recovery"
    assert tier.recovery.torn_bytes == 0
    await opened.close(tier)


async def test_lost_bytes_never_read_as_data(tmp_path, opened):
    tier, model = await filled(opened, tmp_path, 20)
    victim = "k017"
    entry = tier.index.lookup(victim.encode())
    path = segment_path(tier.segment_dir, entry.seg_id)
    for key, value in model.items():  # map the segment before it shrinks
        assert bytes(await tier.get(key)) == value
    os.truncate(path, entry.offset + HEADER_SIZE + 10)  # the file lost its tail
    with pytest.raises(ChunkTruncated):
        await tier.get(victim)
    await opened.close(tier)

    tier = opened.adopt(DiskTier(tmp_path, 1 << 26))
    assert victim in tier.recovery.dropped_entries
    with pytest.raises(ChunkNotFound):
        await tier.get(victim)
    survivors = {k: v for k, v in model.items()
                 if tier.index.lookup(k.encode()) is not None}
    assert victim not in survivors and len(survivors) >= 17
    for key, value in survivors.items():
        assert bytes(await tier.get(key)) == value
    assert tier.used_bytes == sum(len(v) for v in survivors.values())
    await opened.close(tier)


async def test_every_flipped_bit_of_a_record_raises_chunk_corrupt(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 20))
    await tier.put("neighbour", b"left alone")
    await tier.put("target", bytes(range(48)))
    entry = tier.index.lookup(b"target")
    path = segment_path(tier.segment_dir, entry.seg_id)
    size = HEADER_SIZE + len("target") + 48
    rng = random.Random(7)
    fd = os.open(path, os.O_RDWR)
    try:
        for position in range(size):
            original = os.pread(fd, 1, entry.offset + position)
            os.pwrite(fd, bytes([original[0] ^ (1 << rng.randrange(8))]),
                      entry.offset + position)
            with pytest.raises(ChunkCorrupt):
                await tier.get("target")
            os.pwrite(fd, original, entry.offset + position)
    finally:
        os.close(fd)
    assert bytes(await tier.get("target")) == bytes(range(48))
    assert bytes(await tier.get("neighbour")) == b"left alone"
    await opened.close(tier)


async def test_stray_and_half_built_segment_files_are_removed(tmp_path, opened):
    tier, model = await filled(opened, tmp_path, 5)
    building = tier.index.register_segment(SegState.BUILDING)
    segment_path(tier.segment_dir, building).write_bytes(b"half a compaction")
    await opened.close(tier)
    stray = segment_path(tmp_path / "segments", 999)
    stray.write_bytes(b"retired but not yet unlinked")

    tier = opened.adopt(DiskTier(tmp_path, 1 << 26))
    assert tier.recovery.removed_unnamed == [999]
    assert tier.recovery.removed_building == [building]
    assert not stray.exists() and not segment_path(tier.segment_dir, building).exists()
    for key, value in model.items():
        assert bytes(await tier.get(key)) == value
    await opened.close(tier)


async def test_sweep_beside_a_live_writer_removes_only_leftovers(tmp_path, opened):
    tier, model = await filled(opened, tmp_path, 30, segment_bytes=32 << 10)
    building = tier.index.register_segment(SegState.BUILDING)
    segment_path(tier.segment_dir, building).write_bytes(b"killed compaction")
    stray = segment_path(tier.segment_dir, 999)
    stray.write_bytes(b"retirement cut short")
    assert await tier.sweep() == ([999], [building])
    assert not stray.exists() and tier.index.segment(building) is None
    assert all(segment_path(tier.segment_dir, s.seg_id).exists() for s in tier.segments())
    for key, value in model.items():
        assert bytes(await tier.get(key)) == value
    await opened.close(tier)


WRITER = """
import asyncio, random, sys
from kvstore.tiers.disk import DiskTier

def value_for(key):
    rng = random.Random(key)
    return rng.randbytes(rng.randint(100, 6000))

async def chunk_writer(tier, name):
    for i in range(10**6):
        key = f"{name}-{i}"
        await tier.put(key, value_for(key), durable=True)
        print("key", key, flush=True)

async def session_writer(tier, name):
    for i in range(10**6):
        keys = [f"{name}-{i}-c{j}" for j in range(3)]
        for key in keys:
            await tier.put(key, value_for(key), durable=False)
        await tier.commit_with_meta({f"manifest/{name}-{i}": ",".join(keys).encode()})
        print("manifest", f"manifest/{name}-{i}", flush=True)

async def main():
    tier = DiskTier(sys.argv[1], 1 << 30, segment_bytes=64 << 10)
    print("open", tier.recovery.uncommitted_records, tier.recovery.torn_bytes, flush=True)
    await asyncio.gather(*(chunk_writer(tier, f"{sys.argv[2]}w{n}") for n in range(3)),
                         session_writer(tier, f"{sys.argv[2]}s"))

asyncio.run(main())
"""


async def kill_writer_after(path: Path, round_name: str, acks: int) -> tuple[list, list]:
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(path), round_name],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    acked: dict[str, list[str]] = {"key": [], "manifest": [], "open": []}
    try:
        for line in child.stdout:  # after the kill: what was printed before it, then EOF
            kind, _, rest = line.partition(" ")
            # Only a whole line is an acknowledgement: the kill may cut the last one short.
            if not line.endswith("\n") or kind not in acked or not rest.strip():
                continue
            acked[kind].append(rest.split()[0])
            if len(acked["key"]) + len(acked["manifest"]) == acks:
                child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    return acked["key"], acked["manifest"]


async def check_acknowledged(path: Path, keys: list[str], manifests: list[str]) -> None:
    tier = DiskTier(path, 1 << 30, segment_bytes=64 << 10)
    try:
        for key in keys:
            assert bytes(await tier.get(key)) == value_for(key), key
        for name in manifests:
            listed = (await tier.meta.get(name)).decode().split(",")
            for key in listed:
                assert bytes(await tier.get(key)) == value_for(key), (name, key)
        live = [k async for k in tier.keys()]  # noqa: SIM118 - async iterator
        assert tier.used_bytes == sum(len(value_for(k)) for k in live)
    finally:
        await tier.close()


@pytest.mark.parametrize("rounds", [2, pytest.param(10, marks=pytest.mark.slow)])
async def test_sigkilled_durable_writer_loses_no_acknowledged_write(tmp_path, rounds):
    rng = random.Random(rounds)
    all_keys, all_manifests = [], []
    for round_no in range(rounds):
        keys, manifests = await kill_writer_after(tmp_path, f"r{round_no}",
                                                  rng.randint(40, 200))
        assert keys, "the writer acknowledged nothing before it was killed"
        all_keys += keys
        all_manifests += manifests
        await check_acknowledged(tmp_path, all_keys, all_manifests)


FULL_DISK = """
import asyncio, json, resource, signal, sys
from kvstore.format.errors import TierFull
from kvstore.tiers.disk import DiskTier

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # oversize writes fail with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

async def main():
    tier = DiskTier(sys.argv[1], 1 << 30, segment_bytes=1 << 20)
    acked, errors = [], []
    for i in range(40):
        try:
            await tier.put(f"k{i}", bytes([i]) * 25_000)
            acked.append(f"k{i}")
        except TierFull as exc:
            errors.append(str(exc))
    still = [bytes(await tier.get(k)) == bytes([int(k[1:])]) * 25_000 for k in acked]
    print(json.dumps({"acked": acked, "errors": errors, "used": tier.used_bytes,
                      "reads_ok": all(still)}))
    await tier.close()

asyncio.run(main())
"""


async def test_full_file_system_becomes_tier_full_and_keeps_the_index(tmp_path, opened):
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert 5 <= len(report["acked"]) < 40 and report["reads_ok"]
    assert report["errors"] and "no space left" in report["errors"][0]
    assert report["used"] == 25_000 * len(report["acked"])

    tier = opened.adopt(DiskTier(tmp_path, 1 << 30, segment_bytes=1 << 20))
    assert tier.recovery.torn_bytes == 0 and tier.recovery.uncommitted_records == 0
    assert sorted([k async for k in tier.keys()]) == sorted(report["acked"])  # noqa: SIM118
    for key in report["acked"]:
        assert bytes(await tier.get(key)) == bytes([int(key[1:])]) * 25_000
    assert tier.used_bytes == report["used"]
    await opened.close(tier)


COMPACTOR = """
import asyncio, json, sys
from kvstore.format.errors import TierUnavailable
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk.index import SegState

async def main():
    tier = DiskTier(sys.argv[1], 0, writer=False, segment_bytes=16 << 10)
    refused = False
    try:
        await tier.put("x", b"y")
    except TierUnavailable:
        refused = True
    sealed = [s.seg_id for s in tier.segments() if s.state == SegState.SEALED]
    result = await tier.rewrite_segments(sealed)
    await tier.meta.commit({"compacted": json.dumps(sealed).encode()})
    print(json.dumps({"live_writer": DiskTier.writer_is_live(sys.argv[1]),
                      "refused": refused, "sealed": sealed, "retired": result.retired,
                      "moved": result.moved}))
    await tier.close()

asyncio.run(main())
"""


def sealed_dead_bytes(tier: DiskTier) -> int:
    return sum(s.dead_bytes for s in tier.segments() if s.state == SegState.SEALED)


async def test_compaction_in_another_process_beside_a_live_writer(tmp_path, opened):
    tier, model = await filled(opened, tmp_path, 60, segment_bytes=16 << 10)
    for key in list(model)[::3]:
        await tier.delete(key)
        del model[key]
    used, dead = tier.used_bytes, sealed_dead_bytes(tier)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", COMPACTOR, str(tmp_path), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    waiting = asyncio.create_task(child.communicate())
    reads = 0
    while not waiting.done() or reads == 0:  # restores during the compaction never fail
        for key, value in model.items():
            assert bytes(await tier.get(key)) == value
            reads += 1
        await tier.put("during", b"written while compacting")
    out, err = await waiting
    assert child.returncode == 0, err.decode()
    report = json.loads(out)
    assert report["live_writer"] and report["refused"]
    assert report["retired"] == report["sealed"] and report["moved"] > 0
    for key, value in model.items():
        assert bytes(await tier.get(key)) == value
    # the writer let go of what the compactor retired (other tests' files are not its own)
    assert not open_deleted_segments(tier.segment_dir)
    assert json.loads(await tier.meta.get("compacted")) == report["sealed"]
    assert tier.used_bytes == used + len(b"written while compacting")
    assert sealed_dead_bytes(tier) < dead
    assert not any(segment_path(tier.segment_dir, s).exists() for s in report["sealed"])
    await opened.close(tier)


def open_deleted_segments(segment_dir: Path) -> list[str]:
    """Segment files of ``segment_dir`` this process still holds open or mapped after they
    were removed."""
    held = Path("/proc/self/maps").read_text().splitlines()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [h for h in held if str(segment_dir) in h and ".seg" in h and "(deleted)" in h]
