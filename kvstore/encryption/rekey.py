"""Re-encryption of what a store holds under retired master keys (``kvtier rekey``).

Every value sealed under a key id other than the keyring's ``current`` is opened and
sealed again under ``current``, for the same domain, layout and storage key (so it reads
exactly as before), then read back and checked: the copy must open under ``current`` to
the same plaintext, else the run fails naming the key.

Each value is rewritten alone, by the medium's own atomic put (a Redis SET, an S3 PUT, a
disk record and its index entry), so a run cut short leaves every value whole under one
key or the other, and a second run finishes what is left: values already under
``current`` are counted and skipped. Manifests in a fleet's bucket are rewritten by
compare-and-swap on the ETag read (``SharedMetaStore``): a manifest a node changed
meanwhile is left to the node (it seals its next generation under ``current`` when it
holds the rotated keyring) and counted, so a rerun picks up what remains.

A key is no longer needed once no value of the places a run covered is sealed under it
(``RekeyReport.retired``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from kvstore.encryption.seal import MAGIC, Keyring, read_header
from kvstore.format.errors import ChunkCorrupt, ChunkNotFound, StaleGeneration
from kvstore.session.manifest import MANIFEST_PREFIX
from kvstore.tiers.base import Buffer, MetaStore, Tier

Hold = Callable[[str], AbstractAsyncContextManager[object]]


def _unheld(key: str) -> AbstractAsyncContextManager[object]:
    return contextlib.nullcontext()


@dataclass
class RekeyReport:
    current: str
    held: list[str]  # the key ids of the keyring used
    places: list[str] = field(default_factory=list)  # what this run covered
    resealed: int = 0
    already_current: int = 0
    in_clear: int = 0  # values never sealed (left as they are)
    changed_meanwhile: int = 0  # rewritten by a server during the run: a rerun checks them
    unreadable: list[str] = field(default_factory=list)  # sealed values that do not open
    remaining: Counter = field(default_factory=Counter)  # key id -> values still under it

    @property
    def sealed_under_old(self) -> int:
        return sum(self.remaining.values())

    @property
    def retired(self) -> list[str]:
        """Key ids that seal nothing in the places covered: they may leave the keyring."""
        return sorted(key_id for key_id in self.held
                      if key_id != self.current and not self.remaining[key_id])

    def note(self, key_id: str) -> None:
        if key_id != self.current:
            self.remaining[key_id] += 1

    def as_dict(self) -> dict:
        return {"current": self.current, "places": self.places, "resealed": self.resealed,
                "already_current": self.already_current, "in_clear": self.in_clear,
                "changed_meanwhile": self.changed_meanwhile,
                "unreadable": len(self.unreadable), "unreadable_keys": self.unreadable[:20],
                "sealed_under_old": self.sealed_under_old,
                "remaining_by_key": dict(sorted(self.remaining.items())),
                "no_longer_needed": self.retired}

    def lines(self) -> list[str]:
        out = [f"rekey to {self.current!r} over {', '.join(self.places) or 'nothing'}: "
               f"{self.resealed} resealed, {self.already_current} already current, "
               f"{self.in_clear} in clear, {self.changed_meanwhile} changed meanwhile"]
        if self.unreadable:
            out.append(f"{len(self.unreadable)} values do not open (corrupt, or under a key "
                       f"this keyring lacks), e.g. {self.unreadable[0]!r}: left as they are; "
                       "kvtier compact's scrub quarantines corrupt ones")
        for key_id, count in sorted(self.remaining.items()):
            if count:
                out.append(f"key {key_id} still seals {count} values: run kvtier rekey again")
        out += [f"key {key_id} is no longer needed: remove it from the keyring"
                for key_id in self.retired]
        return out


def reseal(keyring: Keyring, storage_key: str, sealed: Buffer) -> tuple[bytes, bytes] | None:
    """(the value sealed again under ``current``, its plaintext), or None when ``sealed``
    is already under ``current``; ``ChunkCorrupt`` when it does not open."""
    header = read_header(sealed)
    if header.key_id == keyring.current:
        return None
    header, plaintext = keyring.open(storage_key, sealed)
    return keyring.seal(storage_key, header.domain, plaintext, header.layout_hash), plaintext


def verify(keyring: Keyring, storage_key: str, stored: Buffer, plaintext: bytes) -> None:
    """``ChunkCorrupt`` unless ``stored`` opens under ``current`` to ``plaintext``."""
    header, back = keyring.open(storage_key, stored)
    if header.key_id != keyring.current or back != plaintext:
        raise ChunkCorrupt(f"{storage_key}: the resealed copy read back does not match")


def _resealed(keyring: Keyring, storage_key: str, sealed: Buffer, report: RekeyReport
              ) -> tuple[bytes, bytes] | None:
    """``reseal``, counting a value already current or one that does not open (a corrupt
    copy is the scrub's to quarantine: it must not stop the others' rotation)."""
    try:
        fresh = reseal(keyring, storage_key, sealed)
    except ChunkCorrupt:
        report.unreadable.append(storage_key)
        return None
    if fresh is None:
        report.already_current += 1
    return fresh


def _is_sealed(value: Buffer) -> bool:
    return bytes(memoryview(value).cast("B")[:len(MAGIC)]) == MAGIC


async def rekey_tier(tier: Tier, keyring: Keyring, report: RekeyReport, *,
                     hold: Hold = _unheld) -> None:
    """Reseal every value of ``tier`` (the medium as stored, not an ``EncryptedTier``);
    ``hold(key)``: the lock each value is rewritten under (a serving store's key lock)."""
    async def read(key: str) -> Buffer | None:
        try:
            return await tier.get(key)
        except ChunkNotFound:
            return None  # evicted or deleted since the listing

    async def write(key: str, fresh: tuple[bytes, bytes]) -> bytes | None:
        try:
            ttl_s = await tier.ttl_s(key)  # kept across the rewrite
        except ChunkNotFound:
            return None  # expired since the read: nothing to bring back
        await tier.put(key, fresh[0], ttl_s=ttl_s)
        return fresh[1]

    report.places.append(tier.name)
    await _reseal_each(tier.keys(), read, write, keyring, report, hold)


async def rekey_records(meta: MetaStore, keyring: Keyring, report: RekeyReport, place: str,
                        sealing: MetaStore | None = None, *, hold: Hold = _unheld) -> None:
    """Reseal every manifest of ``meta`` (a MetaStore that does not open them). The new
    record is written to ``meta`` as sealed bytes, or, with ``sealing`` (a fleet's
    ``SharedMetaStore`` over the same bucket with a ``RecordSealer``), as the plaintext
    ``sealing`` read: it seals it under ``current`` and compares and swaps on that read.
    ``hold(key)``: the lock each record is rewritten under (a serving store's session
    lock)."""
    async def manifests() -> AsyncIterator[str]:
        for key, _ in await meta.scan(MANIFEST_PREFIX):
            yield key

    async def write(key: str, fresh: tuple[bytes, bytes]) -> bytes | None:
        try:
            if sealing is None:
                await meta.commit({key: fresh[0]})
                return fresh[1]
            plaintext = await sealing.get(key)  # remembers the ETag it read
            if plaintext is None:
                return None  # deleted since the listing
            await sealing.commit({key: plaintext})
            return plaintext
        except StaleGeneration:
            report.changed_meanwhile += 1
            return None

    report.places.append(place)
    await _reseal_each(manifests(), meta.get, write, keyring, report, hold)


async def _reseal_each(keys: AsyncIterator[str],
                       read: Callable[[str], Awaitable[Buffer | None]],
                       write: Callable[[str, tuple[bytes, bytes]], Awaitable[bytes | None]],
                       keyring: Keyring, report: RekeyReport, hold: Hold) -> None:
    """The one pass over a place: each value ``read`` (None: gone since the listing) and
    sealed under another key is resealed, given to ``write`` (which answers the plaintext
    it stored, or None when it stored nothing), read back and checked, all under
    ``hold(key)``. The sealing runs off the event loop (a server may be serving on it)."""
    async for key in keys:
        async with hold(key):
            stored = await read(key)
            if stored is None:
                continue
            if not _is_sealed(stored):
                report.in_clear += 1
                continue
            fresh = await asyncio.to_thread(_resealed, keyring, key, stored, report)
            if fresh is None:
                continue
            plaintext = await write(key, fresh)
            if plaintext is None:
                continue
            back = await read(key)
            if back is None:
                continue  # evicted or deleted at once: nothing is left under either key
            await asyncio.to_thread(verify, keyring, key, back, plaintext)
            report.resealed += 1


async def census_tier_keys(tier: Tier, report: RekeyReport) -> None:
    """Count ``tier``'s values by the key id that seals them (``report.remaining``)."""
    async for key in tier.keys():
        try:
            value = await tier.get(key)
        except ChunkNotFound:
            continue
        if _is_sealed(value):
            report.note(read_header(value).key_id)


async def census_record_keys(meta: MetaStore, report: RekeyReport) -> None:
    for _, value in await meta.scan(MANIFEST_PREFIX):
        if _is_sealed(value):
            report.note(read_header(value).key_id)
