"""Backups of a fleet's bucket prefix: ``kvtier backup --bucket`` and ``kvtier
restore-backup --bucket``.

A backup copies every object under ``s3://BUCKET/PREFIX`` (chunks, the fleet's manifests
under ``fleet/manifest/``, its layouts and garbage-collection state; not the nodes'
heartbeats under ``fleet/nodes/``, which describe processes, not data) into ``BACKUP/bucket/``
with ``backup.json`` (``kind: "bucket"``; each file's ``key`` relative to the prefix). The
manifests are copied first: a chunk a copied manifest names was uploaded before it (a
spill's order), so it is in the later listing unless a sweep collected it meanwhile,
which a restore reports.

A restore uploads the chunks and other objects to an empty prefix (``--force``: a
non-empty one, written over; objects it held are never removed), verifies every chunk
there (the scrub, opened with the keyring when sealed) and every chunk each manifest
names, and uploads the manifests
last, only when all verified: a failed restore removes what it uploaded, and a prefix
without manifests holds no session.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from urllib.parse import quote, urlsplit

from kvstore.format.errors import InvalidRequest

_MANIFESTS = "fleet/manifest/"
_HEARTBEATS = "fleet/nodes/"  # kvstore.fleet.liveness: a restored fleet's nodes are its own
_SUFFIX = ".kvsm"
_CHUNK_SUFFIXES = (".bin", ".zst")


def location(url: str) -> tuple[str, str]:
    """(bucket, prefix ending in "/" or empty) of ``s3://bucket/prefix``."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise InvalidRequest(f"--bucket takes s3://BUCKET/PREFIX, got {url!r}")
    prefix = parts.path.lstrip("/")
    return parts.netloc, prefix + ("/" if prefix and not prefix.endswith("/") else "")


def client(endpoint: str | None, region: str | None):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint or None, region_name=region or None)


