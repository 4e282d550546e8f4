"""``kvtier restore-backup``: restore a ``kvtier backup`` into a data directory, verified.

    kvtier restore-backup BACKUP DATA_DIR [--config C] [--force] [--json]
    kvtier restore-backup BACKUP --bucket s3://BUCKET/PREFIX [--s3-endpoint URL] ...

First every file of the backup is checked against ``backup.json`` (size and BLAKE2b;
a symbolic link or anything else but a regular file or directory in the backup is
DATA_LOSS); then the files are copied into a staging directory beside ``DATA_DIR``, which
is opened as the server opens its data directory (the disk tier with recovery) and verified: every
chunk (``kvstore.compaction.scrub``: segment record and chunk encoding, opened with the
keyring first when encrypted) and every chunk each manifest names. Only a restore that
verifies clean is renamed into place; otherwise the staging directory is removed and
nothing is left that could pass for a good data directory.

A node whose object tier is S3 keeps its demoted chunks there, not in the data directory:
give its ``--config``, and the chunks its manifests name are looked up there too.

``DATA_DIR`` must be missing or empty; with ``--force`` an existing one is moved aside to
``DATA_DIR.replaced-<time>`` (never deleted), unless a server holds it. An encrypted
backup needs the server's key (``--config``'s ``encryption_key_file`` or
``KVTIER_ENCRYPTION_KEY``); without it, or with a key that does not open the values,
restore-backup refuses.

A bucket backup (``kvtier backup --bucket``) is restored to ``--bucket``'s prefix
instead (``services.cli.backup_bucket``: chunks uploaded and verified there, the
manifests only after).

Exit status: 0 restored, 1 data loss (the backup is damaged, a chunk a manifest names
is missing or corrupt, a link in the backup, or a session, chunk or segment of the
census is not restored),
2 refused (bad target, missing or wrong key, not a backup).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from botocore.exceptions import BotoCoreError, ClientError

from kvstore.format.errors import Busy, DataLoss, InvalidRequest, KVTierError
from services.cli import backup_census
from services.cli.backup import FORMAT, MANIFEST, add_s3_arguments, digest, nested, remove_tree
from services.cli.backup_report import Lost, Verified

if TYPE_CHECKING:
    from kvstore.tiers.object import ObjectTier

_SHOWN = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("backup", type=Path, help="a directory kvtier backup wrote")
    parser.add_argument("data_dir", type=Path, nargs="?",
                        help="the data directory to restore into")
    parser.add_argument("--bucket", metavar="s3://BUCKET/PREFIX",
                        help="restore a bucket backup to this prefix instead")
    add_s3_arguments(parser)
    parser.add_argument("--config", help="the server's TOML config (its encryption_key_file "
                                         "opens an encrypted backup)")
    parser.add_argument("--force", action="store_true",
                        help="move an existing DATA_DIR aside instead of refusing")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _only_regular(backup: Path) -> None:
    """``DataLoss`` naming the first entry of ``backup`` that is neither a regular file
    nor a directory (a link would restore bytes from outside the backup)."""
    for root, dirs, names in os.walk(backup):
        for name in dirs + names:
            path = Path(root) / name
            mode = path.lstat().st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
                # the file the backup wrote is not there: damage, like a missing one
                raise DataLoss(f"{path.relative_to(backup)} in the backup is {kind}: "
                               "a backup holds regular files only")


def check_backup(backup: Path, kind: str = "data_dir") -> tuple[list[dict], dict | None]:
    """The files ``backup.json`` lists, each checked, and its census (None in a version
    1 backup); ``InvalidRequest`` when it is not a backup of ``kind``, ``DataLoss`` naming
    the first file that is missing, differs or is a link."""
    try:
        manifest = json.loads((backup / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"{backup} is not a kvtier backup ({MANIFEST}: {exc})") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") not in (1, 2):
        raise InvalidRequest(f"{backup}/{MANIFEST} is not a version 1 or 2 {FORMAT} manifest")
    if manifest.get("kind", "data_dir") != kind:
        other = "--bucket" if kind == "data_dir" else "a DATA_DIR"
        raise InvalidRequest(f"{backup} is a backup of a {manifest.get('kind')}: restore it "
                             f"to {other}")
    census = backup_census.read(manifest)
    if census is None:
        print(f"kvtier restore-backup: {backup} is a version 1 backup, without a census: "
              "a segment or manifest lost together with its line in backup.json cannot be "
              "told from one never there", file=sys.stderr)
    _only_regular(backup)
    for entry in manifest["files"]:
        path = backup / entry["path"]
        if Path(entry["path"]).is_absolute() or ".." in Path(entry["path"]).parts:
            raise InvalidRequest(f"{MANIFEST} names a path outside the backup: {path}")
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            raise DataLoss(f"backup file {path} is missing or not {entry['bytes']} bytes")
        if digest(path) != entry["blake2b"]:
            raise DataLoss(f"backup file {path} fails its BLAKE2b digest")
    return manifest["files"], census


async def verify(data_dir: Path, keyring, remote: ObjectTier | None = None,
                 held: dict | None = None) -> Verified:
    """Open ``data_dir`` as the server does and verify every chunk and manifest, and what
    it holds against ``held`` (the backup's census); ``remote``: the node's S3 object tier
    (not in the backup), where manifests may name demoted chunks (listed, not scrubbed;
    closed here)."""
    from kvstore.compaction.job import manifest_store
    from kvstore.compaction.report import LogProgress
    from kvstore.compaction.scrub import scrub_disk, scrub_tier
    from kvstore.encryption.census import Census, census_disk, census_tier
    from kvstore.session.manifest import MANIFEST_PREFIX, SessionManifest
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.disk.snapshot import keys_digest
    from kvstore.tiers.object import ObjectTier, ObjectTierConfig

    out = Verified()
    disk = DiskTier(data_dir / "disk", 1 << 62)  # the writer: recovery runs, as at serve
    objects = None
    try:
        census = await census_disk(disk, Census(f"the backup restored in {data_dir}"))
        object_keys: set[str] = set()
        if (data_dir / "objects").is_dir():
            objects = ObjectTier(str(data_dir / "objects"), 1 << 62,
                                 ObjectTierConfig(compression_level=None))
            await census_tier(objects, census)
            object_keys = {key async for key in objects.keys()}
        census.require(keyring)
        elsewhere = set() if remote is None else {key async for key in remote.keys()}
        progress = LogProgress()
        corrupt = await scrub_disk(disk, None, progress, keyring)
        if objects is not None:
            corrupt += await scrub_tier(objects, None, progress, keyring)
        out.corrupt = [f"{c.key} ({c.tier}): {c.reason}" for c in corrupt]
        out.chunks_verified = disk.index.totals()[1] + len(object_keys) - len(corrupt)
        for name, raw in await manifest_store(disk, keyring).scan(MANIFEST_PREFIX):
            try:
                manifest = SessionManifest.decode(raw)
            except Exception as exc:  # noqa: BLE001 - any failure to decode is damage
                out.corrupt.append(f"{name} (manifest): {exc}")
                continue
            out.sessions += 1
            session = f"{manifest.tenant}/{manifest.session_id}"
            out.missing += [f"{session}: {key}" for key in manifest.chunk_keys
                            if key not in object_keys and key not in elsewhere
                            and disk.index.lookup(key.encode()) is None]
        if held is not None:
            stored = dict(await disk.meta.scan(MANIFEST_PREFIX))  # as stored: sealed or not
            chunk_keys = _chunk_keys(disk)
            missing, differing = backup_census.compare(held, stored, len(chunk_keys),
                                                       keys_digest(chunk_keys))
            out.missing += missing
            out.corrupt += differing
    finally:
        for tier in (objects, remote):
            if tier is not None:
                await tier.close()
        await disk.close()
    return out


def _chunk_keys(disk) -> list[bytes]:
    """Every chunk key the disk tier's index holds."""
    keys: list[bytes] = []
    while batch := disk.index.entries_after(keys[-1] if keys else None, 4096):
        keys += [key for key, _ in batch]
    return keys


def _target_problem(backup: Path, target: Path, force: bool) -> str | None:
    from kvstore.tiers.disk.lock import WRITER_LOCK, DirLock

    if nested(backup, target):
        return f"{target} and the backup {backup} must not contain each other"
    if target.exists() and not target.is_dir():
        return f"{target} is not a directory"
    if target.is_dir() and any(target.iterdir()):
        if not force:
            return f"{target} is not empty (--force moves it aside)"
        lock = target / "disk" / WRITER_LOCK
        if lock.parent.is_dir() and DirLock(lock, "writer").is_held_elsewhere():
            return f"a server is running on {target}: stop it first"
    return None


def restore(backup: Path, target: Path, keyring, force: bool, remote: ObjectTier | None = None
            ) -> tuple[Verified, float]:
    """Check, stage, verify and move into place; the verification and the seconds."""
    from kvstore.tiers.disk.snapshot import copy_prefix

    started = time.monotonic()
    files, census = check_backup(backup)
    unlisted = [] if census is None else backup_census.unlisted_segments(
        census, {entry["path"] for entry in files})
    stage = target.parent / f".{target.name}.restoring-{os.getpid()}"
    target.parent.mkdir(parents=True, exist_ok=True)
    stage.mkdir()
    try:
        for entry in files:
            (stage / entry["path"]).parent.mkdir(parents=True, exist_ok=True)
            copy_prefix(backup / entry["path"], stage / entry["path"])
        result = asyncio.run(verify(stage, keyring, remote, census))
        result.missing = unlisted + result.missing
        if result.corrupt or result.missing:
            raise Lost(result)
        if target.exists() and any(target.iterdir()):
            target.rename(f"{target}.replaced-{int(time.time())}")
        elif target.exists():
            target.rmdir()
        stage.rename(target)
    finally:
        if stage.exists():
            remove_tree(stage)
    return result, time.monotonic() - started


def _remote_objects(config) -> ObjectTier | None:
    """The config's S3 object tier of a single node (its chunks are not in a backup)."""
    if not (config.s3_bucket and config.object_bytes) or config.metadata == "shared":
        return None
    from kvstore.tiers.object import ObjectTier, ObjectTierConfig

    return ObjectTier(config.object_url, config.object_bytes, ObjectTierConfig(
        endpoint_url=config.s3_endpoint or None, region_name=config.s3_region or None))


def run(args: argparse.Namespace) -> int:  # noqa: C901 - a command's argument cases, each a line to the user
    from kvstore.encryption.seal import load_keyring
    from services.server.config_load import load_config

    if (args.data_dir is None) == (args.bucket is None):
        print("kvtier restore-backup: give a DATA_DIR or --bucket (one of them)",
              file=sys.stderr)
        return 2
    problem = args.bucket is None and _target_problem(args.backup, args.data_dir, args.force)
    if problem:
        print(f"kvtier restore-backup: refused: {problem}", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config, overrides={"data_dir": args.data_dir or "."})
        keyring = load_keyring(config.encryption_key_file, config.encryption_key)
        if args.bucket is None:
            result, seconds = restore(args.backup, args.data_dir, keyring, args.force,
                                      _remote_objects(config))
        else:
            from services.cli.backup_bucket import client, restore_bucket

            endpoint = args.s3_endpoint or config.s3_endpoint
            region = args.s3_region or config.s3_region
            result, seconds = restore_bucket(
                client(endpoint, region), args.backup, *check_backup(args.backup, "bucket"),
                args.bucket, keyring, args.force, endpoint, region)
    except (InvalidRequest, Busy) as exc:
        print(f"kvtier restore-backup: refused: {exc}; nothing was restored", file=sys.stderr)
        return 2
    except Lost as exc:
        lost = exc.result
        print(f"kvtier restore-backup: the backup {args.backup} does not verify:",
              file=sys.stderr)
        for line in (lost.corrupt + lost.missing)[:_SHOWN]:
            print(f"  {line}", file=sys.stderr)
        # the verdict comes last, where a reader of a long listing looks
        print(f"kvtier restore-backup: DATA_LOSS: the backup {args.backup} restores "
              f"{len(lost.corrupt)} corrupt and {len(lost.missing)} missing items; "
              f"nothing was restored to {args.data_dir or args.bucket}", file=sys.stderr)
        if args.json:
            print(json.dumps({"sessions": lost.sessions, "chunks_verified":
                              lost.chunks_verified, "corrupt": lost.corrupt,
                              "missing": lost.missing, "restored": False}))
        return 1
    except DataLoss as exc:
        print(f"kvtier restore-backup: DATA_LOSS: {exc}; nothing was restored",
              file=sys.stderr)
        return 1
    except (KVTierError, BotoCoreError, ClientError) as exc:
        print(f"kvtier restore-backup: failed: {type(exc).__name__}: {exc}; what was "
              "uploaded was removed", file=sys.stderr)
        return 1
    report = {"path": str(args.data_dir or args.bucket), "sessions": result.sessions,
              "chunks_verified": result.chunks_verified, "corrupt": [], "missing": [],
              "restored": True, "seconds": round(seconds, 3)}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"restored {args.backup} to {report['path']} in {seconds:.2f} s: "
              f"{result.sessions} sessions, {result.chunks_verified} chunks verified, "
              "0 corrupt")
    return 0
