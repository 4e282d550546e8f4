"""``KVTierStorage``: kvtier as an L3 storage backend of SGLang's hierarchical cache,
loaded by SGLang's ``dynamic`` backend (README "SGLang")::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang.storage",
      "class_name": "KVTierStorage", "interface_v1": 1, "model_fingerprint": "...", ...}'

Every page is one prefix chunk in the caller's tenant or dedupe domain
(``kvtier.integrations.sglang.pages``), keyed alone (proto "Independent chunks"): an
SGLang call's pages are one WriteChunks, ReadChunks or Lookup (a few where pages pass
``MAX_CALL_BYTES``), its bytes checked end to end on the way back: the BLAKE2b digest its
writer stated, the chunk's own checksums, its layout and its key's stand-in tokens. A page
missing, corrupt, of another model or of another pool or rank is a miss (False, None, 0):
never wrong bytes, never an exception into SGLang, and never ``None`` from a v1 call.

SGLang's threads never wait past ``timeout_ms``: each call's batches go concurrently on the
kvtier client's own loop and the caller waits for them at most that long; bytes land in
the host pool only in the caller's thread, after that wait, so a call that gave up writes
nothing later. One breaker (``kvtier.integrations.breaker``, the vLLM connector's too):
while the server is down, calls answer misses at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvstore.format.errors import TierUnavailable, UnknownLayout
from kvstore.format.keys import MAX_INDEPENDENT_LOOKUP
from kvstore.format.layout import LayoutSpec
from kvtier.integrations.breaker import Breaker
from kvtier.integrations.sglang.config import StorageSettings
from kvtier.integrations.sglang.hits import pool_hits
from kvtier.integrations.sglang.pages import (
    KV_POOL,
    PageFormat,
    Shard,
    key_tokens,
    names_tokens,
)
from kvtier.sync import Client

logger = logging.getLogger(__name__)
T = TypeVar("T")
Page = tuple[PageFormat, str]  # the pool's pages, the page's storage key
PoolPages = tuple[str, list[str], torch.Tensor | None, Any]  # pool, keys, host indices, host pool
MAX_CALL_BYTES = 64 << 20  # pages read or written by one call at most (calls run at once)


class KVTierStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang: not in the checked venv
    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        """As SGLang's dynamic backend builds it: ``cls(storage_config, kwargs)``."""
        self.settings = StorageSettings.from_extra(storage_config.extra_config or {})
        self.shard = Shard.of(storage_config)
        self.client = Client(self.settings.server, **self.settings.client_options())
        self.breaker = Breaker()
        self.formats: dict[str, PageFormat] = {}  # pool name -> its pages
        self._registered: set[str] = set()  # layout ids the server was told of

    # -- pools --

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.formats[KV_POOL] = PageFormat.of(KV_POOL, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        self.formats[name] = PageFormat.of(name, host_pool)

    def close(self) -> None:
        self.client.close()

    # -- v1: zero copy between the host pool and kvtier --

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._get_pages([(KV_POOL, keys, host_indices, self._kv_host_pool())])[0]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._set_pages([(KV_POOL, keys, host_indices, self._kv_host_pool())])[0]

    def _kv_host_pool(self) -> Any:  # the SGLang host pool registered, or None
        return getattr(self, "mem_pool_host", None)

    # -- the legacy calls: flat pages in and out --

    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str],
                  target_locations: Sequence[torch.Tensor | None] | None = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        fmt = self.formats.get(KV_POOL)
        if fmt is None or target_locations is None or len(target_locations) != len(keys):
            return [None] * len(keys)
        with self._reading([(fmt, key) for key in keys]) as pages:
            return [target if target is not None and data is not None and _fill(target, data)
                    else None
                    for target, data in zip(target_locations, pages, strict=True)]

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Sequence[torch.Tensor | None] | None = None,
                  target_locations: Any = None, target_sizes: Any = None) -> bool:
        fmt = self.formats.get(KV_POOL)
        if fmt is None or values is None or len(values) != len(keys):
            return False
        if not self.shard.writes(KV_POOL):
            return True  # the shard's writer rank stores these pages
        return all(self._write([(fmt, key, None if value is None else value.reshape(-1))
                                for key, value in zip(keys, values, strict=True)]))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        fmt = self.formats.get(KV_POOL)
        if fmt is None:
            return 0
        held = self._exists([(fmt, key) for key in keys])
        return held.index(False) if False in held else len(held)

    # -- v2: several pools, each with its hit policy --

    def batch_exists_v2(self, keys: list[str],
                        pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None
                        ) -> PoolTransferResult:
        transfers = list(pool_transfers or [])
        kv = self.formats.get(KV_POOL)
        if kv is None:
            return PoolTransferResult(0, {}, [])
        asked: list[Page] = [(kv, key) for key in keys]
        # (pool, index) -> position in asked: a pool's page of KV key i, or of its own
        # key i (BLOCK_GROUPS)
        where: dict[tuple[str, int], int] = {}
        for transfer in transfers:
            fmt = self.formats.get(str(transfer.name))
            if fmt is None:
                continue
            own = transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS
            for i, key in enumerate(transfer.keys or [] if own else keys):
                where[(str(transfer.name), i)] = len(asked)
                asked.append((fmt, _pool_key(str(transfer.name), key)))
        held = self._exists(asked)
        kv_pages = held.index(False) if False in held[:len(keys)] else len(keys)

        def has(pool: str, i: int) -> bool:
            at = where.get((str(pool), i))
            return at is not None and held[at]

        try:
            return pool_hits(kv_pages, transfers, has)
        except ValueError as exc:  # a transfer SGLang sent wrong: no hit rather than raise
            logger.warning("kvtier sglang storage: %s", exc)
            return PoolTransferResult(0, {}, [])

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        done = self._get_pages(self._transfers(transfers))
        return {str(t.name): got for t, got in zip(transfers, done, strict=True)}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        done = self._set_pages(self._transfers(transfers))
        return {str(t.name): got for t, got in zip(transfers, done, strict=True)}

    def _transfers(self, transfers: list[PoolTransfer]) -> list[PoolPages]:
        pools = getattr(self, "registered_pools", {})
        return [(str(t.name), t.keys or [], t.host_indices, pools.get(t.name))
                for t in transfers]

    # -- pages of a host pool --

    def _get_pages(self, transfers: list[PoolPages]) -> list[list[bool]]:
        """Every pool's pages read in one go (one call a layout), each loaded into its
        host pool; one bool a key."""
        plans = self._plans(transfers)
        asked: list[Page] = []
        for (pool, keys, _, _), plan in zip(transfers, plans, strict=True):
            if plan is not None:
                asked += [(plan[0], _pool_key(pool, key)) for key in keys]
        with self._reading(asked) as pages:
            loaded = iter(pages)
            out = []
            for (_, keys, _, host_pool), plan in zip(transfers, plans, strict=True):
                if plan is None:
                    out.append([False] * len(keys))
                    continue
                fmt, offsets = plan
                got = [next(loaded) for _ in offsets]
                found = [(offset, data) for offset, data in zip(offsets, got, strict=True)
                         if data is not None]
                flat = fmt.flat_pages([data for _, data in found])
                for (offset, _), page in zip(found, flat, strict=True):
                    host_pool.set_from_flat_data_page(offset, page)
                out.append([data is not None for data in got])
        return out

    def _set_pages(self, transfers: list[PoolPages]) -> list[list[bool]]:
        """Every pool's pages written in one go (one call a layout); one bool a key."""
        plans = self._plans(transfers)
        pages: list[tuple[PageFormat, str, torch.Tensor | None]] = []
        for (pool, keys, _, host_pool), plan in zip(transfers, plans, strict=True):
            if plan is not None and self.shard.writes(pool):
                pages += [(plan[0], _pool_key(pool, key),
                           host_pool.get_data_page(offset, flat=True))
                          for key, offset in zip(keys, plan[1], strict=True)]
        written = iter(self._write(pages))
        out = []
        for (pool, keys, _, _), plan in zip(transfers, plans, strict=True):
            if plan is None:
                out.append([False] * len(keys))
            elif not self.shard.writes(pool):  # the shard's writer rank stores these pages
                out.append([True] * len(keys))
            else:
                out.append([next(written) for _ in keys])
        return out

    def _plans(self, transfers: list[PoolPages]) -> list[tuple[PageFormat, list[int]] | None]:
        """Per transfer, its pool's pages and the host slot each page starts at; None when
        its pool is not registered or its host indices do not fit its keys."""
        plans: list[tuple[PageFormat, list[int]] | None] = []
        for pool, keys, host_indices, host_pool in transfers:
            offsets = _page_offsets(pool, keys, host_indices, host_pool)
            fmt = self.formats.get(pool)
            plans.append(None if offsets is None or fmt is None else (fmt, offsets))
        return plans

    # -- kvtier calls: a batch a call, concurrent on the client's loop, bounded by the
    # deadline --

    @contextmanager
    def _reading(self, pages: list[Page]) -> Iterator[list[memoryview | None]]:
        """Each page's bytes (None: a miss), views of the reply's shared memory where the
        client uses it (no copy before the host pool's), lent until the block ends.
        Checked by the client against each chunk's own checksums (header, section table,
        xxh3 of the payload) and its key's stand-in tokens; the BLAKE2b digest, by the
        server, which sends only bytes of the digest the page was written with."""
        lock = threading.Lock()
        lent: list[Callable[[], None]] = []
        closed = False

        def hold(release: Callable[[], None]) -> bool:
            with lock:
                if not closed:
                    lent.append(release)
                return not closed

        async def read(batch: list[Page]) -> list[memoryview | None]:
            fmt = batch[0][0]
            result = await self.client.async_client.read_independent_chunks(
                self.settings.tenant, await self._layout(fmt), self._tokens(batch),
                model_fingerprint=self.settings.model_fingerprint,
                dedupe_domain=self.settings.dedupe_domain, check_digests=False,
                in_place=True)
            if not hold(result.release):  # the caller gave up waiting meanwhile
                result.release()
                return [None] * len(batch)
            return [None if (chunk := result.chunks.get(i)) is None else f.payload(chunk)
                    for i, (f, _) in enumerate(batch)]

        try:
            yield self._each(pages, MAX_CALL_BYTES, read, None)
        finally:
            with lock:
                closed = True
            for release in lent:
                release()

    def _write(self, pages: list[tuple[PageFormat, str, torch.Tensor | None]]) -> list[bool]:
        # Encoded here, in SGLang's thread: the host pool's bytes are read before it returns.
        chunks: list[tuple[PageFormat, np.ndarray, bytes] | None] = []
        for fmt, key, page in pages:
            tokens = key_tokens(fmt.name(key, self.shard))
            try:
                chunks.append((fmt, tokens, fmt.encode(page, tokens)))
            except (AttributeError, ValueError) as exc:  # no page, or not the pool's size
                logger.warning("kvtier sglang storage: page %s not stored: %s", key, exc)
                chunks.append(None)

        async def write(batch: list[tuple[Any, ...]]) -> list[bool]:
            await self.client.async_client.write_independent_chunks(
                self.settings.tenant, await self._layout(batch[0][0]),
                np.concatenate([tokens for _, tokens, _ in batch]),
                [chunk for _, _, chunk in batch],
                model_fingerprint=self.settings.model_fingerprint,
                dedupe_domain=self.settings.dedupe_domain, ack=self.settings.ack)
            return [True] * len(batch)

        # A page asked twice in one call is written once (a write may not repeat a key).
        names = [None if c is None else (c[0].spec.layout_id, c[1].tobytes()) for c in chunks]
        first: dict[tuple[str, bytes], int] = {}
        for i, name in enumerate(names):
            if name is not None:
                first.setdefault(name, i)
        unique = list(first.values())
        batch: list[tuple[Any, ...]] = [c for c in (chunks[i] for i in unique) if c is not None]
        sent = dict(zip(unique, self._each(batch, MAX_CALL_BYTES, write, False), strict=True))
        return [name is not None and sent[first[name]] for name in names]

    def _exists(self, pages: list[Page]) -> list[bool]:
        async def exists(batch: list[Page]) -> list[bool]:
            return await self.client.async_client.lookup_independent_chunks(
                self.settings.tenant, await self._layout(batch[0][0]), self._tokens(batch),
                model_fingerprint=self.settings.model_fingerprint,
                dedupe_domain=self.settings.dedupe_domain)

        return self._each(pages, None, exists, False)

    def _tokens(self, batch: list[Page]) -> np.ndarray:
        """Every page's stand-in tokens end to end: (pages * KEY_TOKENS,) uint32."""
        suffixes = {fmt.pool: fmt.name_suffix(self.shard) for fmt, _ in batch}  # once a pool
        return names_tokens(key + suffixes[fmt.pool] for fmt, key in batch)

    async def _layout(self, fmt: PageFormat) -> LayoutSpec:
        if fmt.spec.layout_id not in self._registered:
            await self.client.async_client.register_layout(fmt.spec)
            self._registered.add(fmt.spec.layout_id)
        return fmt.spec

    def _each(self, items: Sequence[tuple[Any, ...]], max_bytes: int | None,  # noqa: C901 - batches with one deadline, one breaker and their misses
              call: Callable[[list[tuple[Any, ...]]], Coroutine[Any, Any, list[T]]], miss: T
              ) -> list[T]:
        """``call(batch)`` for the items in batches, all at once on the client's loop: a
        batch is items of one layout (``item[0]``: their PageFormat), of at most
        ``max_bytes`` of pages (None: no bound but the lookup's); ``miss`` for each item of
        a batch that failed, and for all when the deadline passed or the breaker is open."""
        if not items:
            return []
        if not self.breaker.allow():
            return [miss] * len(items)
        outage: list[Exception] = []
        failed: list[Exception] = []

        async def one(batch: list[tuple[Any, ...]]) -> list[T]:
            try:
                return await call(batch)
            except UnknownLayout:  # a restarted server forgot it: told again next call
                self._registered.discard(batch[0][0].spec.layout_id)
            except TierUnavailable as exc:
                outage.append(exc)
            except Exception as exc:  # one batch's failure is its pages' misses
                failed.append(exc)
            return [miss] * len(batch)

        batches = _batches(items, max_bytes)

        async def every() -> list[list[T]]:
            return list(await asyncio.gather(*(one([items[i] for i in batch])
                                               for batch in batches)))

        future = self.client.submit(every())
        try:
            answers = future.result(timeout=self.settings.timeout_s)
        except FutureTimeout:
            future.cancel()
            self.breaker.failed()
            logger.warning("kvtier sglang storage: no answer within %g ms: %d pages missed",
                           self.settings.timeout_ms, len(items))
            return [miss] * len(items)
        if failed:  # once a call, not once a batch
            logger.warning("kvtier sglang storage: %d of %d calls failed: %s", len(failed),
                           len(batches), failed[0])
        if outage:
            self.breaker.failed()
            logger.warning("kvtier sglang storage: server unavailable: %s", outage[0])
        else:
            self.breaker.succeeded()
        results: list[T] = [miss] * len(items)
        for batch, answer in zip(batches, answers, strict=True):
            for i, value in zip(batch, answer, strict=True):
                results[i] = value
        return results


