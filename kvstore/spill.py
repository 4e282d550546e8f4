"""The write half of ``TierManager``: spills, chunk and window placement, write-back.

Kept apart from ``kvstore.manager`` (lifecycle, deletes, demotion, listing) and
``kvstore.restore`` (reads) only to keep each module small; the rules are documented on
``TierManager`` and in ``kvstore.placement``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Literal

import numpy as np

from kvstore.errors import DataLoss, InvalidRequest, StaleGeneration, TierFull
from kvstore.keys import token_bytes
from kvstore.layout import get_layout
from kvstore.manifest import SessionManifest, check_name, manifest_key
from kvstore.placement import WINDOW_PREFIX
from kvstore.policy import ResumeHint
from kvstore.tiers.base import Buffer, MemoryMetaStore
from kvstore.validate import check_spill

Ack = Literal["memory", "durable"]
log = logging.getLogger(__name__)


class SpillMixin:
    async def spill(
        self,
        tenant: str,
        session_id: str,
        *,
        layout_id: str,
        generation: int,
        token_ids: Sequence[int] | np.ndarray,
        chunks: Sequence[tuple[str, Buffer]],
        tail: Buffer = b"",
        window: Buffer | None = None,
        ack: Ack = "memory",
        hint: ResumeHint | None = None,
        ttl_s: float | None = None,
    ) -> SessionManifest:
        """Store a session (replacing its older generation) and return its manifest.

        ``chunks``: (key, codec-encoded bytes) of every complete chunk, in order, keys as
        ``kvstore.keys.chain_keys(spec.layout_id, token_ids, spec.chunk_tokens)``;
        ``tail``: the encoded partial last chunk or b""; ``window``: the encoded window
        blob (``ephemeral=True``) or None. Buffers must stay unchanged until this returns.
        """
        check_name("tenant", tenant)
        check_name("session_id", session_id)
        if ack not in ("memory", "durable"):
            raise InvalidRequest(f"ack must be 'memory' or 'durable', got {ack!r}")
        if ack == "durable" and (not self._durable or isinstance(self.meta, MemoryMetaStore)):
            raise InvalidRequest("a durable ack needs a durable tier and a durable MetaStore")
        if not isinstance(generation, int) or generation < 0:
            raise InvalidRequest(f"generation must be an int >= 0, got {generation!r}")
        spec = get_layout(layout_id)
        tokens = np.frombuffer(token_bytes(token_ids), dtype="<u4")
        check_spill(spec, tokens, chunks, tail, window)
        keys = [key for key, _ in chunks]
        async with self._sessions.write((tenant, session_id)):
            old = await self._load(tenant, session_id)
            if old is not None and generation <= old.generation:
                raise StaleGeneration(
                    f"{tenant}/{session_id}: generation {generation} is not newer than the "
                    f"stored {old.generation}"
                )
            self._ledger.pin(keys)
            window_key = None
            try:
                protect = frozenset(keys)
                queued = await self._gather(
                    self._store_chunk(key, data, hint, ack, protect) for key, data in chunks
                )
                window_tier = None
                if window is not None:
                    window_key = f"{WINDOW_PREFIX}{tenant}/{session_id}/{generation}"
                    window_tier = await self._store_window(window_key, window, hint)
                now = time.time()
                manifest = SessionManifest(
                    tenant=tenant, session_id=session_id, layout_id=spec.layout_id,
                    generation=generation, token_ids=tokens, chunk_keys=tuple(keys),
                    chunk_sizes=tuple(len(data) for _, data in chunks), tail=bytes(tail),
                    window_tier=window_tier,
                    window_key=window_key if window_tier is not None else None,
                    created_at=old.created_at if old else now, updated_at=now,
                    last_access=now, ttl_s=ttl_s, hint=hint,
                )
                freed = await self._ledger.commit(
                    {manifest_key(tenant, session_id): manifest.encode()},
                    acquire=keys, release=old.chunk_keys if old else (),
                )
            except BaseException:
                await self._free(self._ledger.unpin(keys))
                if window_key is not None:
                    await self._drop_block(window_key)
                raise
            await self._free(freed + self._ledger.unpin(keys))
            if old is not None and old.window_key is not None:
                await self._drop_block(old.window_key)
        for key in (k for k, wants_writeback in zip(keys, queued, strict=True) if wants_writeback):
            await self._writeback.submit(key)
        self.counters.spills += 1
        return manifest

    async def _store_chunk(self, key: str, data: Buffer, hint: ResumeHint | None, ack: Ack,
                           protect: frozenset[str]) -> bool:
        """Place one chunk (or find it held); True when it still needs write-back."""
        async with self._locks.hold(key):
            self._stack.touch(key, hint)
            holders = await self._stack.confirmed_holder(key)
            if holders:
                self.counters.dedupe_hits += 1
            else:
                placed = await self._stack.place(key, data, protect=protect)
                if placed is None:
                    raise TierFull(f"no tier has room for chunk {key} ({len(data)} B)")
                holders = [placed]
            if any(self.tiers[i].durable for i in holders):
                return False
            if ack == "memory":
                return bool(self._durable)
            for j in self._durable:
                if await self._stack.place(key, data, start=j, stop=j + 1) is not None:
                    return False
            raise TierFull(f"no durable tier took chunk {key} ({len(data)} B)")

    async def _store_window(self, key: str, data: Buffer, hint: ResumeHint | None
                            ) -> str | None:
        async with self._locks.hold(key):
            self._stack.touch(key, hint)
            placed = await self._stack.place(key, data)
        if placed is None:
            self.counters.windows_dropped += 1
            log.warning("no window tier has room for %s (%d B): replay will be needed",
                        key, len(data))
            return None
        return self.tiers[placed].name

    async def _write_back(self, key: str) -> None:
        async with self._locks.hold(key):
            if not self._ledger.count(key):
                return  # freed, or its spill failed, since it was queued
            if any(self.tiers[i].durable for i in self._stack.holders(key)):
                return
            try:
                data, _, _ = await self._stack.read(key, access=False)
            except DataLoss:
                self.counters.writeback_failed += 1
                raise
            for j in self._durable:
                if await self._stack.place(key, data, start=j, stop=j + 1) is not None:
                    self.counters.writeback_done += 1
                    return
            self.counters.writeback_failed += 1
            raise TierFull(f"no durable tier took chunk {key} for write-back")
