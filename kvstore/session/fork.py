"""Fork: a new session sharing another session's chunks up to a chunk boundary.

Copy on write through dedupe: the new manifest names the source's very blocks and takes
a reference on each, so either session may later spill past the fork point (its new
chunks are its own) without touching the other. Only a fork at the source's whole
length carries the tail, and the window when the source's covers that point (with how it
was made: a partial one stays partial, so the fork's Resume may rebuild it); any other
fork has no window, so its Resume rebuilds one at the fork point by bounded replay.

A fork is admitted like a spill: it reserves its session, bytes and memory with
``QuotaGate.reserve`` before it stores anything and holds them until its manifest is
committed.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack, suppress

from kvstore.format.checks import window_check
from kvstore.format.errors import DataLoss, InvalidRequest, PreconditionFailed, QuotaExceeded
from kvstore.format.registry import get_layout
from kvstore.placement.stack import WINDOW_PREFIX
from kvstore.session.context import StoreContext
from kvstore.session.manifest import SessionManifest, check_name
from kvstore.session.quota import Reservation, TenantUsage, demote_own, memory_floor

FORK_GENERATION = 1


class Forker:
    def __init__(self, store: StoreContext) -> None:
        self._store = store

    async def fork(self, tenant: str, source_id: str, new_id: str, upto_tokens: int
                   ) -> SessionManifest:
        """See ``TierManager.fork``."""
        check_name("tenant", tenant)
        check_name("session_id", source_id)
        check_name("session_id", new_id)
        if source_id == new_id:
            raise InvalidRequest(f"a fork needs a new session id, not the source's {source_id!r}")
        if not isinstance(upto_tokens, int) or isinstance(upto_tokens, bool) or upto_tokens < 0:
            raise InvalidRequest(f"upto_tokens must be an int >= 0, got {upto_tokens!r}")
        async with AsyncExitStack() as held:
            # the two session locks in one order (by id), so crossing forks never deadlock
            for session_id in sorted((source_id, new_id)):
                catalog = self._store.catalog
                lock = catalog.read if session_id == source_id else catalog.write
                await held.enter_async_context(lock(tenant, session_id))
            source = await self._store.catalog.load_required(tenant, source_id)
            if upto_tokens > source.num_tokens:
                raise PreconditionFailed(f"{tenant}/{source_id} holds {source.num_tokens} "
                                         f"tokens; cannot fork at {upto_tokens}")
            if await self._store.catalog.load(tenant, new_id) is not None:
                raise PreconditionFailed(f"{tenant}/{new_id} already exists: a fork creates "
                                         "a new session")
            return await self._fork(source, new_id, upto_tokens)

    async def _fork(self, source: SessionManifest, new_id: str, upto: int) -> SessionManifest:
        spec = get_layout(source.layout_id)
        whole = upto == source.num_tokens
        count = len(source.chunk_keys) if whole else upto // spec.chunk_tokens
        keys, sizes = source.chunk_keys[:count], source.chunk_sizes[:count]
        tail = source.tail if whole else b""
        tokens = source.token_ids[: upto if whole else count * spec.chunk_tokens]
        reservation, copy_window = await self._admit(source, keys, sizes, tail, whole)
        with reservation:  # until the manifest is committed: concurrent admissions see it
            return await self._commit(source, new_id, tokens, keys, sizes, tail, copy_window)

    async def _admit(self, source: SessionManifest, keys: tuple[str, ...],
                     sizes: tuple[int, ...], tail: bytes, whole: bool
                     ) -> tuple[Reservation, bool]:
        """Reserve the fork's session, bytes and memory: its chunks held in memory count
        for it as for any session of the tenant, and so does the window it copies.
        Returns the reservation and whether the window is copied. Past ``memory_bytes``
        the tenant's own memory-resident data is moved down first (as for a spill); the
        window is left out (the fork's Resume replays it) rather than the fork refused
        when only the window does not fit."""
        tenant, usage = source.tenant, self._store.quotas.ledger

        def need(window: bool) -> TenantUsage:
            held = sum(map(usage.memory_bytes, keys))
            if window:
                held += usage.memory_bytes(source.window_key)
            return TenantUsage(sessions=1, durable_bytes=sum(sizes) + len(tail),
                               memory_bytes=held)

        # sessions and bytes first: nothing is moved for a fork refused anyway
        stored = TenantUsage(sessions=1, durable_bytes=sum(sizes) + len(tail))
        self._store.quotas.check(tenant, stored, what="fork")
        window = whole and bool(usage.memory_bytes(source.window_key))
        room = self._store.quotas.room(tenant, "memory_bytes")
        below = memory_floor(self._store.stack)
        if room is not None and need(window).memory_bytes > room and below is not None:
            await demote_own(usage, self._store.stack, self._store.locks, tenant,
                             need(window).memory_bytes - room, below)
            window = window and bool(usage.memory_bytes(source.window_key))
        if window:
            with suppress(QuotaExceeded):
                return self._store.quotas.reserve(tenant, need(True), count=False,
                                            what="fork"), True
        return self._store.quotas.reserve(tenant, need(False), what="fork"), False

    async def _commit(self, source: SessionManifest, new_id: str, tokens, keys, sizes,
                      tail: bytes, copy_window: bool) -> SessionManifest:
        window_key = window_tier = None
        if copy_window:
            window_key = f"{WINDOW_PREFIX}{source.tenant}/{new_id}/{FORK_GENERATION}"
            window_tier = await self._copy_window(source, window_key)
            window_key = window_key if window_tier is not None else None
        now = time.time()
        manifest = SessionManifest(
            tenant=source.tenant, session_id=new_id, layout_id=source.layout_id,
            generation=FORK_GENERATION, token_ids=tokens, chunk_keys=keys, chunk_sizes=sizes,
            tail=tail, window_tier=window_tier, window_key=window_key,
            window_replayed=source.window_replayed, created_at=now,
            updated_at=now, last_access=now, ttl_s=source.ttl_s, hint=source.hint,
            model_fingerprint=source.model_fingerprint, dedupe_scope=source.dedupe_scope)
        try:
            await self._store.catalog.put(manifest, acquire=keys, new=True)
        except BaseException:
            if window_key is not None:
                await self._store.blocks.drop(window_key)
            raise
        return manifest

    async def _copy_window(self, source: SessionManifest, key: str) -> str | None:
        """Copy ``source``'s window blob (checked as a window of its tokens: window K/V
        and pending rows back to back) to the fork's own key; the tier it landed in, or
        None when it is gone or no window tier has room (the fork's Resume then replays)."""
        check = window_check(get_layout(source.layout_id), source.token_ids)
        assert source.window_key is not None  # the caller forks a window it holds
        async with self._store.locks.hold(source.window_key):
            try:
                data, _, _ = await self._store.stack.read(source.window_key, check, access=False)
            except DataLoss:
                return None
        async with self._store.locks.hold(key):
            await self._store.stack.delete_everywhere(key)  # a leftover must not stand in for it
            placed = await self._store.stack.place(key, data)
        return None if placed is None else self._store.stack.tiers[placed].name
