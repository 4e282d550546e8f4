"""``kvtier fleet-gc``: one sweep of a fleet's bucket (``kvstore.fleet.gc.collect``).

    kvtier fleet-gc --config C [--dry-run] [--json] [--grace-s S] [--retain-s S]
                    [--spill-bound-s S] [--margin-s S] [--metrics-file F]

``C`` is a fleet node's config (``metadata = "shared"``, ``s3_bucket``...; ``KVTIER_*``
variables apply as for ``kvtier serve``), with the fleet's key when it encrypts at rest
(``encryption_key_file`` or ``KVTIER_ENCRYPTION_KEY``): the sweep opens the sealed
manifests with it. Manifests sampled before the sweep (``kvstore.encryption.census``) that
the key does not open, or sealed ones without a key, refuse it up front; one met during
the sweep that does not decode stops every deletion. Safe beside serving nodes: chunks
no manifest names are deleted once past ``fleet_gc_grace_s`` and ``fleet_retain_s``
(docs/fleet.md "Garbage collection"); ``--dry-run`` counts them and writes nothing. The sweep waits
``spill bound + margin`` between marking and deleting, so it takes that long at least.

A sweep runs in this process, not in a server, so no server's scrape counts it: ``--json``
carries the run's figures with its ``result`` (ok, or error when a corrupt manifest stopped
it), and ``--metrics-file`` adds the run to a Prometheus text file
(``kvtier_fleet_gc_runs_total{result}``, ``kvtier_fleet_gc_deleted_total``, counted across
runs: for node_exporter's textfile collector). A dry run, or one refused because another
sweep runs, is not counted; a bucket that cannot be reached counts as an error.

Each step prints one progress line on stderr as it starts (listing, manifests read, the
mark wait, deleting), so a long sweep is seen working and ``--json`` stays one object on
stdout.

Exit status: 0 swept, 2 the config is refused (not shared, no bucket, a key that does
not open the bucket's manifests), 3 another sweep is running, 4 the bucket cannot be
reached.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time

from kvstore.format.errors import Busy, InvalidRequest, TierUnavailable
from kvstore.remote.observe import Observer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a fleet node's TOML config (as kvtier serve --config)")
    parser.add_argument("--dry-run", action="store_true",
                        help="count what would be collected; write and delete nothing")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--grace-s", type=float, help="override fleet_gc_grace_s")
    parser.add_argument("--retain-s", type=float, help="override fleet_retain_s")
    parser.add_argument("--spill-bound-s", type=float,
                        help="the spill bound this sweep publishes (default 20)")
    parser.add_argument("--margin-s", type=float,
                        help="a manifest PUT's time in flight, added to the mark wait (45)")
    parser.add_argument("--metrics-file", help="add this run to the Prometheus text file "
                        "(node_exporter textfile collector): kvtier_fleet_gc_runs_total, "
                        "kvtier_fleet_gc_deleted_total")


def open_bucket(config, keyring=None):
    """The fleet's ``SharedMetaStore`` over ``config``'s bucket, without a node's tiers
    (``InvalidRequest`` unless the config describes a shared fleet); with ``keyring`` its
    manifests are opened and sealed as the fleet's nodes do (``RecordSealer``)."""
    from kvstore.fleet.shared_meta import SharedMetaStore
    from kvstore.tiers.base import MemoryMetaStore
    from kvstore.tiers.object import ObjectTier, ObjectTierConfig
    from services.server.store import check_bucket

    if config.metadata != "shared" or not config.s3_bucket:
        raise InvalidRequest("the config is not a fleet's: set metadata = 'shared' and "
                             "s3_bucket (a local store's chunks are its own)")
    check_bucket(config)
    level = config.object_compression_level if keyring is None else -1
    objects = ObjectTier(config.object_url, config.object_bytes, ObjectTierConfig(
        compression_level=None if level < 0 else level, endpoint_url=config.s3_endpoint or None,
        region_name=config.s3_region or None, shared=True))
    if keyring is None:
        return SharedMetaStore(objects, MemoryMetaStore(), config.node_name)
    from kvstore.encryption.tiers import RecordSealer

    return SharedMetaStore(objects, MemoryMetaStore(), config.node_name,
                           sealer=RecordSealer(keyring))


async def check_bucket_keys(config, keyring) -> None:
    """Refuse (``InvalidRequest``) a bucket whose manifests ``keyring`` does not open:
    sealed ones without it or under other keys, or ones in clear with it."""
    from kvstore.encryption.census import Census

    census = Census(f"the bucket {config.s3_bucket!r}")
    raw = open_bucket(config)  # manifests as stored
    try:
        for key, record in await raw.listed_manifests():
            census.note(key, record)
    finally:
        await raw.close()
    census.require(keyring)


