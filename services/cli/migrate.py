"""``kvtier migrate``: switch an existing single-node data directory to a fleet's shared
metadata, once (docs/fleet.md "Migrating a single node").

    kvtier migrate --config C [--data-dir D] [--json]

``C`` is the node's config as it will serve: ``metadata = "shared"``, ``s3_bucket`` and
the rest; ``D`` (default: ``C``'s ``data_dir``) is the directory its single-node server
used, stopped now. Every session manifest in the directory's disk index is copied to the
bucket with its chunks: each chunk is read from the local disk or object tier, checked
against its key's digest, and uploaded unless the bucket already holds it intact (read
back and checked; a wrong copy is replaced). A manifest is written only after all its
chunks, and only where the bucket has none (If-None-Match): a session already there at
the same generation and content counts as done, any other is a conflict, reported and
never overwritten. Windows are not carried over (resumes replay them). Running it again
does nothing more than finish what an interrupted run left.

Exit status: 0 every session migrated (or already), 1 some are conflicts or have chunks
no local tier holds intact (listed), 2 refused (not a shared config, no disk tier,
encryption at rest, the directory in use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstore.errors import Busy, DataLoss, InvalidRequest, StaleGeneration, TierUnavailable

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
    from kvstore.keys import chunk_digest, split_block_key

    key = manifest.chunk_keys[index]
    if key in done:
        return done[key]
    digest = split_block_key(key)[1]
    held = None
    try:
        held = bytes(await objects.get(key)) if await objects.contains(key) else None
    except DataLoss:
        held = None
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


async def migrate(config, data_dir: Path) -> MigrateReport:
    from kvstore.fleet import prepare_bucket
    from kvstore.manifest import MANIFEST_PREFIX, SessionManifest
    from services.cli.fleet_gc import open_bucket
    from services.server.store import open_manager

    started = time.monotonic()
    if config.encrypts:
        raise InvalidRequest("shared metadata with encryption at rest is not supported yet")
    if not (data_dir / "disk").is_dir():
        raise InvalidRequest(f"no disk tier in {data_dir}: a single node without one keeps "
                             "its manifests in memory only, there is nothing to migrate")
    meta = open_bucket(config)
    source = config.replace(
        data_dir=data_dir, metadata="local", s3_bucket="", s3_endpoint="", s3_region="",
        redis_url="", object_bytes=config.object_bytes if (data_dir / "objects").is_dir()
        else 0)
    manager = await open_manager(source)
    report, done = MigrateReport(), {}
    gate = asyncio.Semaphore(_CONCURRENCY)

    async def bounded(manifest, index: int) -> bool:
        async with gate:
            return await _chunk(manager, meta.tier, manifest, index, done, report)

    try:
        await prepare_bucket(meta)  # the epoch object, if this bucket has none yet
        await meta.gate.baseline()
        for key, value in await manager.meta.scan(MANIFEST_PREFIX):
            report.sessions += 1
            local = SessionManifest.decode(value)
            name = f"{local.tenant}/{local.session_id}"
            found = await asyncio.gather(*(bounded(local, i)
                                           for i in range(len(local.chunk_keys))))
            if not all(found):
                report.incomplete.append(name)
                continue
            shared = local.evolve(window_tier=None, window_key=None, node_id=config.node_name,
                                  remote_window=None)
            try:
                await meta.commit({key: shared.encode()})
                report.migrated += 1
            except StaleGeneration:
                there = await meta.get(key)
                other = SessionManifest.decode(there) if there is not None else None
                if other is not None and (other.generation, other.spill_digest,
                                          other.chunk_keys) == (local.generation,
                                                                local.spill_digest,
                                                                local.chunk_keys):
                    report.already += 1
                else:
                    report.conflicts.append(name)
    finally:
        await manager.close()
        await meta.close()
    report.seconds = time.monotonic() - started
    return report


def run(args: argparse.Namespace) -> int:
    from services.server.config import load_config

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
                              report.incomplete)):
            if names:
                print(f"  {label}: {', '.join(names)}")
    return 1 if report.conflicts or report.incomplete else 0
