"""Prefix reuse: which stored blocks answer a chain key, and chunks kept past their last
reference.

``ChainIndex`` maps each chain key to the block keys (chain key + digest, ``kvstore.keys``)
some tier is believed to hold. It is a ``Residency`` watcher of the ``TierStack``, so it
follows every placement, eviction and delete, and the stack's ``load`` rebuilds it at open
from what the tiers list. A chain key binds its dedupe domain, so a lookup computed in the
caller's domain can only ever find blocks of that domain.

``Retention`` keeps chunks whose last reference went away (a deleted session's system
prompt) as evictable cache entries instead of freeing them: ``keep`` marks them retained
(with the domain they belonged to, for accounting), ``victim`` lets eviction take them
before any referenced block (``TierStack.evict_first``), ``expired`` names those idle
past ``ttl_s``, and a spill naming one by key (or a fork) revives it by taking a
reference again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidRequest
from kvstore.placement import Residency, is_window_key


class ChainIndex:
    """chain key -> {block key: tiers holding it}; told by the ``TierStack``."""

    def __init__(self, inner: Residency | None = None) -> None:
        self._inner = inner  # the watcher this one stands in front of (quota residency)
        self._blocks: dict[str, dict[str, set[int]]] = {}
        self.on_gone: Callable[[str], None] | None = None  # a block left its last tier

    def held(self, j: int, key: str, size: int) -> None:
        if self._inner is not None:
            self._inner.held(j, key, size)
        chain = _chain_of(key)
        if chain is not None:
            self._blocks.setdefault(chain, {}).setdefault(key, set()).add(j)

    def dropped(self, j: int, key: str) -> None:
        if self._inner is not None:
            self._inner.dropped(j, key)
        chain = _chain_of(key)
        versions = self._blocks.get(chain) if chain is not None else None
        tiers = versions.get(key) if versions else None
        if tiers is None:
            return
        tiers.discard(j)
        if not tiers:
            del versions[key]
            if not versions:
                del self._blocks[chain]
            if self.on_gone is not None:
                self.on_gone(key)

    def keys(self) -> list[str]:
        """Every block key some tier is believed to hold."""
        return [key for versions in self._blocks.values() for key in versions]

    def blocks(self, chain: str) -> dict[str, set[int]]:
        """The stored versions of ``chain``: block key -> tiers believed to hold it."""
        return self._blocks.get(chain, {})


def _chain_of(key: str) -> str | None:
    if is_window_key(key):
        return None
    chain, sep, _ = key.partition(".")
    return chain if sep else None


@dataclass(frozen=True)
class HeldChunk:
    block_key: str
    tiers: tuple[str, ...]  # highest first


@dataclass(frozen=True)
class LookupResult:
    tokens_held: int  # a multiple of the layout's chunk_tokens
    chunks: tuple[HeldChunk, ...]  # one per held chunk of the prefix, in order


def longest_prefix(index: ChainIndex, chains: Sequence[str], tier_names: Sequence[str],
                   chunk_tokens: int, is_referenced: Callable[[str], bool]) -> LookupResult:
    """The longest run of ``chains`` from the first whose blocks some tier holds. Of two
    versions of one chunk the referenced one is named (a live session vouches for it),
    then the one held highest."""
    held: list[HeldChunk] = []
    for chain in chains:
        versions = index.blocks(chain)
        if not versions:
            break
        key = min(versions, key=lambda k: (not is_referenced(k), min(versions[k]), k))
        held.append(HeldChunk(key, tuple(tier_names[j] for j in sorted(versions[key]))))
    return LookupResult(len(held) * chunk_tokens, tuple(held))


class Retention:
    """Chunks kept after their last reference went away, oldest first."""

    def __init__(self, *, enabled: bool, ttl_s: float | None,
                 is_held: Callable[[str], bool], is_referenced: Callable[[str], bool]) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidRequest(f"retain_ttl_s must be > 0, got {ttl_s}")
        self.enabled = enabled
        self.ttl_s = ttl_s
        self._is_held = is_held
        self._is_referenced = is_referenced
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (scope, t)

    def keep(self, keys: Iterable[str], scope: str = "") -> list[str]:
        """Retain the held ones of ``keys`` (their references just went away); returns
        the ones to free now (all of them with retention off)."""
        if not self.enabled:
            return list(keys)
        now = time.monotonic()
        free = []
        for key in keys:
            if self._is_held(key) and not is_window_key(key):
                self._entries[key] = (scope, now)
                self._entries.move_to_end(key)
            else:
                free.append(key)
        return free

    def adopt(self, keys: Iterable[str]) -> None:
        """Blocks found in the tiers at open that nothing references (a deleted session's,
        or a spill's that a crash cut short): retained, their domain unknown."""
        if self.enabled:
            now = time.monotonic()
            for key in keys:
                if not is_window_key(key) and not self._is_referenced(key):
                    self._entries.setdefault(key, ("", now))

    def touch(self, keys: Iterable[str]) -> None:
        """Retained ``keys`` were looked up: used now, so eviction takes them last of the
        retained."""
        now = time.monotonic()
        for key in keys:
            if key in self._entries:
                self._entries[key] = (self._entries[key][0], now)
                self._entries.move_to_end(key)

    def forget(self, key: str) -> None:
        self._entries.pop(key, None)

    def retained(self, key: str) -> bool:
        """Held, unreferenced and kept: a cache entry eviction may take first."""
        if key not in self._entries:
            return False
        if self._is_referenced(key):  # revived by a spill or fork
            del self._entries[key]
            return False
        return True

    def candidates(self) -> list[str]:
        return [key for key in list(self._entries) if self.retained(key)]

    def victim(self, held_by: Collection[str], exclude: Collection[str]) -> str | None:
        """The oldest retained chunk of a tier (``held_by``: its policy) not in
        ``exclude``: eviction takes it before asking the tier's policy, so unreferenced
        cache never costs a live session its place."""
        for key in self.candidates():
            if key in held_by and key not in exclude:
                return key
        return None

    def expired(self, now: float | None = None) -> list[str]:
        """Retained keys idle past ``ttl_s`` (none without a TTL): the caller frees them."""
        if self.ttl_s is None:
            return []
        now = time.monotonic() if now is None else now
        return [key for key in self.candidates() if now - self._entries[key][1] > self.ttl_s]

    def by_domain(self) -> dict[str, int]:
        """Retained chunks per dedupe domain ("" where it is unknown)."""
        counts: dict[str, int] = {}
        for key in self.candidates():
            scope = self._entries[key][0]
            counts[scope] = counts.get(scope, 0) + 1
        return counts

    def __len__(self) -> int:
        return len(self.candidates())
