"""``kvtier compact`` on data directories filled by the real server through the real client:
dead space, expiry, shared prefixes, demotion, dry runs, scrub and quarantine, and the
refusal of a second compaction. The command runs in-process (``services.cli.main.main``);
restores go through a real server afterwards."""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import zstandard

from kvstore.compaction.job import run_compaction
from kvstore.compaction.report import COMPACT_PRESETS, CompactOptions, LogProgress
from kvstore.format.errors import InvalidRequest, SessionNotFound
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk.index import SegmentInfo, SegState
from kvstore.tiers.disk.reclaim import groups
from services import cli
from services.cli.compact import parse_duration
from tests.support.compaction import (
    HOUR,
    SPECS,
    TENANT,
    Spec,
    fill,
    fill_idle_and_hot,
    flip_value_byte,
    restore_all,
)

# t's own TTL (an hour) cannot run out during the test; compactions judge it as of later.
WITH_TTL = (*SPECS, Spec("t", 3, prefix_of="a", ttl_s=HOUR))


def compact(data: Path, capsys, *args: str) -> tuple[int, dict | None, str]:
    rc = cli.main(["compact", "--data-dir", str(data), *args])
    out, err = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1]) if rc == 0 and "--json" in args else None
    return rc, report, err


def digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


async def read_meta(data: Path, key: str) -> bytes | None:
    disk = DiskTier(data / "disk", 1 << 30, writer=False)
    try:
        return await disk.meta.get(key)
    finally:
        await disk.close()


def test_end_to_end_expire_demote_reclaim(tmp_path, capsys):
    data = tmp_path / "data"
    snaps, hot_since = asyncio.run(fill_idle_and_hot(data, specs=WITH_TTL, delete=("d", "f"),
                                                     hot=("a", "b", "g")))
    assert "t" in snaps  # live until a compaction judges it an hour on
    # An hour after the hot sessions' last spill: the others (and t's TTL) are past an hour.
    later = ("--demote-after", "1h", "--as-of", repr(hot_since + HOUR))

    rc, now, _ = compact(data, capsys, "--dry-run", "--json", "--demote-after", "1h")
    assert rc == 0 and now["expired"] == [] and now["demoted"] == []  # nothing is idle yet
    before = digest(data)
    rc, dry, _ = compact(data, capsys, "--dry-run", "--json", *later)
    assert rc == 0 and digest(data) == before  # a dry run changes nothing
    assert dry["mode"] == "dry-run" and dry["expired"] == ["acme/t"]
    assert sorted(dry["demoted"]) == ["acme/c", "acme/e"]
    assert dry["dead_bytes_before"] > 0 and dry["reclaimed_bytes"] > 0

    rc, report, _ = compact(data, capsys, "--json", *later, "--zstd-level", "9")
    assert rc == 0 and report["mode"] == "offline"
    assert report["sessions_expired"] == 1 and report["expired"] == ["acme/t"]
    # t's own chunk stays as cache, retained as the server would (retain_unreferenced)
    assert report["chunks_collected"] == 0
    assert report["sessions_demoted"] == 2 and sorted(report["demoted"]) == ["acme/c", "acme/e"]
    assert report["segments_rewritten"] >= 1 and report["reclaimed_bytes"] > 0
    assert report["dead_bytes_before"] == dry["dead_bytes_before"]
    assert report["rewritten_bytes"] > 0
    assert report["raw_write_gbps"] > 0 and report["rewrite_gbps"] > 0
    assert report["corrupt_chunks"] == 0 and report["live_bytes"] > 0

    # Where the demoted sessions went is recorded, and their chunks are zstd objects.
    record = json.loads(asyncio.run(read_meta(data, "demoted/acme/e")))
    assert record["tier"] == "object" and record["zstd_level"] == 9
    e_only = snaps["e"].chunk_keys
    stored = {p.name for p in (data / "objects").rglob("*.zst")}
    assert {f"{key}.zst" for key in e_only} <= stored
    for path in (data / "objects").rglob("*.zst"):
        zstandard.ZstdDecompressor().decompress(path.read_bytes())

    after = asyncio.run(restore_all(data, list(snaps.keys() - {"t"})))
    assert after == {name: snap for name, snap in snaps.items() if name != "t"}
    with pytest.raises(SessionNotFound):
        asyncio.run(restore_all(data, ["t"]))

    rc, again, _ = compact(data, capsys, "--json", "--demote-after", "1h")
    assert rc == 0 and again["sessions_expired"] == 0 and again["sessions_demoted"] == 0
    assert again["chunks_collected"] == 0


