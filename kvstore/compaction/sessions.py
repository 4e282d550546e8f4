"""The session steps of compaction: expire, collect unreferenced chunks, demote idle ones.

Who may change sessions: reference counts and manifests belong to the one TierManager
serving the directory (it keeps counts in memory). The plan is read from the disk
tier's LMDB (safe from any process); the changes go through ``SessionOps``:

- ``ManagerOps``: no server is live and the compaction holds the writer lock, so it
  opens its own TierManager over the disk and object tiers.
- a server is live: ``services.cli.compact_remote.ServerOps`` asks it over gRPC
  (Delete, Evict to "object"); orphan collection is not offered there (a spill in
  flight holds unreferenced chunks only in the server's memory), and is skipped.

Each change re-reads the manifest first and skips a session that moved on (a new
generation, or accessed) since the plan. A demotion is recorded under
``demoted/{tenant}/{session}`` (tier, generation, zstd level, time) after the move;
the chunks themselves are found in the object tier by any later restore, because a
read falls through to every tier.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.compaction.report import CompactionReport, CompactOptions, Progress, demoted_key
from kvstore.format.errors import ChunkCorrupt, DataLoss, SessionNotFound, TierFull, TierUnavailable
from kvstore.session.manager import TierManager
from kvstore.session.manifest import MANIFEST_PREFIX, SessionManifest, manifest_key
from kvstore.tiers.base import REF_PREFIX, MetaStore
from kvstore.tiers.disk.tier import DiskTier

log = logging.getLogger("kvstore.compaction.job")
OBJECT_TIER = "object"


class SessionOps(Protocol):
    description: str
    zstd_level: int | None  # what demoted chunks are compressed with, when known

    async def delete(self, tenant: str, session_id: str) -> int:
        """Delete a session; the number of chunks it freed."""

    async def demote(self, tenant: str, session_id: str) -> None:
        """Move a session's chunks to the object tier."""

    async def collect_orphans(self) -> int | None:
        """Delete chunks nothing references; None when not possible here."""


class ManagerOps:
    """Session changes through a TierManager this process owns (no server is live)."""

    description = "offline"

    def __init__(self, manager: TierManager, zstd_level: int | None) -> None:
        self.manager = manager
        self.zstd_level = zstd_level

    async def delete(self, tenant: str, session_id: str) -> int:
        return (await self.manager.delete(tenant, session_id)).chunks_freed

    async def demote(self, tenant: str, session_id: str) -> None:
        await self.manager.demote(tenant, session_id, OBJECT_TIER)

    async def collect_orphans(self) -> int:
        return (await self.manager.collect_garbage()).orphan_blocks


@dataclass
class SessionPlan:
    expired: list[SessionManifest] = field(default_factory=list)
    demote: list[SessionManifest] = field(default_factory=list)
    freed_chunks: int = 0  # chunks the expiries would leave unreferenced
    orphans: int = 0  # disk entries no committed reference names now


async def load_manifests(meta: MetaStore) -> list[SessionManifest]:
    out = []
    for key, raw in await meta.scan(MANIFEST_PREFIX):
        try:
            out.append(SessionManifest.decode(raw))
        except ChunkCorrupt as exc:
            log.error("skipping corrupt manifest %s: %s", key, exc)
    return out


def _idle(manifest: SessionManifest, now: float) -> float:
    return now - manifest.last_access


def expired(manifest: SessionManifest, options: CompactOptions, now: float) -> bool:
    return manifest.expired(now) or (options.ttl_s is not None
                                     and _idle(manifest, now) > options.ttl_s)


async def plan_sessions(disk: DiskTier, manifests: list[SessionManifest],
                        options: CompactOptions, now: float) -> SessionPlan:
    plan = SessionPlan()
    committed = {key[len(REF_PREFIX):]: int(value)
                 for key, value in await disk.meta.scan(REF_PREFIX)}
    refs = dict(committed)
    for manifest in manifests:
        if expired(manifest, options, now):
            plan.expired.append(manifest)
            for key in manifest.chunk_keys:
                refs[key] = refs.get(key, 0) - 1
                plan.freed_chunks += refs[key] == 0
        elif (options.demote_after_s is not None
              and _idle(manifest, now) > options.demote_after_s
              and any(disk.index.lookup(key.encode()) for key in manifest.chunk_keys)):
            plan.demote.append(manifest)
    start = None
    while batch := disk.index.entries_after(start, 4096):
        plan.orphans += sum(1 for key, _ in batch if committed.get(key.decode(), 0) <= 0)
        start = batch[-1][0]
    return plan


async def _unchanged(meta: MetaStore, manifest: SessionManifest) -> bool:
    """The session is still the one planned for (same generation, not accessed since)."""
    raw = await meta.get(manifest_key(manifest.tenant, manifest.session_id))
    if raw is None:
        return False
    try:
        now = SessionManifest.decode(raw)
    except ChunkCorrupt:
        return False
    return (now.generation, now.last_access) == (manifest.generation, manifest.last_access)


async def apply_sessions(plan: SessionPlan, ops: SessionOps, meta: MetaStore,
                         report: CompactionReport, progress: Progress) -> None:
    step = progress.step("expire sessions", len(plan.expired))
    try:
        for manifest in plan.expired:
            step.advance()
            name = f"{manifest.tenant}/{manifest.session_id}"
            if not await _unchanged(meta, manifest):
                continue
            try:
                report.chunks_collected += await ops.delete(manifest.tenant,
                                                            manifest.session_id)
            except SessionNotFound:
                continue
            except (TierFull, TierUnavailable, DataLoss) as exc:
                _failed(report, f"expiry of {name}", exc)
                continue
            report.sessions_expired += 1
            report.expired.append(name)
    finally:
        step.close()
    orphans = await ops.collect_orphans()
    if orphans is None:
        report.skipped.append(f"unreferenced-chunk collection: {ops.description} owns the "
                              "reference counts (sessions it deletes free their chunks)")
    else:
        report.chunks_collected += orphans
    step = progress.step("demote idle sessions", len(plan.demote))
    try:
        for manifest in plan.demote:
            step.advance()
            if not await _unchanged(meta, manifest):
                continue
            try:
                await ops.demote(manifest.tenant, manifest.session_id)
            except SessionNotFound:
                continue
            except (TierFull, TierUnavailable, DataLoss) as exc:
                _failed(report, f"demotion of {manifest.tenant}/{manifest.session_id}", exc)
                continue
            await meta.commit({demoted_key(manifest.tenant, manifest.session_id): json.dumps({
                "tier": OBJECT_TIER, "generation": manifest.generation,
                "zstd_level": ops.zstd_level, "by": ops.description, "at": time.time(),
            }).encode()})
            report.sessions_demoted += 1
            report.demoted.append(f"{manifest.tenant}/{manifest.session_id}")
    finally:
        step.close()


def _failed(report: CompactionReport, what: str, exc: Exception) -> None:
    """One session's change failed (a full or unreachable tier): report it, go on."""
    log.error("%s failed: %s", what, exc)
    report.skipped.append(f"{what} failed: {type(exc).__name__}: {exc}")
