"""``kvtier migrate``: switch an existing single-node data directory to a fleet's shared
metadata, once (docs/fleet.md "Migrating a single node").

    kvtier migrate --config C [--data-dir D] [--json]

``C`` is the node's config as it will serve (``metadata = "shared"``, ``s3_bucket``...);
``D`` (default: ``C``'s ``data_dir``) is the directory its single-node server used, now
stopped. Each session manifest is planned against the bucket: absent there, it is
migrated; the same there, it is done; any other is a conflict, reported, never
overwritten, and none of its chunks uploaded. A manifest is written only after all its
chunks are intact in the bucket, and only where the bucket has none (If-None-Match).
Windows are not carried over (resumes replay them). A second run only finishes what an
interrupted one left.

Encryption at rest goes across as it is: an encrypted directory into a fleet with the
same keys (``C``'s ``encryption_key_file`` or ``KVTIER_ENCRYPTION_KEY``), a directory in
clear into a fleet in clear; anything else, checked before anything is written
(``kvstore.encryption.census``), and migrate refuses having changed nothing.

Exit status: 0 every session migrated (or already), 1 some are conflicts, have chunks
no local tier holds intact or a manifest that does not decode (listed), 2 refused (not
a shared config, no disk tier, a key that does not match the directory or the bucket,
the directory in use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstore.format.errors import (
    Busy,
    ChunkCorrupt,
    CodecError,
    DataLoss,
    InvalidRequest,
    StaleGeneration,
    TierUnavailable,
    UnsupportedVersion,
)

_CONCURRENCY = 8  # chunk transfers in flight


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="the node's TOML config as it will serve (shared)")
    parser.add_argument("--data-dir", type=Path,
                        help="the single-node data directory (default: the config's)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


@dataclass
class MigrateReport:
    sessions: int = 0
    migrated: int = 0  # manifests written now
    already: int = 0  # in the bucket before, same generation and content
    conflicts: list[str] = field(default_factory=list)  # another generation or content there
    incomplete: list[str] = field(default_factory=list)  # a chunk no local tier holds intact
    corrupt_manifests: list[str] = field(default_factory=list)  # local ones that do not decode
    chunks_uploaded: int = 0
    chunks_present: int = 0  # already in the bucket, read back and intact
    chunks_replaced: int = 0  # in the bucket but not intact: uploaded again
    bytes_uploaded: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


async def _chunk(manager, objects, manifest, index: int, done: dict[str, bool],
                 report: MigrateReport) -> bool:
    """Make chunk ``index`` of ``manifest`` intact in the bucket; False if no local tier
    holds it intact (and the bucket does not either)."""
    from kvstore.format.keys import chunk_digest, split_block_key

    key = manifest.chunk_keys[index]
    if key in done:
        return done[key]
    digest = split_block_key(key)[1]
    held = None
    try:
        held = bytes(await objects.get(key)) if await objects.contains(key) else None
    except (DataLoss, CodecError):
        held = b""  # a copy that does not open or decompress: replaced below
    if held is not None and chunk_digest(held) == digest:
        report.chunks_present += 1
        done[key] = True
        return True
    try:
        data, _ = await manager.read_chunk(manifest, index)
    except DataLoss:
        done[key] = False
        return False
    if chunk_digest(data) != digest:
        done[key] = False
        return False
    await objects.put(key, data)
    report.chunks_replaced += held is not None
    report.chunks_uploaded += held is None
    report.bytes_uploaded += len(data)
    done[key] = True
    return True


async def _there(meta, key: str) -> bytes | None:
    """The bucket's manifest under ``key``; one that does not open under the fleet's key
    is returned as an empty record (a conflict: never overwritten)."""
    try:
        return await meta.get(key)
    except ChunkCorrupt:
        return b""


def _same(local, there: bytes | None) -> bool | None:
    """None: the bucket has no manifest there; else whether it is ``local``'s (same
    generation and content)."""
    from kvstore.session.manifest import SessionManifest

    if there is None:
        return None
    try:
        other = SessionManifest.decode(there)
    except (ChunkCorrupt, UnsupportedVersion):
        return False  # not ours to judge or overwrite: a conflict
    return ((other.generation, other.spill_digest, other.chunk_keys)
            == (local.generation, local.spill_digest, local.chunk_keys))


async def check_keys(source, config, data_dir: Path, keyring) -> None:
    """Refuse (``InvalidRequest``, before anything is opened for writing) a directory or
    bucket ``keyring`` does not open as stored (``kvstore.encryption.census``)."""
    from kvstore.encryption.census import Census, census_disk, census_tier
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.object import ObjectTier
    from services.cli.fleet_gc import check_bucket_keys

    census = Census(f"the data directory {data_dir}")
    disk = DiskTier(data_dir / "disk", source.disk_bytes, writer=False)
    try:
        await census_disk(disk, census)
    finally:
        await disk.close()
    if source.object_bytes:
        objects = ObjectTier(source.object_url, source.object_bytes)
        try:
            await census_tier(objects, census)
        finally:
            await objects.close()
    census.require(keyring)
    await check_bucket_keys(config, keyring)


async def migrate(config, data_dir: Path) -> MigrateReport:  # noqa: C901 - one pass over the sessions, each copied under the gate
    """Copy ``data_dir``'s sessions into ``config``'s bucket as the module says; the
    directory's registered layouts go first. A session that loses a race at its
    manifest's write leaves its chunks for the fleet's garbage collection."""
    from kvstore.encryption.seal import load_keyring
    from kvstore.fleet.gc import prepare_bucket
    from kvstore.session.manifest import MANIFEST_PREFIX, SessionManifest
    from services.cli.fleet_gc import open_bucket
    from services.server.layout_registry import ServerLayouts, fleet_layouts
    from services.server.store import open_manager

    started = time.monotonic()
    if not (data_dir / "disk").is_dir():
        raise InvalidRequest(f"no disk tier in {data_dir}: a single node without one keeps "
                             "its manifests in memory only, there is nothing to migrate")
    # the source as its single node served it, with the fleet's key (if any)
    source = config.replace(
        data_dir=data_dir, metadata="local", s3_bucket="", s3_endpoint="", s3_region="",
        redis_url="", object_bytes=config.object_bytes if (data_dir / "objects").is_dir()
        else 0)
    keyring = load_keyring(config.encryption_key_file, config.encryption_key)
    await check_keys(source, config, data_dir, keyring)
    meta = open_bucket(config, keyring)
    try:
        # the directory's registered layouts, known before its manifests are read
        layouts = ServerLayouts(source.layouts, data_dir, source.layout_policy,
                                source.max_message_bytes, shared=fleet_layouts(meta))
        manager = await open_manager(source)
    except BaseException:
        await meta.close()
        raise
    chunks = meta.tier
    if keyring is not None:  # sealed for the domain the source's sealed copy names
        from kvstore.encryption.claims import DomainClaims
        from kvstore.encryption.tiers import EncryptedTier

        hook = manager.write_hook
        assert isinstance(hook, DomainClaims)  # an encrypting store's (open_manager)
        chunks = EncryptedTier(meta.tier, keyring, hook.domains)
    report = MigrateReport()
    done: dict[str, bool] = {}
    gate = asyncio.Semaphore(_CONCURRENCY)

    async def bounded(manifest, index: int) -> bool:
        async with gate:
            return await _chunk(manager, chunks, manifest, index, done, report)

    try:
        await prepare_bucket(meta)  # the epoch object, if this bucket has none yet
        await meta.gate.baseline()
        plan = []
        for key, value in await manager.meta.scan(MANIFEST_PREFIX):
            report.sessions += 1
            try:
                local = SessionManifest.decode(value)
            except (ChunkCorrupt, UnsupportedVersion):
                report.corrupt_manifests.append(key[len(MANIFEST_PREFIX):])
                continue
            name = f"{local.tenant}/{local.session_id}"
            same = _same(local, await _there(meta, key))
            if same is False:
                report.conflicts.append(name)
            else:
                plan.append((key, local, name, same))
        if plan:  # before their chunks: a node that meets a layout id loads it from here
            await layouts.share_registered()
        for key, local, name, same in plan:
            found = await asyncio.gather(*(bounded(local, i)
                                           for i in range(len(local.chunk_keys))))
            if not all(found):
                report.incomplete.append(name)
                continue
            if same:
                report.already += 1
                continue
            shared = local.evolve(window_tier=None, window_key=None, node_id=config.node_name,
                                  remote_window=None)
            try:
                await meta.commit({key: shared.encode()})
                report.migrated += 1
            except StaleGeneration:  # written meanwhile by a serving node
                if _same(local, await _there(meta, key)):
                    report.already += 1
                else:
                    report.conflicts.append(name)
    finally:
        await manager.close()
        await meta.close()
    report.seconds = time.monotonic() - started
    return report


def run(args: argparse.Namespace) -> int:
    from services.server.config_load import load_config

    try:
        config = load_config(args.config)
        report = asyncio.run(migrate(config, args.data_dir or config.data_dir))
    except Busy as exc:
        print(f"kvtier migrate: {exc}: stop the single-node server first", file=sys.stderr)
        return 2
    except InvalidRequest as exc:
        print(f"kvtier migrate: refused: {exc}", file=sys.stderr)
        return 2
    except TierUnavailable as exc:
        print(f"kvtier migrate: the bucket cannot be reached: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(f"migrated {report.migrated} of {report.sessions} sessions ({report.already} "
              f"already there) in {report.seconds:.1f} s: {report.chunks_uploaded} chunks "
              f"uploaded ({report.bytes_uploaded} B), {report.chunks_present} already "
              f"there, {report.chunks_replaced} replaced")
        for label, names in (("conflicts (another generation in the bucket, kept)",
                              report.conflicts),
                             ("incomplete (a chunk no local tier holds intact)",
                              report.incomplete),
                             ("corrupt manifests (not migrated)", report.corrupt_manifests)):
            if names:
                print(f"  {label}: {', '.join(names)}")
    return 1 if report.conflicts or report.incomplete or report.corrupt_manifests else 0
