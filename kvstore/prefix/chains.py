"""Prefix reuse: which stored blocks answer a chain key, and chunks kept past their last
reference.

``ChainIndex`` maps each chain key to the block keys (chain key + digest, ``kvstore.format.keys``)
some tier is believed to hold, and each block's size where a placement told it. It is a
``Residency`` watcher of the ``TierStack``, so it follows every placement, eviction and
delete, and the stack's ``load`` rebuilds it at open from what the tiers list. A chain
key binds its dedupe domain, so a lookup computed in the caller's domain can only ever
find blocks of that domain.

``Retention`` keeps chunks whose last reference went away (a deleted session's system
prompt) as evictable cache entries instead of freeing them. Each entry is accounted to
the dedupe domain it belonged to (chunks and bytes per domain, kept as running totals).
Retained chunks give way first under every pressure:

- a tier's capacity and a medium that fills before it (``victim``: the tier stack takes
  them before asking its policy, and sheds them when a put is refused ``TierFull``);
- ``ttl_s``: ``expired`` names those idle longer, which the manager frees;
- quota: ``over_quota`` names a domain's oldest ones to free before a spill of that
  domain's tenant would pass its ``durable_bytes`` limit (``kvstore.session.spill``).

A spill naming one by key (or a fork) revives it by taking a reference (``revive``).

Marks persist (``mark``, ``parse_mark``): the ``RefLedger`` writes a ``ret/<key>`` record
(domain, size, since when) in the very MetaStore batch that drops the chunk's last
reference, and deletes it in the batch that references the chunk again or after the
chunk left every tier. At open the retained set is rebuilt from what the index holds:
every block some tier lists that nothing references (a mark adds its domain, size and
age; an unmarked one, such as a crashed spill's, is retained with its domain unknown),
so a stale or lost mark can neither keep a chunk alive nor lose one.
"""

from __future__ import annotations

import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.format.errors import InvalidRequest
from kvstore.placement.events import Residency, StoreEvents
from kvstore.placement.stack import is_window_key


class ChainIndex:
    """chain key -> {block key: tiers holding it}; told by the ``TierStack``."""

    def __init__(self, inner: Residency | None = None, events: StoreEvents | None = None
                 ) -> None:
        """``inner``: the watcher this one stands in front of (quota residency);
        ``events``: told when a block left its last tier."""
        self._inner = inner
        self._events = events
        self._blocks: dict[str, dict[str, set[int]]] = {}
        self._sizes: dict[str, int] = {}  # block key -> bytes, where a placement said

    def held(self, j: int, key: str, size: int) -> None:
        if self._inner is not None:
            self._inner.held(j, key, size)
        chain = _chain_of(key)
        if chain is not None:
            self._blocks.setdefault(chain, {}).setdefault(key, set()).add(j)
            if size > 0:
                self._sizes[key] = size

    def dropped(self, j: int, key: str) -> None:
        if self._inner is not None:
            self._inner.dropped(j, key)
        chain = _chain_of(key)
        versions = self._blocks.get(chain) if chain is not None else None
        tiers = versions.get(key) if versions else None
        if tiers is None or versions is None or chain is None:
            return
        tiers.discard(j)
        if not tiers:
            del versions[key]
            if not versions:
                del self._blocks[chain]
            self._sizes.pop(key, None)
            if self._events is not None:
                self._events.gone(key)

    def keys(self) -> list[str]:
        """Every block key some tier is believed to hold."""
        return [key for versions in self._blocks.values() for key in versions]

    def size(self, key: str) -> int:
        """The block's bytes as a placement told them (0: only listed at open)."""
        return self._sizes.get(key, 0)

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
    index: int  # the chunk's index in the sequence asked about


@dataclass(frozen=True)
class LookupResult:
    tokens_held: int  # a multiple of the layout's chunk_tokens
    chunks: tuple[HeldChunk, ...]  # one per held chunk (of the prefix), in order


def longest_prefix(index: ChainIndex, chains: Iterable[str], tier_names: Sequence[str],
                   chunk_tokens: int, is_referenced: Callable[[str], bool]) -> LookupResult:
    """The longest run of ``chains`` from the first whose blocks some tier holds (read no
    further than the first not held: ``chains`` may be computed as it is read). Of two
    versions of one chunk the referenced one is named (a live session vouches for it),
    then the one held highest."""
    held: list[HeldChunk] = []
    for n, chain in enumerate(chains):
        found = _held(index, chain, n, tier_names, is_referenced)
        if found is None:
            break
        held.append(found)
    return LookupResult(len(held) * chunk_tokens, tuple(held))


