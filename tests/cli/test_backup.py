"""``kvtier backup`` and ``kvtier restore-backup`` on real data directories.

A backup of a live server taken while spills continue restores, elsewhere, every session
acknowledged durable before it started, bit-exact; damage to a backup (its files, or a
chunk it faithfully copied) is caught on restore and leaves no data directory; an
encrypted directory round-trips with the server's key and is refused without it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk.lock import COMPACT_LOCK, DirLock
from kvtier import AsyncClient
from services.cli.backup import MANIFEST, digest
from tests.support.compaction import (
    SPECS,
    TENANT,
    Spec,
    embedded_server,
    fill,
    fill_idle_and_hot,
    flip_value_byte,
    restore_all,
    run_compact,
    snapshot,
    spill_all,
)

ROOT = Path(__file__).resolve().parents[2]
KEY = base64.b64encode(bytes(range(3, 35))).decode()


def kvtier(*args: str, key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(ROOT)
    if key is not None:
        env["KVTIER_ENCRYPTION_KEY"] = key
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def report(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def backup(data: Path, out: Path) -> dict:
    return report(kvtier("backup", "--data-dir", str(data), str(out), "--json"))


def test_live_backup_while_spilling_restores_every_durable_session(tmp_path):
    data, out, restored = tmp_path / "data", tmp_path / "backup", tmp_path / "restored"

    async def scenario():
        async with embedded_server(data) as target, AsyncClient(target) as kv:
            await spill_all(kv)  # acked durable before the backup starts
            before = {spec.session_id: await snapshot(kv, spec.session_id) for spec in SPECS}
            spilled, stop = [], asyncio.Event()

            async def keep_spilling():  # new sessions, each of its own chunks
                while not stop.is_set():
                    extra = tuple(Spec(f"live{i}", 2) for i in range(len(spilled) + 1))
                    await spill_all(kv, SPECS + extra, only={extra[-1].session_id})
                    spilled.append(extra[-1].session_id)

            spiller = asyncio.create_task(keep_spilling())
            await asyncio.sleep(0)
            at_start = len(spilled)
            done = await asyncio.to_thread(backup, data, out)
            spilled_during = len(spilled) - at_start
            stop.set()
            await spiller
            return before, done, spilled_during

    before, done, spilled_during = asyncio.run(scenario())
    assert spilled_during > 0, "no spill completed while the backup ran: not live"
    assert done["sessions"] >= len(SPECS) and done["chunks"] > 0
    assert (out / MANIFEST).is_file()
    restore = report(kvtier("restore-backup", str(out), str(restored), "--json"))
    assert restore["restored"] and restore["corrupt"] == [] and restore["missing"] == []
    assert restore["sessions"] == done["sessions"]
    assert restore["chunks_verified"] == done["chunks"]
    assert asyncio.run(restore_all(restored, [s.session_id for s in SPECS])) == before


def test_sessions_demoted_to_the_object_folder_round_trip(tmp_path):
    data, out, target = tmp_path / "data", tmp_path / "backup", tmp_path / "restored"
    snaps, hot_since = asyncio.run(fill_idle_and_hot(data, delete=(), hot=("a", "b", "g")))
    demoted = run_compact(data, "--json", "--demote-after", "1h",
                          "--as-of", repr(hot_since + 3600))
    assert demoted.returncode == 0, demoted.stderr[-3000:]
    assert json.loads(demoted.stdout.strip().splitlines()[-1])["sessions_demoted"] > 0
    assert list((data / "objects").rglob("*.zst"))  # some chunks live in objects/ alone
    done = backup(data, out)
    assert (out / "objects").is_dir()
    restore = report(kvtier("restore-backup", str(out), str(target), "--json"))
    assert restore["restored"] and restore["corrupt"] == [] and restore["missing"] == []
    assert restore["chunks_verified"] == done["chunks"]
    assert asyncio.run(restore_all(target, list(snaps))) == snaps


def _chunk_of(data: Path) -> str:
    async def first():
        disk = DiskTier(data / "disk", 1 << 30, writer=False)
        try:
            return disk.index.entries_after(None, 1)[0][0].decode()
        finally:
            await disk.close()
    return asyncio.run(first())


def test_a_flipped_byte_in_a_backup_is_caught_and_nothing_is_restored(tmp_path):
    data, out, target = tmp_path / "data", tmp_path / "backup", tmp_path / "restored"
    asyncio.run(fill(data))
    backup(data, out)
    flip_value_byte(out, _chunk_of(out))
    done = kvtier("restore-backup", str(out), str(target))
    assert done.returncode == 1 and "DATA_LOSS" in done.stderr
    assert "BLAKE2b" in done.stderr
    assert not target.exists() and not list(tmp_path.glob(".restored.*"))


def test_a_corrupt_chunk_the_backup_copied_is_caught_by_the_chunk_scrub(tmp_path):
    data, out, target = tmp_path / "data", tmp_path / "backup", tmp_path / "restored"
    asyncio.run(fill(data))
    backup(data, out)
    key = _chunk_of(out)
    flip_value_byte(out, key)  # as if the source had it damaged: the digests agree
    manifest = json.loads((out / MANIFEST).read_text())
    for entry in manifest["files"]:
        entry["blake2b"] = digest(out / entry["path"])
    (out / MANIFEST).write_text(json.dumps(manifest))
    done = kvtier("restore-backup", str(out), str(target), "--json")
    assert done.returncode == 1 and "DATA_LOSS" in done.stderr.splitlines()[-1]  # the verdict
    lost = json.loads(done.stdout.strip().splitlines()[-1])
    assert not lost["restored"] and any(key in line for line in lost["corrupt"])
    assert not target.exists() and not list(tmp_path.glob(".restored.*"))


def test_an_encrypted_directory_round_trips_only_with_its_key(tmp_path):
    data, out, target = tmp_path / "data", tmp_path / "backup", tmp_path / "restored"

    async def fill_sealed():
        async with embedded_server(data, KEY) as address, AsyncClient(address) as kv:
            await spill_all(kv)
            return {spec.session_id: await snapshot(kv, spec.session_id) for spec in SPECS}

    async def read_back():
        async with embedded_server(target, KEY) as address, AsyncClient(address) as kv:
            return {spec.session_id: await snapshot(kv, spec.session_id) for spec in SPECS}

    before = asyncio.run(fill_sealed())
    done = backup(data, out)  # ciphertext as stored: no key needed
    assert done["sessions"] == len(SPECS)
    missing = kvtier("restore-backup", str(out), str(target))
    assert missing.returncode == 2 and "no key was given" in missing.stderr
    assert not target.exists()
    wrong = kvtier("restore-backup", str(out), str(target),
                   key=base64.b64encode(bytes(32)).decode())
    assert wrong.returncode == 2 and not target.exists()
    restore = report(kvtier("restore-backup", str(out), str(target), "--json", key=KEY))
    assert restore["sessions"] == len(SPECS) and restore["corrupt"] == []
    assert asyncio.run(read_back()) == before


def test_refusals_change_nothing(tmp_path):
    data, out = tmp_path / "data", tmp_path / "backup"
    asyncio.run(fill(data, delete=()))
    inside = kvtier("backup", "--data-dir", str(data), str(data / "b"))
    assert inside.returncode == 2 and "contain" in inside.stderr and not (data / "b").exists()
    nothing = kvtier("backup", "--data-dir", str(tmp_path / "none"), str(out))
    assert nothing.returncode == 2 and not out.exists()
    backup(data, out)
    again = kvtier("backup", "--data-dir", str(data), str(out))
    assert again.returncode == 2 and "not an empty directory" in again.stderr

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    full = kvtier("restore-backup", str(out), str(busy))
    assert full.returncode == 2 and "not empty" in full.stderr
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    within = kvtier("restore-backup", str(out), str(out / "sub"))
    assert within.returncode == 2 and not (out / "sub").exists()
    not_one = kvtier("restore-backup", str(data), str(tmp_path / "x"))
    assert not_one.returncode == 2 and "not a kvtier backup" in not_one.stderr

    forced = report(kvtier("restore-backup", str(out), str(busy), "--force", "--json"))
    assert forced["sessions"] == len(SPECS)
    aside = list(tmp_path.glob("busy.replaced-*"))
    assert len(aside) == 1 and (aside[0] / "keep.txt").read_text() == "mine"
    assert asyncio.run(restore_all(busy, ["a"]))["a"].chunks


def test_a_running_compaction_is_waited_for_then_refused(tmp_path):
    data, out = tmp_path / "data", tmp_path / "backup"
    asyncio.run(fill(data, delete=()))
    lock = DirLock(data / "disk" / COMPACT_LOCK, "the compaction lock")
    with lock.holding():  # as a kvtier compact holds it
        refused = kvtier("backup", "--data-dir", str(data), str(out), "--wait", "0.3")
    assert refused.returncode == 3 and "compaction" in refused.stderr
    assert not out.exists()
    assert backup(data, out)["sessions"] == len(SPECS)  # once it is free


def test_force_refuses_a_target_a_server_holds(tmp_path):
    data, out, live = tmp_path / "data", tmp_path / "backup", tmp_path / "live"
    asyncio.run(fill(data, delete=()))
    backup(data, out)

    async def attempt():
        async with embedded_server(live):
            return await asyncio.to_thread(
                kvtier, "restore-backup", str(out), str(live), "--force")

    done = asyncio.run(attempt())
    assert done.returncode == 2 and "server is running" in done.stderr
    assert not list(tmp_path.glob("live.replaced-*"))


def _drop_from_listing(out: Path, path: str) -> dict:
    """Remove ``path`` from the backup's folder and from its file list, as if lost with
    its listing; the manifest left."""
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"] = [entry for entry in manifest["files"] if entry["path"] != path]
    (out / MANIFEST).write_text(json.dumps(manifest))
    (out / path).unlink()
    return manifest


def test_a_segment_lost_with_its_listing_is_data_loss_naming_it(tmp_path):
    data, out, target = tmp_path / "data", tmp_path / "backup", tmp_path / "restored"
    asyncio.run(fill(data, delete=()))
    made = backup(data, out)
    census = json.loads((out / MANIFEST).read_text())["census"]
    assert len(census["sessions"]) == made["sessions"] == len(SPECS)
    assert {line["generation"] for line in census["sessions"]} == {1}
    segment = census["segments"][0]
    _drop_from_listing(out, segment)
    done = kvtier("restore-backup", str(out), str(target), "--json")
    assert done.returncode == 1 and "DATA_LOSS" in done.stderr, done.stderr[-2000:]
    lost = json.loads(done.stdout.strip().splitlines()[-1])
    assert not lost["restored"]
    assert any(segment in line for line in lost["missing"])
    assert any(line.startswith(f"{TENANT}/") and "not restored" in line
               for line in lost["missing"])
    assert not target.exists() and not list(tmp_path.glob(".restored.*"))


def test_a_linked_segment_is_refused_even_with_its_digest(tmp_path):
    data, out, target = tmp_path / "data", tmp_path / "backup", tmp_path / "restored"
    asyncio.run(fill(data, delete=()))
    backup(data, out)
    segment = out / json.loads((out / MANIFEST).read_text())["census"]["segments"][0]
    elsewhere = tmp_path / "elsewhere.seg"
    segment.rename(elsewhere)
    segment.symlink_to(elsewhere)  # same bytes, same digest: only the link differs
    done = kvtier("restore-backup", str(out), str(target))
    assert done.returncode == 1 and "DATA_LOSS" in done.stderr, done.stderr[-2000:]
    assert "symbolic link" in done.stderr
    assert not target.exists()
    segment.unlink()
    elsewhere.rename(segment)  # put back: the intact backup restores
    assert report(kvtier("restore-backup", str(out), str(target), "--json"))["restored"]


def test_a_version_1_backup_without_a_census_restores_with_a_warning(tmp_path):
    data, out, target = tmp_path / "data", tmp_path / "backup", tmp_path / "restored"
    asyncio.run(fill(data, delete=()))
    backup(data, out)
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["census"]
    (out / MANIFEST).write_text(json.dumps(manifest | {"version": 1}))
    done = kvtier("restore-backup", str(out), str(target), "--json")
    assert report(done)["restored"] and "without a census" in done.stderr
    (out / MANIFEST).write_text(json.dumps(manifest))  # version 2 needs one
    refused = kvtier("restore-backup", str(out), str(tmp_path / "again"))
    assert refused.returncode == 2 and "census" in refused.stderr
