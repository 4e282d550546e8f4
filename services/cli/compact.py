"""``kvtier compact``: the offline compaction job over a data directory.

    kvtier compact --data-dir D [--dry-run] [--json] [--ttl 7d] [--demote-after 2h]
                   [--zstd-level 9] [--dead-fraction 0.25] [--server HOST:PORT]
                   [--as-of UNIX_SECONDS]

Reclaims dead segment space, expires sessions, collects unreferenced chunks, demotes
idle sessions to the object tier (zstd at ``--zstd-level``) and scrubs checksums; the
steps and their protocol beside a server are ``kvstore.compaction.job``'s. The data
directory is the server's (``services.server.store``): ``D/disk``, ``D/objects`` (the
local object tier, unless ``--config`` names S3) and ``D/quarantine`` for the corrupt
chunks this job removed.

With no server live the job holds ``D/disk/writer.lock`` through the session and scrub
steps and changes sessions through its own TierManager. With one live, expiry and
demotion go through its Delete and Evict RPCs at ``--server`` or the address recorded in
``D/server.addr`` (with neither they are skipped, and the report says so), and
unreferenced-chunk collection is skipped.

An encrypted directory is opened with the server's keyring (``--config``'s
``encryption_key_file`` or ``KVTIER_ENCRYPTION_KEY``, as ``kvtier serve`` reads it);
without it, with a key that does not open what the directory holds, or with a key for a
directory in clear, the job refuses having changed nothing (``kvstore.encryption.census``).

Progress: a tqdm bar per step on a terminal, log lines otherwise; ``--json`` prints the
report as one JSON object. Exit status: 0 done, 2 bad arguments or a keyring that does
not open the directory, 3 another compaction runs, 1 any other store error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
from pathlib import Path

from kvstore.format.errors import Busy, InvalidRequest, KVTierError
from services.cli.address import ClientOptions, add_credential_arguments, client_options

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``"90"``, ``"90s"``, ``"15m"``, ``"2h"``, ``"7d"``, ``"1w"`` -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 15m, 2h, 7d)")
    number, unit = match.groups()
    return float(number) * _SECONDS[unit or "s"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", required=True, type=Path,
                        help="the server's data directory (holds disk/ and objects/)")
    parser.add_argument("--config", help="the server's TOML config (S3 object tier, sizes, "
                                         "encryption_key_file)")
    parser.add_argument("--dry-run", action="store_true",
                        help="change nothing; report what would be done")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--ttl", type=parse_duration,
                        help="expire sessions idle longer than this (besides their own TTL)")
    parser.add_argument("--demote-after", type=parse_duration,
                        help="demote sessions idle longer than this to the object tier")
    parser.add_argument("--zstd-level", type=int, default=3,
                        help="zstd level for demoted chunks (offline runs; default 3)")
    parser.add_argument("--dead-fraction", type=float, default=0.25,
                        help="rewrite sealed segments at least this dead (default 0.25)")
    parser.add_argument("--no-scrub", action="store_true", help="skip checksum verification")
    parser.add_argument("--as-of", type=float, metavar="UNIX_SECONDS",
                        help="judge idleness and TTLs as of this time (default: now); with "
                             "--dry-run, previews what a later run would expire and demote")
    parser.add_argument("--server", help="address of the live server on this directory "
                                         "(default: the one it recorded in DATA_DIR)")
    add_credential_arguments(parser)  # a server that authenticates: an admin token
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    from kvstore.compaction.report import CompactOptions
    from services.server.config_load import load_config

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = CompactOptions(dry_run=args.dry_run, ttl_s=args.ttl,
                                 demote_after_s=args.demote_after, zstd_level=args.zstd_level,
                                 dead_fraction=args.dead_fraction, scrub=not args.no_scrub,
                                 as_of=args.as_of)
        config = load_config(args.config, overrides={"data_dir": args.data_dir})
        report = asyncio.run(_compact(config, options, args.server, client_options(args)))
    except Busy as exc:
        print(f"kvtier compact: refused: {exc}", file=sys.stderr)
        return 3
    except InvalidRequest as exc:
        print(f"kvtier compact: {exc}", file=sys.stderr)
        return 2
    except KVTierError as exc:
        print(f"kvtier compact: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print("\n".join(report.lines()))
    return 0


def _progress():
    from kvstore.compaction.report import LogProgress

    if sys.stderr.isatty():
        from services.cli.compact_progress import BarProgress

        return BarProgress()
    return LogProgress()


async def _compact(config, options, server: str | None, connection: ClientOptions):
    from kvstore.encryption.census import Census, census_disk
    from kvstore.encryption.seal import load_keyring
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.disk.lock import WRITER_LOCK, DirLock

    disk_dir = config.data_dir / "disk"
    if config.metadata == "shared":  # one node's counts would collect the fleet's chunks
        raise InvalidRequest(
            "the config has metadata = 'shared': a fleet's manifests and chunks live in "
            "its bucket, which kvtier fleet-gc collects (mark and sweep over every "
            "manifest); a node's local tiers are caches its server reclaims itself")
    if not (disk_dir / "index").is_dir():
        raise InvalidRequest(f"{config.data_dir} holds no disk tier ({disk_dir}/index is "
                             "missing): nothing to compact")
    if options.demote_after_s is not None and not config.object_bytes:
        raise InvalidRequest("--demote-after needs an object tier; the config has "
                             "object_bytes = 0")
    keyring = load_keyring(config.encryption_key_file, config.encryption_key)
    disk = DiskTier(disk_dir, config.disk_bytes, writer=False)
    writer = DirLock(disk_dir / WRITER_LOCK, "the disk tier's writer lock")
    try:
        # before anything changes: does the keyring (or its absence) open what is stored?
        census = await census_disk(disk, Census(f"the data directory {config.data_dir}"))
        census.require(keyring)
        if options.dry_run:
            mode = "live" if DiskTier.writer_is_live(disk_dir) else "offline"
            return await _run(disk, options, mode, config, None, "", keyring=keyring)
        disk.compact_lock.acquire()
        if writer.try_acquire():
            return await _offline(disk, options, config, writer, keyring, census)
        return await _live(disk, options, config, server, connection, keyring)
    finally:
        writer.release()
        await disk.close()


async def _run(disk, options, mode, config, ops, why, **extra):
    from kvstore.compaction.job import run_compaction

    return await run_compaction(disk, options, _progress(), mode=mode, ops=ops,
                                why_no_ops=why, quarantine_dir=config.data_dir / "quarantine",
                                **extra)


async def _offline(disk, options, config, writer, keyring, census):
    from kvstore.compaction.job import manifest_store
    from kvstore.compaction.sessions import ManagerOps
    from kvstore.encryption.census import census_tier
    from kvstore.session.manager import TierManager
    from kvstore.tiers.disk.recovery import seal_dead_writer
    from services.server.store import manager_config

    objects = None
    if config.object_bytes:  # the objects this run scrubs and demotes into: checked too
        objects = _object_tier(config, options.zstd_level, keyring)
        try:
            await census_tier(objects, census)
            census.require(keyring)
        except BaseException:
            await objects.close()
            raise
    sealed = seal_dead_writer(disk.index, disk.path)
    if sealed is not None:
        logging.getLogger(__name__).info("sealed segment %d of the stopped server", sealed)
    tiers = [disk] if objects is None else [disk, objects]
    if keyring is not None:  # as the server stacks them (services.server.store)
        from kvstore.encryption.tiers import BlockDomains, EncryptedTier

        domains = BlockDomains()
        tiers = [EncryptedTier(tier, keyring, domains) for tier in tiers]
    # the server's retention: chunks it keeps as cache are not garbage to collect here
    manager = await TierManager.open(tiers, manifest_store(disk, keyring),
                                     config=manager_config(config))
    try:
        return await _run(disk, options, "offline", config,
                          ManagerOps(manager, None if keyring else options.zstd_level), "",
                          object_tier=objects, after_sessions=writer.release,
                          keyring=keyring)
    finally:
        await manager.close()


async def _live(disk, options, config, server, connection: ClientOptions, keyring):
    from services.cli.compact_remote import ServerOps
    from services.server.address_file import SERVER_ADDRESS_FILE, recorded_address

    address = server or recorded_address(config.data_dir)
    if address is None:
        why = (f"a server is live on {config.data_dir} and its address is unknown (pass "
               f"--server HOST:PORT; it is not recorded in {SERVER_ADDRESS_FILE})")
        return await _run(disk, options, "live", config, None, why, keyring=keyring)
    ops = ServerOps(address, connection)
    try:
        return await _run(disk, options, "live", config, ops, "", keyring=keyring)
    finally:
        await ops.close()


def _object_tier(config, zstd_level: int, keyring):
    from kvstore.tiers.object import ObjectTier, ObjectTierConfig

    # encrypted values are random bytes: zstd would only cost time (as the server does)
    return ObjectTier(config.object_url, config.object_bytes, ObjectTierConfig(
        compression_level=zstd_level if keyring is None else None,
        endpoint_url=config.s3_endpoint or None,
        region_name=config.s3_region or None))
