"""``kvtier repair``: rebuild a data directory's disk index from its segment files.

    kvtier repair --data-dir D [--config C] [--json]

``D`` is the server's data directory (the disk tier in ``D/disk``) or the disk tier's
own directory. Run it when ``kvtier serve`` says the disk index is corrupt, or when the
LMDB environment (``index/``) is lost: the old environment is moved aside, never
deleted, and a new one is built from the segments (``kvstore.compaction.index_repair``).
Reports the sessions recovered, those with chunks not on disk, and the chunks no
session names (orphans: kept; ``kvtier compact`` collects them). A chunk a recovered
manifest names that is neither on disk nor in the node's object tier (``D/objects``, or
the S3 tier of ``--config``), and a manifest that does not decode, is data loss: the
index is rebuilt all the same, and the command says DATA_LOSS, lists them and exits 1.

An encrypted data directory needs the server's key, from ``--config`` (its
``encryption_key_file``) or the environment (``KVTIER_ENCRYPTION_KEY``, as the server
reads it): the manifests are encrypted, and the references are recounted from them.
Without it, or with a key of the same id that does not open them, repair refuses and
changes nothing.

A fleet node's directory (``metadata = "shared"`` in ``--config``) logs no manifests: they
live in the fleet's bucket, so the references are recounted from the bucket's manifests
(every node's: a chunk any session names stays referenced). A bucket that cannot be read
is a refusal: without its manifests every reference would be lost. The node's directory
names its bucket (the server records it), so a repair without the node's config is
refused too, changing nothing.

Exit status: 0 repaired, 1 repaired but data lost (DATA_LOSS), 2 no disk tier there, a
server (or compaction) holds it, the key of encrypted manifests is missing, or a fleet
node's bucket cannot be read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from kvstore.format.errors import Busy, InvalidRequest, KVTierError

_SHOWN = 10  # names listed per line in the text report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", required=True, type=Path,
                        help="the server's data directory (holds disk/), or the disk tier's")
    parser.add_argument("--config", help="the server's TOML config (its encryption_key_file "
                                         "opens an encrypted directory's manifests)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def disk_directory(data_dir: Path) -> Path | None:
    for candidate in (data_dir / "disk", data_dir):
        if (candidate / "segments").is_dir():
            return candidate
    return None


def run(args: argparse.Namespace) -> int:  # noqa: C901 - a command's argument cases, each a line to the user
    from kvstore.compaction.index_repair import repair
    from kvstore.encryption.seal import load_keyring
    from services.server.config_load import load_config

    disk = disk_directory(args.data_dir)
    if disk is None:
        print(f"kvtier repair: no disk tier in {args.data_dir} (no segments/ there or in "
              "disk/)", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)  # the key as the server reads it (file or env)
        keyring = load_keyring(config.encryption_key_file, config.encryption_key)
        fleet = asyncio.run(_fleet_manifests(config, keyring)) \
            if config.metadata == "shared" else None
        report = repair(disk, keyring=keyring, fleet_manifests=fleet)
    except Busy as exc:
        print(f"kvtier repair: {exc}: stop the server (or wait for the compaction) first",
              file=sys.stderr)
        return 2
    except InvalidRequest as exc:  # a missing key, or a config that does not load
        print(f"kvtier repair: refused: {exc}", file=sys.stderr)
        return 2
    except (KVTierError, BotoCoreError, ClientError) as exc:  # the fleet's bucket
        print(f"kvtier repair: refused: the fleet's manifests could not be read "
              f"({type(exc).__name__}: {exc}); without them every reference would go "
              "uncounted; nothing was changed", file=sys.stderr)
        return 2
    unlisted = ""
    try:
        held = asyncio.run(_held_elsewhere(disk, config)) if report.not_on_disk else set()
    except (KVTierError, OSError, BotoCoreError, ClientError) as exc:
        held, unlisted = set(), f"{type(exc).__name__}: {exc}"  # then none counts as held
    lost = report.settle(held)
    if lost:
        why = f" (the object tier could not be listed: {unlisted})" if unlisted else ""
        print("kvtier repair: what the log names and no tier holds:", file=sys.stderr)
        for line in lost[:_SHOWN]:
            print(f"  {line}", file=sys.stderr)
        # the verdict comes last, where a reader of a long listing looks
        print(f"kvtier repair: DATA_LOSS: the index of {report.path} was rebuilt, but "
              f"{len(lost)} chunks and manifests its log names are not held{why}",
              file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_dict()))
        return 1 if lost else 0
    print(f"repaired {report.path} in {report.seconds:.2f} s: {report.segments} segments, "
          f"{report.records} records ({report.damaged_bytes} damaged bytes skipped)")
    if report.moved_aside:
        print(f"  old index moved to {report.moved_aside}")
    for label, names in (("sessions recovered", report.sessions),
                         ("sessions with chunks not on disk", report.incomplete),
                         ("corrupt manifests", report.corrupt_manifests),
                         ("orphan chunks (kvtier compact collects them)", report.orphans)):
        more = f", ... {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
        print(f"  {label}: {len(names)}" + (f" ({', '.join(names[:_SHOWN])}{more})"
                                           if names else ""))
    return 1 if lost else 0


async def _fleet_manifests(config, keyring) -> dict[str, bytes]:
    """Every manifest in the fleet's bucket, opened: a fleet node's log holds none, so its
    references are recounted from these."""
    from kvstore.session.manifest import MANIFEST_PREFIX
    from services.cli.fleet_gc import open_bucket

    meta = open_bucket(config, keyring)
    try:
        return dict(await meta.scan(MANIFEST_PREFIX))
    finally:
        await meta.tier.close()


async def _held_elsewhere(disk: Path, config) -> set[str]:
    """The chunk keys the node's object tiers hold: the local one beside the disk tier
    (``D/objects``) and the S3 one of its config."""
    from kvstore.tiers.object import ObjectTier, ObjectTierConfig

    tiers = []
    local = disk.parent / "objects"
    if disk.name == "disk" and local.is_dir():
        tiers.append(ObjectTier(str(local), 1 << 62, ObjectTierConfig(compression_level=None)))
    if config.object_bytes and config.s3_bucket:
        tiers.append(ObjectTier(config.object_url, config.object_bytes, ObjectTierConfig(
            compression_level=None, endpoint_url=config.s3_endpoint or None,
            region_name=config.s3_region or None, shared=config.metadata == "shared")))
    held: set[str] = set()
    try:
        for tier in tiers:
            held |= {key async for key in tier.keys()}
    finally:
        for tier in tiers:
            await tier.close()
    return held