def held_each(index: ChainIndex, chains: Iterable[str], tier_names: Sequence[str],
              chunk_tokens: int, is_referenced: Callable[[str], bool]) -> LookupResult:
    """Every one of ``chains`` whose blocks some tier holds, each asked about alone
    (independent chunks: no prefix), the version named as ``longest_prefix`` names it."""
    held = [found for n, chain in enumerate(chains)
            if (found := _held(index, chain, n, tier_names, is_referenced)) is not None]
    return LookupResult(len(held) * chunk_tokens, tuple(held))


def _held(index: ChainIndex, chain: str, n: int, tier_names: Sequence[str],
          is_referenced: Callable[[str], bool]) -> HeldChunk | None:
    versions = index.blocks(chain)
    if not versions:
        return None
    key = min(versions, key=lambda k: (not is_referenced(k), min(versions[k]), k))
    return HeldChunk(key, tuple(tier_names[j] for j in sorted(versions[key])), n)


@dataclass(frozen=True)
class Mark:
    """What a persisted retention mark says of a chunk."""

    scope: str  # its dedupe domain
    size: int  # its bytes
    since: float  # wall-clock seconds it was last retained


def mark(scope: str, size: int, since: float | None = None) -> bytes:
    return json.dumps({"scope": scope, "size": size,
                       "since": time.time() if since is None else since}).encode()


def parse_mark(raw: bytes) -> Mark | None:
    """The mark, or None for one that does not parse (its chunk is retained unmarked)."""
    try:
        value = json.loads(raw)
        return Mark(str(value["scope"]), int(value["size"]), float(value["since"]))
    except (ValueError, KeyError, TypeError):
        return None


@dataclass
class _Entry:
    scope: str
    size: int
    used: float  # monotonic time it was retained or last looked up


