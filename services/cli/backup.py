"""``kvtier backup``: a consistent snapshot of a data directory, live or not.

    kvtier backup --data-dir D BACKUP [--wait 60] [--json]
    kvtier backup --bucket s3://BUCKET/PREFIX BACKUP [--s3-endpoint URL] [--json]

Writes the new directory ``BACKUP``: ``disk/`` (the LMDB index and the segments it names,
copied by ``kvstore.tiers.disk.snapshot`` beside a running server), ``objects/`` (the
local object tier, when there is one), ``layouts.json``, and last ``backup.json``: the
format version, when, from where, every file with its size and BLAKE2b digest, the
counts of sessions and chunks, and the census a restore is checked against
(``services.cli.backup_census``: each session, the chunks, the segments). A directory
without ``backup.json`` is not a backup. Encrypted values are copied as stored (no key
is needed). With ``--bucket`` a fleet's bucket prefix is backed up instead
(``services.cli.backup_bucket``; S3 credentials as boto3 finds them). ``docs/backup.md``
says what a backup covers; ``kvtier restore-backup`` restores and verifies one.

Exit status: 0 written, 2 bad arguments (no disk tier, BACKUP not empty or inside D,
not an s3:// URL),
3 a compaction held the directory past ``--wait``, 1 a copy failed (BACKUP removed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from kvstore.format.errors import Busy, InvalidRequest, KVTierError

MANIFEST = "backup.json"
FORMAT = "kvtier-backup"
VERSION = 2  # 2: the census (a version 1 backup has none)
_READ = 8 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-dir", type=Path,
                        help="the server's data directory (holds disk/)")
    source.add_argument("--bucket", metavar="s3://BUCKET/PREFIX",
                        help="a fleet's bucket prefix instead of a data directory")
    parser.add_argument("backup", type=Path, help="the new backup directory")
    add_s3_arguments(parser)
    parser.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for a running compaction (default 60)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def add_s3_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--s3-endpoint", help="S3 endpoint URL for --bucket (default: AWS)")
    parser.add_argument("--s3-region", help="S3 region for --bucket")


def digest(path: Path) -> str:
    hasher = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as file:
        while block := file.read(_READ):
            hasher.update(block)
    return hasher.hexdigest()


def nested(a: Path, b: Path) -> bool:
    """Whether either directory is (inside) the other."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def remove_tree(path: Path, *, keep_root: bool = False) -> None:
    """Remove ``path`` and what it holds (only what it holds: ``keep_root``)."""
    if not keep_root:
        shutil.rmtree(path, ignore_errors=True)
        return
    for child in path.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def _copy_objects(source: Path, target: Path, done: set[str]) -> list[Path]:
    """Copy the object files not copied yet (its ``.tmp`` writes left out); the new
    copies. An object removed meanwhile is skipped."""
    from kvstore.tiers.disk.snapshot import copy_prefix

    out = []
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if relative.parts[0] == ".tmp" or not path.is_file() or str(relative) in done:
            continue
        copy = target / relative
        copy.parent.mkdir(parents=True, exist_ok=True)
        try:
            copy_prefix(path, copy)
        except FileNotFoundError:
            continue
        done.add(str(relative))
        out.append(copy)
    return out


def take_backup(data_dir: Path, backup: Path, wait_s: float) -> dict:
    """Write the backup of ``data_dir`` into the new directory ``backup``; its report."""
    from kvstore.tiers.disk.segments import segment_path
    from kvstore.tiers.disk.snapshot import copy_prefix, snapshot_disk
    from services.cli import backup_census

    started = time.monotonic()
    objects, copied = data_dir / "objects", set[str]()
    files = []
    # objects before and after the index snapshot: a chunk demoted meanwhile is in one
    if objects.is_dir():
        files += _copy_objects(objects, backup / "objects", copied)
    snap = snapshot_disk(data_dir / "disk", backup / "disk", wait_s=wait_s)
    files += snap.files
    if objects.is_dir():
        files += _copy_objects(objects, backup / "objects", copied)
    if (data_dir / "layouts.json").is_file():
        copy_prefix(data_dir / "layouts.json", backup / "layouts.json")
        files.append(backup / "layouts.json")
    held = snap.holdings
    census = backup_census.take(held.manifests, snap.chunks, held.chunk_keys, [
        str(segment_path(backup / "disk" / "segments", seg_id).relative_to(backup))
        for seg_id in held.segments])
    return write_manifest(backup, files, {}, str(data_dir.resolve()), "data_dir",
                          snap.manifests, snap.chunks + len(copied), started, census)


