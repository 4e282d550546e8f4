"""The offline compaction job over one data directory (``kvtier compact`` runs it).

Steps, in order, each crash-safe on its own (a killed run is simply run again):

1. sessions (``kvstore.compaction.sessions``): expire sessions past their TTL or idle
   past ``ttl_s``, collect chunks no manifest references, demote sessions idle past
   ``demote_after_s`` to the object tier and record where they went.
2. scrub (``kvstore.compaction.scrub``): verify every chunk, quarantine the corrupt ones,
   mark the sessions that name them.
3. rewrite (``kvstore.compaction.rewrite_runs``): rewrite the sealed segments at or above
   ``dead_fraction`` dead by the disk tier's protocol (``kvstore.tiers.disk.rewrite``).

The caller holds ``compact.lock`` for the whole run. With no server live it also holds
``writer.lock`` through steps 1-2, seals the dead writer's last segment so it can be
rewritten too, and changes sessions through its own TierManager. With a server live the
job never appends nor touches reference counts: session changes go through the server
(``SessionOps`` over gRPC), the scrub removes a disk entry only by compare and delete,
and rewrites rely on the disk tier's cross-process protocol.

An encrypted directory is compacted with the server's keyring, which the caller has
checked opens what the directory holds (``kvstore.encryption.census``): manifests are
read through ``EncryptedMetaStore``, the scrub opens every value, and rewrites copy
records as stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvstore.compaction.report import CompactionReport, CompactOptions, Progress
from kvstore.compaction.rewrite_runs import rewrite, write_rates
from kvstore.compaction.scrub import CorruptChunk, Quarantine, mark_sessions, scrub_disk, scrub_tier
from kvstore.compaction.sessions import SessionOps, apply_sessions, load_manifests, plan_sessions
from kvstore.encryption.seal import Keyring
from kvstore.tiers.base import MetaStore, Tier
from kvstore.tiers.disk.reclaim import groups, reclaimable
from kvstore.tiers.disk.tier import DiskTier


async def run_compaction(
    disk: DiskTier,
    options: CompactOptions,
    progress: Progress,
    *,
    mode: str,
    ops: SessionOps | None,
    why_no_ops: str = "",
    object_tier: Tier | None = None,
    quarantine_dir: Path,
    after_sessions: Callable[[], None] | None = None,
    keyring: Keyring | None = None,
) -> CompactionReport:
    """Run every step over ``disk`` (opened attached, ``compact.lock`` held by the caller
    unless ``options.dry_run``). ``ops``: how sessions are changed, None to skip that
    (``why_no_ops`` goes into the report); ``object_tier``: scrubbed too when given (as
    stored, not decrypted); ``after_sessions``: called once the session steps are done (to
    drop the writer lock); ``keyring``: opens an encrypted directory's manifests and values.
    """
    started = time.perf_counter()
    meta = manifest_store(disk, keyring)
    dry = options.dry_run
    report = CompactionReport(mode="dry-run" if dry else mode)
    report.dead_bytes_before = sum(info.dead_bytes for info in disk.segments())

    now = time.time() if options.as_of is None else options.as_of
    plan = await plan_sessions(disk, await load_manifests(meta), options, now)
    if dry:
        report.sessions_expired = len(plan.expired)
        report.expired = [f"{m.tenant}/{m.session_id}" for m in plan.expired]
        report.chunks_collected = plan.freed_chunks + plan.orphans
        report.sessions_demoted = len(plan.demote)
        report.demoted = [f"{m.tenant}/{m.session_id}" for m in plan.demote]
    elif ops is None:
        report.skipped.append(f"expiry, unreferenced-chunk collection and demotion: "
                              f"{why_no_ops}")
    else:
        await apply_sessions(plan, ops, meta, report, progress)

    corrupt: list[CorruptChunk] = []
    if options.scrub:
        quarantine = None if dry else Quarantine(quarantine_dir)
        corrupt += await scrub_disk(disk, quarantine, progress, keyring)
        if object_tier is not None:
            corrupt += await scrub_tier(object_tier, quarantine, progress, keyring)
        elif mode == "live" or dry:
            report.skipped.append("object tier scrub: only offline runs scrub it (the server "
                                  "owns its object tier's accounting)")
    if after_sessions is not None:
        after_sessions()

    chosen = reclaimable(disk.segments(), options.dead_fraction,
                         include_active=dry and mode == "offline")
    if dry:
        report.segments_rewritten = len(chosen)
        report.reclaimed_bytes = sum(info.dead_bytes for info in chosen)
    else:
        totals = await rewrite(disk, groups(chosen, options.group_bytes), progress)
        report.segments_rewritten = totals.segments
        report.rewritten_bytes = totals.written_bytes
        report.reclaimed_bytes = totals.reclaimed_bytes
        seen = {chunk.key for chunk in corrupt}
        corrupt += [CorruptChunk(key, disk.name, "failed its checksum during the rewrite")
                    for key in totals.corrupt_keys if key not in seen]
        report.raw_write_gbps, report.rewrite_gbps = await write_rates(disk, totals)

    report.corrupt_chunks = len(corrupt)
    report.corrupt_keys = [f"{chunk.tier}:{chunk.key}" for chunk in corrupt]
    report.marked_sessions = await mark_sessions(meta, await load_manifests(meta), corrupt,
                                                 dry_run=dry)
    report.live_bytes = sum(info.live_bytes for info in disk.segments())
    report.seconds = time.perf_counter() - started
    return report


def manifest_store(disk: DiskTier, keyring: Keyring | None) -> MetaStore:
    """``disk``'s MetaStore as the server reads it: manifests opened with ``keyring``."""
    if keyring is None:
        return disk.meta
    from kvstore.encryption.tiers import EncryptedMetaStore

    return EncryptedMetaStore(disk.meta, keyring)
