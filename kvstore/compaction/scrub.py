"""The scrub step of compaction: verify every stored chunk, quarantine the corrupt ones.

A disk-tier chunk is checked twice: its segment record (xxh3 against the index entry) and
its chunk encoding (``kvstore.format.chunk.verify_chunk``: header, section table, every
section checksum); an object-tier chunk gets the encoding check (and its zstd frame's).
In an encrypted directory every value is opened (authenticated) first with the server's
keyring, which ``kvstore.encryption.census`` has already checked opens what the
directory holds. A corrupt chunk's bytes are copied into the quarantine directory
(written, fsynced, renamed) before its entry or object is removed, so a crash between the
two leaves both and the next scrub finds it again; the disk entry is removed by compare
and delete (a writer that stored the chunk again meanwhile wins). Sessions whose
manifests name a quarantined chunk are marked under ``quarantine/{tenant}/{session}``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from kvstore.compaction.report import Progress, quarantine_key
from kvstore.encryption.seal import Keyring
from kvstore.format.chunk import verify_chunk
from kvstore.format.errors import ChunkNotFound, CodecError
from kvstore.session.manifest import SessionManifest
from kvstore.tiers.base import Buffer, MetaStore, Tier
from kvstore.tiers.disk.quarantine import drop_if_unchanged, raw_record
from kvstore.tiers.disk.reader import SegmentGone
from kvstore.tiers.disk.segments import fsync_directory
from kvstore.tiers.disk.tier import DiskTier


@dataclass(frozen=True)
class CorruptChunk:
    key: str
    tier: str
    reason: str


class Quarantine:
    """Corrupt chunks kept as ``{tier}-{key}.bin`` with a ``.json`` note beside each."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def keep(self, chunk: CorruptChunk, data: bytes) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = f"{chunk.tier}-{quote(chunk.key, safe='')}"
        note = json.dumps({"key": chunk.key, "tier": chunk.tier, "reason": chunk.reason,
                           "bytes": len(data), "at": time.time()}).encode()
        for name, body in ((stem + ".bin", data), (stem + ".json", note)):
            temp = self.directory / f".{uuid.uuid4().hex}.tmp"
            with open(temp, "wb") as file:
                file.write(body)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, self.directory / name)
        fsync_directory(self.directory)
        return self.directory / (stem + ".bin")


def check_value(key: str, value: Buffer, keyring: Keyring | None) -> None:
    """``CodecError`` unless ``value``, stored under ``key``, is an intact chunk (opened
    with ``keyring`` first when given: every value of an encrypted directory is
    encrypted)."""
    if keyring is not None:
        _, value = keyring.open(key, value)
    verify_chunk(value)


async def scrub_disk(tier: DiskTier, quarantine: Quarantine | None, progress: Progress,
                     keyring: Keyring | None = None) -> list[CorruptChunk]:
    """Verify every live disk entry; quarantine (unless ``quarantine`` is None) the bad.
    ``tier``: the disk tier itself, not its encrypting wrapper; ``keyring``: opens its
    values."""
    entries, start = [], None
    while batch := tier.index.entries_after(start, 4096):
        entries += batch
        start = batch[-1][0]
    corrupt: list[CorruptChunk] = []
    step = progress.step("scrub disk", len(entries))
    try:
        for kb, entry in entries:
            step.advance()
            if entry.expired(tier.clock()):
                continue
            key = kb.decode()
            try:
                check_value(key, await tier.read_entry(key, entry), keyring)
                continue
            except SegmentGone:
                continue  # its segment was retired: the entry moved since the listing
            except CodecError as exc:
                chunk = CorruptChunk(key, tier.name, str(exc))
            if quarantine is not None:
                quarantine.keep(chunk, raw_record(tier.files, key, entry))
                if not drop_if_unchanged(tier.index, key, entry):
                    continue  # rewritten meanwhile: the new copy is another scrub's business
            corrupt.append(chunk)
    finally:
        step.close()
    return corrupt


async def scrub_tier(tier: Tier, quarantine: Quarantine | None, progress: Progress,
                     keyring: Keyring | None = None) -> list[CorruptChunk]:
    """Verify every value of a tier through its own API (the object tier, not its
    encrypting wrapper; ``keyring`` opens its values)."""
    keys = [key async for key in tier.keys()]
    corrupt: list[CorruptChunk] = []
    step = progress.step(f"scrub {tier.name}", len(keys))
    try:
        for key in keys:
            step.advance()
            data: Buffer = b""
            try:
                data = await tier.get(key)
                check_value(key, data, keyring)
                continue
            except ChunkNotFound:
                continue
            except CodecError as exc:
                chunk = CorruptChunk(key, tier.name, str(exc))
            if quarantine is not None:
                quarantine.keep(chunk, bytes(data))  # empty when it did not even decode
                await tier.delete(key)
            corrupt.append(chunk)
    finally:
        step.close()
    return corrupt


async def mark_sessions(meta: MetaStore, manifests: list[SessionManifest],
                        corrupt: list[CorruptChunk], *, dry_run: bool) -> list[str]:
    """Mark (unless ``dry_run``) every session naming a corrupt chunk; their names."""
    bad = {chunk.key for chunk in corrupt}
    writes: dict[str, bytes | None] = {}
    names = []
    for manifest in manifests:
        hit = sorted(bad.intersection(manifest.chunk_keys))
        if not hit:
            continue
        names.append(f"{manifest.tenant}/{manifest.session_id}")
        key = quarantine_key(manifest.tenant, manifest.session_id)
        old = await meta.get(key)
        known = json.loads(old)["chunks"] if old else []
        writes[key] = json.dumps({"chunks": sorted(set(known) | set(hit)),
                                  "generation": manifest.generation,
                                  "at": time.time()}).encode()
    if writes and not dry_run:
        await meta.commit(writes)
    return names
