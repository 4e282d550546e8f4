"""``kvtier rekey --config C [--data-dir D] [--json]``: reseal, under the keyring's
current key, everything the server of ``C`` stores under its other keys, and say which
keys are then no longer needed (``kvstore.encryption.rekey``).

Rotation: ``kvtier keygen --rotate KEYRING`` adds a new current key; every server holding
the keyring restarts with it (new writes are sealed under the new key, old values still
open); ``kvtier rekey`` reseals the rest; once it says ``key K is no longer needed``,
remove K's ``[[key]]`` and restart.

Places, as the config names them: the Redis tier and a fleet's bucket (chunks and
manifests) are rewritten online, beside running servers; the disk tier of ``data_dir``
and a node's own object tier here only while no server runs on it (its writer owns the
segments, its accounting the objects). A live node's server reseals them itself while
its keyring holds another key than ``current`` (at start and after a reload:
``kvstore.encryption.resealer``), so this run counts them, and a later run counts
what is left. A run cut short is simply run again; every
rewritten value is read back and checked. A value that does not open (corrupt, or under
a key the keyring lacks) is left as it is and reported: it keeps its key counted.

Exit status: 0 done (``sealed_under_old`` may still be above 0: see the report), 2 bad
arguments, no key configured or a keyring that does not parse, 1 any other store error
(a medium unreachable; nothing is lost).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path

from kvstore.format.errors import InvalidRequest, KVTierError

SEALED_TIERS = ("redis", "disk", "object")  # the media that leave the process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True,
                        help="the server's TOML config (its tiers and encryption_key_file)")
    parser.add_argument("--data-dir", type=Path, help="the server's data directory "
                        "(default: the config's data_dir)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--log-level", default="WARNING")


def run(args: argparse.Namespace) -> int:
    from services.server.config_load import load_config

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        overrides = {} if args.data_dir is None else {"data_dir": args.data_dir}
        config = load_config(args.config, overrides=overrides)
        report, skipped = asyncio.run(_rekey(config))
    except InvalidRequest as exc:
        print(f"kvtier rekey: {exc}", file=sys.stderr)
        return 2
    except KVTierError as exc:
        print(f"kvtier rekey: failed: {type(exc).__name__}: {exc}; nothing is lost (every "
              "value is under one key or the other): run it again", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**report.as_dict(), "skipped": skipped}))
    else:
        print("\n".join(skipped + report.lines()))
    return 0


async def _rekey(config) -> tuple:
    from kvstore.encryption.rekey import RekeyReport
    from kvstore.encryption.seal import load_keyring
    from kvstore.tiers.disk import DiskTier

    keyring = load_keyring(config.encryption_key_file, config.encryption_key)
    if keyring is None:
        raise InvalidRequest("the config encrypts nothing (no encryption_key_file or "
                             "KVTIER_ENCRYPTION_KEY): there is nothing to rekey")
    report = RekeyReport(keyring.current, keyring.key_ids)
    skipped: list[str] = []
    disk_dir = config.data_dir / "disk"
    disk_live = bool(config.disk_bytes) and DiskTier.writer_is_live(disk_dir)
    # a node's own object tier (not a fleet's bucket) is its server's too: its accounting
    own_objects = disk_live and config.metadata != "shared" and bool(config.object_bytes)
    if disk_live:
        skipped.append(f"{'disk and object tiers' if own_objects else 'disk tier'} of "
                       f"{config.data_dir}: the server running on them reseals them itself "
                       "(after its start or a reload with the rotated keyring); counted "
                       "here, run again to count what is left")
    # the media as stored (no EncryptedTier), never compressed (sealed bytes are random)
    counted = dataclasses.replace(config, object_compression_level=-1,
                                  disk_bytes=0 if disk_live else config.disk_bytes)
    await _rewrite(dataclasses.replace(counted, object_bytes=0) if own_objects else counted,
                   keyring, report)
    report.remaining.clear()  # recounted, the live disk included
    await _recount(counted, report)
    if disk_live and (disk_dir / "index").is_dir():
        from kvstore.encryption.rekey import census_record_keys, census_tier_keys

        disk = DiskTier(disk_dir, config.disk_bytes, writer=False)
        try:
            await census_tier_keys(disk, report)
            if config.metadata != "shared":
                await census_record_keys(disk.meta, report)
        finally:
            await disk.close()
    return report, skipped


async def _rewrite(config, keyring, report) -> None:
    from kvstore.encryption.rekey import rekey_records, rekey_tier
    from services.server.store import prepare_data_dir

    tiers: list = []
    try:
        if config.disk_bytes:
            prepare_data_dir(config.data_dir)
        meta = await _open(config, tiers)
        for tier in tiers:
            if tier.name in SEALED_TIERS:
                await rekey_tier(tier, keyring, report)
        if config.disk_bytes or config.metadata == "shared":
            where = (f"the bucket {config.s3_bucket!r}" if config.metadata == "shared"
                     else f"manifests of {config.data_dir}")
            sealing = None
            if config.metadata == "shared":
                from services.cli.fleet_gc import open_bucket

                sealing = open_bucket(config, keyring)
            try:
                await rekey_records(meta, keyring, report, where, sealing)
            finally:
                if sealing is not None:
                    await sealing.close()
    finally:
        for tier in tiers:
            await tier.close()


async def _open(config, tiers: list):
    from kvstore.format.errors import Busy
    from services.server.store import build_tiers

    try:
        return build_tiers(config, tiers)
    except Busy as exc:
        raise InvalidRequest(f"{exc}: a server started on {config.data_dir} during the "
                             "run; run again") from exc


async def _recount(config, report) -> None:
    from kvstore.encryption.rekey import census_record_keys, census_tier_keys

    tiers: list = []
    try:
        meta = await _open(config, tiers)
        for tier in tiers:
            if tier.name in SEALED_TIERS:
                await census_tier_keys(tier, report)
        if config.disk_bytes or config.metadata == "shared":
            await census_record_keys(meta, report)
    finally:
        for tier in tiers:
            await tier.close()
