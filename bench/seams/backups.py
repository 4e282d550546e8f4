"""The ``backup`` maintenance event: ``kvtier backup``, sometimes damaged, then
``kvtier restore-backup``, judged against the model.

A single node's directory is backed up stopped (SIGTERM: every ack drained, so the
backup holds exactly the model) or live (then it holds what a kill -9 would have left:
the last durable version of each session, or a later one). Its damage, one of:
``removed`` (a segment gone from the folder and from ``backup.json``), ``symlink`` (a
listed segment replaced by a symlink to an identical copy), ``flipped`` (one byte of a
segment). Restored into a new directory on the combination's tmpfs, the server then
serves that directory (the old one removed) and every session is checked; so an exit 0
of a damaged backup is right only if nothing the model holds was lost (its census, the
sessions restored, the model's), which the verification after it decides. An intact
backup must restore (exit 0), its census the model's. A damaged one that
restore-backup refuses must exit 1 (DATA_LOSS).

A fleet node's bucket (``shared``) is backed up with ``--bucket`` once the node
stopped, and restored into a bucket of its own: exit 0 and the model's census when
intact, exit 1 when a chunk object was removed or flipped (a symlink to the same bytes
may restore, with the model's census); the new bucket is not served (its node's disk
and Redis tiers would be another fleet's).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

from bench.seams import lives, prefix
from bench.seams.verdict import now
from bench.seams.world import run_cli

DAMAGE = (None, None, "removed", "symlink", "flipped")
FLEET_PREFIX = "kvtier/"  # the servers' s3_prefix (its default): the fleet's objects


async def event(sim) -> None:
    damage = sim.rng.choice(DAMAGE)
    if sim.combo.shared:
        await bucket(sim, damage)
    else:
        await directory(sim, damage, live=sim.rng.random() < 0.5)


async def directory(sim, damage: str | None, *, live: bool) -> None:
    backup = sim.root / f"backup-{sim.step}"
    try:
        await _directory(sim, backup, damage, live)
    finally:
        _remove(backup)


async def _directory(sim, backup: Path, damage: str | None, live: bool) -> None:
    if not live:
        await lives.stop(sim, "term")
    ok = await _back_up(sim, ["--data-dir", str(sim.data_dir)], backup)
    if live:
        await lives.stop(sim, "term")
        # what the backup holds is what a kill -9 at its time would have left
        for held in sim.model.values():
            held.uncertain = True
        prefix.after_stop(sim, "kill")
    if not ok:
        await lives.start(sim, "backup-failed")
        return
    what = _damage(sim, backup, damage)
    target = sim.tmpfs.path / f"restored-{sim.step}"
    rc, report = await _restore(sim, [str(backup), str(target)], what)
    if rc != 0:
        shutil.rmtree(target, ignore_errors=True)
        await lives.start(sim, "backup-refused")
        return
    # the restored directory is the node's from now on, as an operator's would be
    old = sim.data_dir
    sim.data_dir = target
    sim.config_path = sim.config()
    shutil.rmtree(old, ignore_errors=True)
    prefix.forget_all(sim, "restore-backup")
    await lives.start(sim, "restore-backup")
    sim.log(f"step={sim.step} serving the restored backup {target.name} (damage: {what})")
    if report is not None:
        _census(sim, report, exact=not live)


async def bucket(sim, damage: str | None) -> None:
    backup = sim.root / f"backup-{sim.step}"
    await lives.stop(sim, "term")
    try:
        source = f"s3://{sim.bucket}/{FLEET_PREFIX}"
        if not await _back_up(sim, ["--bucket", source, "--s3-endpoint", sim.moto.endpoint],
                              backup):
            return
        what = _damage(sim, backup, damage)
        restored = f"{sim.bucket}-r{sim.step}"[:63]
        await asyncio.to_thread(sim.moto.bucket, restored)
        rc, report = await _restore(sim, [str(backup), "--bucket",
                                          f"s3://{restored}/{FLEET_PREFIX}",
                                          "--s3-endpoint", sim.moto.endpoint], what)
        if rc == 0 and report is not None and (not what or what.startswith("symlink")):
            _census(sim, report, exact=True)  # a symlink to the same bytes loses nothing
        elif rc == 0 and what:
            sim.ledger.add("lost", sim.combo.name, sim.step, "restore-backup", "-",
                           f"exit 1 DATA_LOSS (a bucket backup {what})",
                           f"exit 0: {json.dumps(report)[:200]}")
    finally:
        _remove(backup)
        await lives.start(sim, "backup")


async def _back_up(sim, source: list[str], backup: Path) -> bool:
    rc, report, said = await asyncio.to_thread(
        run_cli, ["backup", *source, str(backup), "--json"], {})
    sim.log(f"step={sim.step} tool=backup rc={rc} report={report} said={said[:200]}")
    if rc != 0:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "backup", "-", "exit 0",
                       f"exit {rc}: {said}")
    return rc == 0


async def _restore(sim, args: list[str], damage: str) -> tuple[int, dict | None]:
    """restore-backup with the server's config (its keyring); exit 0 for an intact
    backup, 1 (or 0, judged by serving it) for a damaged one."""
    rc, report, said = await asyncio.to_thread(
        run_cli, ["restore-backup", *args, "--config", str(sim.config_path), "--json"], {})
    sim.log(f"step={sim.step} tool=restore-backup damage={damage or '-'} rc={rc} "
            f"report={json.dumps(report)[:300] if report else None} said={said[:200]}")
    if not damage and rc != 0:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "restore-backup", "-",
                       "exit 0 (an intact backup)", f"exit {rc}: {said}")
    elif damage and rc not in (0, 1):
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "restore-backup", "-",
                       f"exit 1 DATA_LOSS (a backup {damage})", f"exit {rc}: {said}")
    elif damage and rc == 1 and "DATA_LOSS" not in said and not _lost_listed(report):
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "restore-backup", "-",
                       f"DATA_LOSS said (a backup {damage})", said)
    return rc, report


def _lost_listed(report: dict | None) -> bool:
    """restore-backup's ``--json`` report of a DATA_LOSS, naming what is lost: the stderr
    tail judged beside it may hold only the listed items, its DATA_LOSS line cut."""
    return bool(report) and report.get("restored") is False and bool(
        report.get("missing") or report.get("corrupt"))


def _census(sim, report: dict, *, exact: bool) -> None:
    """The sessions restore-backup restored against the model's: every one it holds
    for sure, at most every one it holds (``exact``: the backup was taken stopped)."""
    at = now()
    sure = sum(1 for h in sim.model.values() if not h.may_be_absent(at))
    most = len(sim.model) + len(sim.vanished)
    got = report.get("sessions")
    if not isinstance(got, int) or got < sure or (exact and got > most):
        sim.ledger.add("lost", sim.combo.name, sim.step, "restore-backup-census", "-",
                       f"{sure}..{most} sessions restored", f"{got}")


def _damage(sim, backup: Path, damage: str | None) -> str:
    """Damage ``backup`` as ``damage`` says, on one of its segments (a chunk object of a
    bucket backup); what was done ("" when nothing: no segment to damage)."""
    if damage is None:
        return ""
    manifest_path = backup / "backup.json"
    manifest = json.loads(manifest_path.read_text())
    files = manifest["files"]
    victims = [e for e in files if _is_segment(e["path"]) and e["bytes"] > 0]
    if not victims:
        sim.log(f"step={sim.step} backup: no segment to damage ({damage})")
        return ""
    # the largest: it holds live records (a segment of only dead ones loses nothing)
    victim = max(victims, key=lambda e: (e["bytes"], e["path"]))
    path = backup / victim["path"]
    if damage == "removed":
        path.unlink()
        manifest["files"] = [e for e in files if e is not victim]
        manifest_path.write_text(json.dumps(manifest, indent=1))
    elif damage == "symlink":
        outside = _outside(backup)
        outside.mkdir(exist_ok=True)
        copy = outside / path.name
        shutil.copyfile(path, copy)
        path.unlink()
        path.symlink_to(copy)
    else:
        data = bytearray(path.read_bytes())
        at = sim.rng.randrange(len(data))
        data[at] ^= 1 << sim.rng.randrange(8)
        path.write_bytes(bytes(data))
    what = f"{damage} {victim['path']}"
    sim.log(f"step={sim.step} backup damaged: {what}")
    return what


def _outside(backup: Path) -> Path:
    """Where a symlink's target lives: beside the backup, not in it."""
    return backup.with_name(backup.name + "-outside")


def _remove(backup: Path) -> None:
    shutil.rmtree(backup, ignore_errors=True)
    shutil.rmtree(_outside(backup), ignore_errors=True)


def _is_segment(path: str) -> bool:
    """A disk segment (not the LMDB index) or, in a bucket backup, a chunk object."""
    name = path.rsplit("/", 1)[-1]
    if path.startswith("disk/"):
        return not name.endswith(".mdb") and name != "layouts.json"
    return "manifest" not in path and name not in ("backup.json", "layouts.json") \
        and not path.startswith("objects/")