def timing_of(config, args: argparse.Namespace):
    from kvstore.fleet.gc import GC_PRESETS

    changes = {"grace_s": config.fleet_gc_grace_s, "retain_s": config.fleet_retain_s}
    for flag, name in (("grace_s", "grace_s"), ("retain_s", "retain_s"),
                       ("spill_bound_s", "spill_bound_s"), ("margin_s", "request_margin_s")):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    return dataclasses.replace(GC_PRESETS["default"], **changes)


class _Run(Observer):
    """The sweep's outcome as ``collect`` reports it (``kvstore.remote.observe``)."""

    def __init__(self) -> None:
        self.result, self.deleted = "", 0

    def gc_run(self, result: str, deleted: int) -> None:
        self.result, self.deleted = result, deleted


def record_run(path: str, result: str, deleted: int) -> None:
    """Add one run to the counters in the Prometheus text file ``path`` (written whole,
    by rename: a collector never reads half a file)."""
    from prometheus_client import CollectorRegistry, Counter, write_to_textfile
    from prometheus_client.parser import text_string_to_metric_families

    before: dict[tuple[str, str], float] = {}
    try:
        with open(path) as file:
            for family in text_string_to_metric_families(file.read()):
                for sample in family.samples:
                    before[(sample.name, sample.labels.get("result", ""))] = sample.value
    except FileNotFoundError:
        pass
    registry = CollectorRegistry()
    runs = Counter("kvtier_fleet_gc_runs", "Fleet garbage-collection sweeps by result",
                   ["result"], registry=registry)
    gone = Counter("kvtier_fleet_gc_deleted", "Chunks the sweeps deleted from the shared "
                   "bucket", registry=registry)
    for name in ("ok", "error"):
        runs.labels(name).inc(before.get(("kvtier_fleet_gc_runs_total", name), 0)
                              + (name == result))
    gone.inc(before.get(("kvtier_fleet_gc_deleted_total", ""), 0) + deleted)
    write_to_textfile(path, registry)


def run(args: argparse.Namespace) -> int:
    code, outcome = _sweep(args)
    if args.metrics_file and outcome.result:
        record_run(args.metrics_file, outcome.result, outcome.deleted)
    return code


def _sweep(args: argparse.Namespace) -> tuple[int, _Run]:
    from kvstore.encryption.seal import load_keyring
    from kvstore.fleet.gc import collect
    from services.server.config_load import load_config

    outcome = _Run()
    try:
        config = load_config(args.config)
        timing = timing_of(config, args)
        keyring = load_keyring(config.encryption_key_file, config.encryption_key)
        asyncio.run(check_bucket_keys(config, keyring))
        meta = open_bucket(config, keyring)
    except InvalidRequest as exc:
        print(f"kvtier fleet-gc: refused: {exc}", file=sys.stderr)
        return 2, outcome
    except TierUnavailable as exc:
        print(f"kvtier fleet-gc: the bucket cannot be reached: {exc}", file=sys.stderr)
        outcome.result = "" if args.dry_run else "error"
        return 4, outcome
    meta.observer = outcome
    started = time.monotonic()

    def progress(step: str) -> None:
        print(f"kvtier fleet-gc: [{time.monotonic() - started:6.1f} s] {step}",
              file=sys.stderr, flush=True)

    try:
        report = asyncio.run(collect(meta, timing, dry_run=args.dry_run, progress=progress))
    except Busy as exc:
        print(f"kvtier fleet-gc: {exc}", file=sys.stderr)
        return 3, outcome
    except TierUnavailable as exc:
        print(f"kvtier fleet-gc: the bucket cannot be reached: {exc}", file=sys.stderr)
        return 4, outcome
    if args.json:
        print(json.dumps({**report.to_dict(), "result": outcome.result or "ok"}))
        return 0, outcome
    verb = "would mark" if report.dry_run else "deleted"
    count = report.candidates if report.dry_run else report.deleted
    print(f"fleet gc{' (dry run)' if report.dry_run else ''}: {report.listed} chunks, "
          f"{report.live} named by {report.manifests} manifests; {verb} {count} "
          f"({report.bytes_freed} B freed) in {report.seconds:.1f} s")
    print(f"  kept: {report.kept_young} younger than grace, {report.kept_retained} retained, "
          f"{report.claimed} claimed by spills, {report.named_again} named again")
    if report.corrupt_manifests:
        print(f"  {report.corrupt_manifests} corrupt manifests: nothing deleted")
    return 0, outcome