def take_bucket_backup(url: str, backup: Path, endpoint: str | None,
                       region: str | None) -> dict:
    """Write the backup of a bucket prefix into the new directory ``backup``; its report."""
    from services.cli.backup_bucket import back_up_bucket, client

    started = time.monotonic()
    files, keys, census = back_up_bucket(client(endpoint, region), url, backup)
    return write_manifest(backup, files, keys, url, "bucket", len(census["sessions"]),
                          census["chunks"], started, census)


def write_manifest(backup: Path, files: list[Path], keys: dict[str, str], source: str,
                   kind: str, sessions: int, chunks: int, started: float, census: dict
                   ) -> dict:
    """Write ``backup.json`` last (fsynced, renamed in); the backup's report. ``keys``:
    a bucket object's key by file path; ``census``: ``backup_census.take``'s."""
    listed = []
    for path in files:
        relative = str(path.relative_to(backup))
        listed.append({"path": relative, "bytes": path.stat().st_size,
                       "blake2b": digest(path)} | ({"key": keys[relative]}
                                                   if relative in keys else {}))
    manifest = {"format": FORMAT, "version": VERSION, "kind": kind, "created": time.time(),
                "source": source, "sessions": sessions, "chunks": chunks, "census": census,
                "files": listed}
    temp = backup / f".{MANIFEST}.tmp"
    with open(temp, "w") as file:
        json.dump(manifest, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp, backup / MANIFEST)
    for directory in {backup, *(path.parent for path in files)}:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return {"path": str(backup), "files": len(listed),
            "bytes": sum(entry["bytes"] for entry in listed), "sessions": sessions,
            "chunks": chunks, "seconds": round(time.monotonic() - started, 3)}


def run(args: argparse.Namespace) -> int:
    data_dir, backup = args.data_dir, args.backup
    if data_dir is None:
        data_dir = args.bucket
    elif not (data_dir / "disk" / "index").is_dir():
        print(f"kvtier backup: no disk tier in {data_dir} ({data_dir}/disk/index is "
              "missing)", file=sys.stderr)
        return 2
    if args.bucket is None and nested(data_dir, backup):
        print(f"kvtier backup: refused: {backup} and {data_dir} must not contain each other",
              file=sys.stderr)
        return 2
    if backup.exists() and (not backup.is_dir() or any(backup.iterdir())):
        print(f"kvtier backup: refused: {backup} exists and is not an empty directory",
              file=sys.stderr)
        return 2
    made = not backup.exists()
    backup.mkdir(parents=True, exist_ok=True)
    try:
        report = (take_backup(data_dir, backup, args.wait) if args.bucket is None else
                  take_bucket_backup(args.bucket, backup, args.s3_endpoint, args.s3_region))
    except BaseException as exc:
        # half a backup must not pass for one: remove what this run wrote
        remove_tree(backup, keep_root=not made)
        if isinstance(exc, Busy):
            print(f"kvtier backup: refused: {exc} (a compaction runs: try again after it)",
                  file=sys.stderr)
            return 3
        if isinstance(exc, InvalidRequest):
            print(f"kvtier backup: refused: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, (KVTierError, OSError, BotoCoreError, ClientError)):
            print(f"kvtier backup: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        raise
    if args.json:
        print(json.dumps(report))
    else:
        print(f"backed up {data_dir} to {report['path']} in {report['seconds']:.2f} s: "
              f"{report['sessions']} sessions, {report['chunks']} chunks, "
              f"{report['files']} files, {report['bytes']} bytes")
    return 0