class Retention:
    """Chunks kept after their last reference went away, least recently used first."""

    def __init__(self, *, enabled: bool, ttl_s: float | None,
                 is_held: Callable[[str], bool], is_referenced: Callable[[str], bool],
                 size_of: Callable[[str], int] = lambda key: 0,
                 events: StoreEvents | None = None) -> None:
        """``is_referenced``: a committed reference or a spill's pin; ``size_of``: a
        block's bytes where the caller does not say them; ``events``: told when a chunk
        is no longer retained (its mark may go)."""
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidRequest(f"retain_ttl_s must be > 0, got {ttl_s}")
        self.enabled = enabled
        self.ttl_s = ttl_s
        self._is_held = is_held
        self._is_referenced = is_referenced
        self._size_of = size_of
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._chunks: Counter[str] = Counter()  # scope -> retained chunks
        self._bytes: Counter[str] = Counter()  # scope -> retained bytes
        self._events = events

    def marks(self, keys: Sequence[str], sizes: Sequence[int], scope: str
              ) -> dict[str, bytes]:
        """The marks the ledger writes for ``keys`` if a release leaves them unreferenced
        (none with retention off)."""
        if not self.enabled:
            return {}
        now = time.time()
        return {key: mark(scope, size, now) for key, size in zip(keys, sizes, strict=True)}

    def keep(self, keys: Iterable[str], scope: str = "",
             sizes: Mapping[str, int] | None = None) -> list[str]:
        """Retain the held ones of ``keys`` (their references just went away); returns
        the ones to free now (all of them with retention off)."""
        if not self.enabled:
            return list(keys)
        now = time.monotonic()
        free = []
        for key in keys:
            if self._is_held(key) and not is_window_key(key):
                size = (sizes or {}).get(key) or self._size_of(key)
                self._add(key, _Entry(scope, size, now))
            else:
                free.append(key)
                self._drop(key)
        return free

    def adopt(self, keys: Iterable[str], marks: Mapping[str, bytes]) -> list[str]:
        """At open: retain every held block in ``keys`` that nothing references, with its
        mark's domain, size and age where ``marks`` has one. Returns the marks that are
        stale (their chunk is referenced, or no tier holds it any more)."""
        if not self.enabled:
            return list(marks)
        now, wall = time.monotonic(), time.time()
        adopted = set()
        for key in keys:
            if is_window_key(key) or self._is_referenced(key):
                continue
            found = parse_mark(marks[key]) if key in marks else None
            if found is None:
                entry = _Entry("", self._size_of(key), now)
            else:
                entry = _Entry(found.scope, found.size, now - max(0.0, wall - found.since))
            self._add(key, entry)
            adopted.add(key)
        # oldest first, as they were retained before the restart
        for key in sorted(adopted, key=lambda k: self._entries[k].used):
            self._entries.move_to_end(key)
        return [key for key in marks if key not in adopted]

    def touch(self, keys: Iterable[str]) -> None:
        """Retained ``keys`` were looked up: used now, so eviction takes them last of the
        retained."""
        now = time.monotonic()
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.used = now
                self._entries.move_to_end(key)

    def revive(self, keys: Iterable[str]) -> None:
        """``keys`` were referenced again (a spill or fork): no longer cache."""
        for key in keys:
            self._drop(key)

    def forget(self, key: str) -> None:
        """``key`` left its last tier."""
        self._drop(key)
        if self._events is not None:
            self._events.unmarked(key)

    def _add(self, key: str, entry: _Entry) -> None:
        self._drop(key)
        self._entries[key] = entry
        self._chunks[entry.scope] += 1
        self._bytes[entry.scope] += entry.size

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        for totals, amount in ((self._chunks, 1), (self._bytes, entry.size)):
            totals[entry.scope] -= amount
            if totals[entry.scope] <= 0:
                del totals[entry.scope]

    def retained(self, key: str) -> bool:
        """Held, unreferenced and kept: a cache entry eviction may take first. One found
        referenced (a spill in flight pins it, or a caller that does not ``revive``) is
        no longer an entry: a failed spill's ``keep`` retains it again."""
        if key not in self._entries:
            return False
        if self._is_referenced(key):
            self._drop(key)
            return False
        return True

    def _first(self, wanted: Callable[[str, _Entry], bool]) -> Generator[str, None, None]:
        """Retained keys that ``wanted``, least recently used first (dropping the ones
        found referenced on the way)."""
        referenced = []
        try:
            for key, entry in self._entries.items():
                if self._is_referenced(key):
                    referenced.append(key)
                elif wanted(key, entry):
                    yield key
        finally:
            for key in referenced:
                self._drop(key)

    def victim(self, held_by: Container[str], exclude: Container[str]) -> str | None:
        """The least recently used retained chunk of a tier (``held_by``: its policy) not
        in ``exclude``: eviction takes it before asking the tier's policy, so
        unreferenced cache never costs a live session its place."""
        found = self._first(lambda key, _: key in held_by and key not in exclude)
        try:
            return next(found, None)
        finally:
            found.close()

    def size(self, key: str) -> int:
        entry = self._entries.get(key)
        return entry.size if entry is not None else 0

    def expired(self, now: float | None = None) -> list[str]:
        """Retained keys idle past ``ttl_s`` (none without a TTL): the caller frees them."""
        ttl_s = self.ttl_s
        if ttl_s is None:
            return []
        at = time.monotonic() if now is None else now
        return list(self._first(lambda _, entry: at - entry.used > ttl_s))

    def over_quota(self, scope: str, excess: int, exclude: Container[str] = ()) -> list[str]:
        """The domain's least recently used retained chunks, not in ``exclude``, whose
        bytes reach ``excess`` (all of them if theirs do not): what a quota frees first."""
        out, total = [], 0
        for key in self._first(lambda key, entry: entry.scope == scope and key not in exclude):
            if total < excess:
                out.append(key)
                total += self._entries[key].size
        return out

    def bytes_of(self, scope: str) -> int:
        """Retained bytes of one dedupe domain."""
        return self._bytes.get(scope, 0)

    def by_domain(self) -> dict[str, tuple[int, int]]:
        """(retained chunks, bytes) per dedupe domain ("" where it is unknown)."""
        return {scope: (count, self._bytes.get(scope, 0))
                for scope, count in self._chunks.items()}

    def __len__(self) -> int:
        return len(self._entries)