def _batches(items: Sequence[tuple[Any, ...]], max_bytes: int | None) -> list[list[int]]:
    """The items' positions grouped by layout (``item[0].spec``), in order, each group cut
    into runs of at most ``max_bytes`` of pages (one page at least) and at most
    ``MAX_INDEPENDENT_LOOKUP`` pages (what one Lookup may ask about)."""
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(item[0].spec.layout_id, []).append(i)
    out = []
    for positions in groups.values():
        size = MAX_INDEPENDENT_LOOKUP
        if max_bytes is not None:
            size = min(size, max(1, max_bytes // items[positions[0]][0].page_bytes))
        out += [positions[n:n + size] for n in range(0, len(positions), size)]
    return out


def _pool_key(pool: str, key: str) -> str:
    """SGLang's name of a pool's page: the KV key itself, ``"{key}.{pool}"`` for others."""
    return key if pool == PoolName.KV.value else f"{key}.{pool}"


def _page_offsets(pool: str, keys: list[str], host_indices: torch.Tensor | None,
                  host_pool: Any) -> list[int] | None:
    """The host pool slot each page starts at (``host_indices`` holds ``page_size`` slots
    a page); None when the pool is not registered or the indices do not fit the keys."""
    if host_pool is None or host_indices is None:
        return None
    page_size = getattr(host_pool, "page_size", 1) or 1
    if host_indices.numel() != len(keys) * page_size:
        logger.error("kvtier sglang storage: %d host indices for %d %s pages of %d slots",
                     host_indices.numel(), len(keys), pool, page_size)
        return None
    return host_indices[::page_size].tolist()


def _fill(target: torch.Tensor, data: memoryview) -> bool:
    """Copy one page's bytes into ``target`` (any shape, contiguous); False if the sizes
    differ."""
    if target.numel() * target.element_size() != len(data) or not target.is_contiguous():
        return False
    with warnings.catch_warnings():  # read-only bytes: only ever read from
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        source = torch.frombuffer(data, dtype=torch.uint8)
    target.view(-1).view(torch.uint8).copy_(source)
    return True
