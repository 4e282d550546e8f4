"""``batch_exists_v2``'s answer from which pages exist: the longest usable prefix under
every pool's hit policy, by the rules of SGLang's own ``HiCacheFile.batch_exists_v2``
(and, for ``BLOCK_GROUPS``, which it does not take, by the policy's own definition)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)


def pool_hits(kv_pages: int, transfers: Sequence[PoolTransfer],
              has: Callable[[str, int], bool]) -> PoolTransferResult:
    """``kv_pages``: the KV pages present from the first; ``has(pool, i)``: whether
    ``pool``'s page for KV key ``i`` exists (``BLOCK_GROUPS``: its own key ``i``)."""
    hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for transfer in transfers:
        if not restorable:
            break
        name = transfer.name
        if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
            boundary = next((i for i in range(kv_pages) if not has(name, i)), kv_pages)
            pool_restorable = set(range(1, boundary + 1))
        elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            trailing = max(1, len(transfer.keys) if transfer.keys else 1)
            pool_restorable = {
                prefix for prefix in range(1, kv_pages + 1)
                if all(has(name, i) for i in range(max(0, prefix - trailing), prefix))}
            boundary = max(pool_restorable, default=0)
        elif transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
            # The pool's own verdict, whole groups from the span start; it never gates
            # the KV hit.
            boundary = block_group_pages(transfer, functools.partial(has, name))
            if boundary:
                hit_count[name] = boundary
            continue
        else:
            raise ValueError(f"unsupported pool hit policy {transfer.hit_policy}")
        if boundary:
            hit_count[name] = boundary
        restorable = [p for p in restorable if p in pool_restorable]
    return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)


def block_group_pages(transfer: PoolTransfer, has: Callable[[int], bool]) -> int:
    """The FULL pages the leading complete groups of ``transfer.keys`` cover: a group is
    ``group_pages`` keys, all present, and covers ``block_pages`` pages."""
    keys = transfer.keys or []
    if transfer.group_pages <= 0 or transfer.block_pages <= 0:
        raise ValueError(f"pool {transfer.name}: BLOCK_GROUPS needs block_pages and "
                         f"group_pages > 0, got {transfer.block_pages}, {transfer.group_pages}")
    groups = 0
    for start in range(0, len(keys) - transfer.group_pages + 1, transfer.group_pages):
        if not all(has(i) for i in range(start, start + transfer.group_pages)):
            break
        groups += 1
    pages: int = groups * transfer.block_pages
    return pages