def _keys(s3, bucket: str, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [item["Key"] for page in pages for item in page.get("Contents", ())]


def _local(key: str) -> str:
    """The backup path of an object key (each part quoted: any key is a safe name)."""
    return "bucket/" + "/".join(quote(part, safe="") or "%2F" for part in key.split("/"))


def _chunk_name(key: str) -> str | None:
    """The object tier's key of a chunk object's key (relative to the prefix), else None."""
    if key.startswith("fleet/") or not key.endswith(_CHUNK_SUFFIXES):
        return None
    return key[:-4]


def back_up_bucket(s3, url: str, backup: Path) -> tuple[list[Path], dict[str, str], dict]:
    """Copy the prefix into ``backup``: (files, path -> key, census)."""
    from kvstore.tiers.disk.snapshot import keys_digest
    from services.cli import backup_census

    bucket, prefix = location(url)
    files, keys, manifests = [], {}, []
    for listing in (prefix + _MANIFESTS, prefix):  # the manifests first
        for name in _keys(s3, bucket, listing):
            key = name[len(prefix):]
            if _local(key) in keys or key.startswith(_HEARTBEATS):
                continue
            try:
                body = s3.get_object(Bucket=bucket, Key=name)["Body"].read()
            except s3.exceptions.NoSuchKey:
                continue  # deleted since the listing
            path = backup / _local(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(body)
            files.append(path)
            keys[_local(key)] = key
            if _is_manifest(key):  # the census states the bytes just copied
                manifests.append((_manifest_name(key), body))
    chunks = [name.encode() for name in map(_chunk_name, keys.values()) if name]
    return files, keys, backup_census.take(manifests, len(chunks), keys_digest(chunks))


def _is_manifest(key: str) -> bool:
    return key.startswith(_MANIFESTS) and key.endswith(_SUFFIX)


def restore_bucket(s3, backup: Path, files: list[dict], census: dict | None, url: str,
                   keyring, force: bool, endpoint: str | None, region: str | None):
    """Check the files against ``census`` (the backup's; None in a version 1 backup),
    upload, verify, then upload the manifests; the verification and the seconds."""
    from kvstore.tiers.disk.snapshot import keys_digest
    from services.cli import backup_census
    from services.cli.backup_report import Lost, Verified

    started = time.monotonic()
    bucket, prefix = location(url)
    existing = set(_keys(s3, bucket, prefix))
    if existing and not force:
        raise InvalidRequest(f"{url} is not empty (--force writes over it)")
    # the manifest objects' bytes, read once: checked, verified, then uploaded last
    manifests = {f["key"]: (backup / f["path"]).read_bytes() for f in files
                 if f["key"].startswith(_MANIFESTS)}
    others = [f for f in files if not f["key"].startswith(_MANIFESTS)]
    if census is not None:
        stored = {_manifest_name(key): body for key, body in manifests.items()
                  if _is_manifest(key)}
        chunks = [name.encode() for name in (_chunk_name(f["key"]) for f in files) if name]
        missing, differing = backup_census.compare(census, stored, len(chunks),
                                                   keys_digest(chunks))
        if missing or differing:
            raise Lost(Verified(corrupt=differing, missing=missing))
    _require_key(backup, files, keyring)
    uploaded = []
    try:
        for entry in others:
            s3.put_object(Bucket=bucket, Key=prefix + entry["key"],
                          Body=(backup / entry["path"]).read_bytes())
            if prefix + entry["key"] not in existing:  # a failure removes only new ones
                uploaded.append(prefix + entry["key"])
        result = asyncio.run(_verify(manifests, url, keyring, endpoint, region))
        if result.corrupt or result.missing:
            raise Lost(result)
        for key, body in manifests.items():
            s3.put_object(Bucket=bucket, Key=prefix + key, Body=body)
    except BaseException:
        for name in uploaded:  # chunks no manifest names: nothing that passes for data
            s3.delete_object(Bucket=bucket, Key=name)
        raise
    return result, time.monotonic() - started


def _manifest_name(key: str) -> str:
    return "manifest/" + key[len(_MANIFESTS):-len(_SUFFIX)]


def _require_key(backup: Path, files: list[dict], keyring) -> None:
    """Refuse (``InvalidRequest``) unless ``keyring`` opens the sealed values."""
    from kvstore.encryption.census import Census

    census = Census(f"the backup {backup}")
    for entry in files:
        key = entry["key"]
        if key.startswith(_MANIFESTS) and key.endswith(_SUFFIX):
            census.note(_manifest_name(key), (backup / entry["path"]).read_bytes())
        elif name := _chunk_name(key):
            census.note(name, (backup / entry["path"]).read_bytes())
    census.require(keyring)


async def _verify(manifests: dict[str, bytes], url: str, keyring, endpoint: str | None,
                  region: str | None):
    """The uploaded chunks scrubbed, and each of ``manifests`` (object key -> bytes)
    decoded with every chunk it names held."""
    from kvstore.compaction.report import LogProgress
    from kvstore.compaction.scrub import scrub_tier
    from kvstore.encryption.tiers import opened_record
    from kvstore.session.manifest import SessionManifest
    from kvstore.tiers.object import ObjectTier, ObjectTierConfig
    from services.cli.backup_report import Verified

    out = Verified()
    objects = ObjectTier(url, 1 << 62, ObjectTierConfig(
        compression_level=None, endpoint_url=endpoint or None, region_name=region or None))
    try:
        corrupt = await scrub_tier(objects, None, LogProgress(), keyring)
        held = {key async for key in objects.keys()}
    finally:
        await objects.close()
    out.corrupt = [f"{c.key} ({c.tier}): {c.reason}" for c in corrupt]
    out.chunks_verified = len(held) - len(corrupt)
    for object_key, raw in manifests.items():
        if not object_key.endswith(_SUFFIX):
            continue
        name = _manifest_name(object_key)
        try:
            manifest = SessionManifest.decode(opened_record(name, raw, keyring))
        except Exception as exc:  # noqa: BLE001 - any failure to decode is damage
            out.corrupt.append(f"{name} (manifest): {exc}")
            continue
        out.sessions += 1
        session = f"{manifest.tenant}/{manifest.session_id}"
        out.missing += [f"{session}: {key}" for key in manifest.chunk_keys if key not in held]
    return out