def test_scrub_quarantines_corrupt_chunks_and_marks_sessions(tmp_path, capsys):
    data = tmp_path / "data"
    snaps = asyncio.run(fill(data, delete=()))
    shared, own = snaps["a"].chunk_keys[0], snaps["e"].chunk_keys[1]
    for key in (shared, own):
        flip_value_byte(data, key)

    rc, dry, _ = compact(data, capsys, "--dry-run", "--json")
    assert rc == 0 and dry["corrupt_chunks"] == 2
    assert not (data / "quarantine").exists()

    rc, report, _ = compact(data, capsys, "--json")
    assert rc == 0 and report["corrupt_chunks"] == 2
    assert sorted(report["corrupt_keys"]) == sorted(f"disk:{k}" for k in (shared, own))
    # The shared prefix chunk marks every session that names it.
    assert sorted(report["marked_sessions"]) == ["acme/a", "acme/b", "acme/c", "acme/e"]
    for key in (shared, own):
        kept = data / "quarantine" / f"disk-{key}.bin"
        assert kept.stat().st_size > 0
        assert json.loads((data / "quarantine" / f"disk-{key}.json").read_text())["key"] == key
    mark = json.loads(asyncio.run(read_meta(data, f"quarantine/{TENANT}/e")))
    assert mark["chunks"] == [own]

    rc, again, _ = compact(data, capsys, "--json")
    assert rc == 0 and again["corrupt_chunks"] == 0
    # Sessions that do not name a corrupt chunk still restore byte-identical.
    assert asyncio.run(restore_all(data, ["d", "f", "g"])) == {
        n: snaps[n] for n in ("d", "f", "g")}


class _BlockingProgress:
    """Signals through a pipe when the rewrite starts, then holds it there."""

    def __init__(self, signal_to: Connection) -> None:
        self.signal_to = signal_to

    def step(self, name: str, total: int):
        if name == "rewrite segments":
            self.signal_to.send_bytes(b"x")
            time.sleep(120)
        return LogProgress().step(name, total)


def _compaction_child(data: Path, signal_to: Connection) -> None:
    async def main() -> None:
        disk = DiskTier(data / "disk", 1 << 30, writer=False)
        disk.compact_lock.acquire()
        await run_compaction(disk, CompactOptions(), _BlockingProgress(signal_to),
                             mode="offline", ops=None, quarantine_dir=data / "quarantine")

    asyncio.run(main())


def test_second_compaction_refuses_while_one_runs(tmp_path, capsys):
    data = tmp_path / "data"
    asyncio.run(fill(data))
    # The first compaction runs in a spawned process: forking this one, which has run gRPC
    # servers, can crash the child.
    spawn = multiprocessing.get_context("spawn")
    reader, writer = spawn.Pipe(duplex=False)
    first = spawn.Process(target=_compaction_child, args=(data, writer))
    first.start()
    writer.close()
    try:
        assert reader.poll(120) and reader.recv_bytes() == b"x"  # it holds the lock, rewriting
        rc, _, err = compact(data, capsys, "--json")
        assert rc == 3
        assert "refused" in err and "compaction lock" in err and f"pid {first.pid}" in err
    finally:
        first.kill()
        first.join()
        reader.close()
    rc, report, _ = compact(data, capsys, "--json")  # the lock died with its holder
    assert rc == 0 and report["reclaimed_bytes"] > 0


def test_bad_arguments_are_refused_clearly(tmp_path, capsys):
    rc, _, err = compact(tmp_path / "nothing", capsys, "--json")
    assert rc == 2 and "holds no disk tier" in err
    data = tmp_path / "data"
    asyncio.run(fill(data, specs=SPECS[:1], delete=()))
    rc, _, err = compact(data, capsys, "--zstd-level", "40")
    assert rc == 2 and "zstd_level" in err
    with pytest.raises(SystemExit):
        cli.main(["compact", "--data-dir", str(data), "--ttl", "soon"])
    assert "not a duration" in capsys.readouterr().err


def test_durations_options_and_groups():
    assert parse_duration("90") == 90 and parse_duration("15m") == 900
    assert parse_duration("2h") == 7200 and parse_duration("1.5d") == 129600
    with pytest.raises(InvalidRequest):
        CompactOptions(dead_fraction=1.5)
    assert COMPACT_PRESETS["thorough"].dead_fraction == 0.0
    infos = [SegmentInfo(i, SegState.SEALED, 100, live) for i, live in
             [(3, 60), (1, 50), (2, 10), (4, 0), (5, 90)]]
    assert groups(infos, 64) == [[1, 2], [3, 4], [5]]


def test_a_full_object_tier_fails_demotions_without_losing_sessions(tmp_path, capsys):
    data = tmp_path / "data"
    snaps = asyncio.run(fill(data, specs=SPECS[:2], delete=()))
    config = tmp_path / "kvtier.toml"
    config.write_text('object_bytes = "1KiB"\n')  # no chunk fits
    rc, report, _ = compact(data, capsys, "--json", "--config", str(config),
                            "--demote-after", "0s")
    assert rc == 0 and report["sessions_demoted"] == 0
    assert sorted(why.split(" failed")[0] for why in report["skipped"]) == [
        "demotion of acme/a", "demotion of acme/b"]
    assert all("TierFull" in why for why in report["skipped"])
    assert asyncio.run(restore_all(data, snaps)) == snaps
