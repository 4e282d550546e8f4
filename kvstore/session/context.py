"""One manager's parts, built once and shared by its calls, and the events between them.

``StoreContext.build`` makes the parts a ``TierManager``'s spills, restores, maintenance
and forks share (each part's contract is on its class); ``Wiring`` is the one
``StoreEvents`` (``kvstore.placement.events``): the parts tell it what happened and it
tells the parts that must hear of it:

    a tier holds or dropped a block   -> ChainIndex -> MemoryWatch (quota memory use)
    a block left its last tier         -> Retention.forget -> RefLedger.unmark
    a commit referenced a chunk again  -> Retention.revive
    a manifest loads, naming a window  -> the tier stack says where it is, if anywhere
    eviction needs a victim            -> Retention's least recently used chunk first
    a free deleted chunks              -> WriteBackFailures retries now
    a manifest commit met a full medium -> Blocks.shed_durable
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.eviction.policies import EvictionPolicy
from kvstore.placement.blocks import Blocks, WriteHook
from kvstore.placement.locks import KeyedLocks
from kvstore.placement.refcount import RefLedger
from kvstore.placement.stack import TierStack
from kvstore.prefix.chains import ChainIndex, Retention
from kvstore.session.catalog import Catalog
from kvstore.session.durability import WriteBackFailures
from kvstore.session.quota import MemoryWatch, QuotaGate, Quotas, UsageLedger
from kvstore.stats import Counters
from kvstore.tiers.base import MetaStore, Tier


@dataclass(frozen=True)
class StoreOptions:
    """The ``ManagerConfig`` fields the parts take (``kvstore.session.manager``)."""

    io_concurrency: int
    cooldown_s: float
    retain: bool
    retain_ttl_s: float | None
    writeback_depth: int
    writeback_workers: int
    writeback_retry_s: float
    writeback_retry_max_s: float


@dataclass(frozen=True)
class StoreContext:
    catalog: Catalog
    blocks: Blocks
    stack: TierStack
    locks: KeyedLocks
    ledger: RefLedger
    counters: Counters
    retention: Retention
    quotas: QuotaGate
    index: ChainIndex
    durability: WriteBackFailures  # owns the write-back queue
    spawn: Callable[[Awaitable], None]  # background work the manager's drain waits for

    @classmethod
    def build(cls, tiers: Sequence[Tier], meta: MetaStore,
              policy: Callable[[], EvictionPolicy], quotas: Quotas, options: StoreOptions,
              spawn: Callable[[Awaitable], None], hook: WriteHook | None = None
              ) -> StoreContext:
        """The parts over ``tiers`` (highest first) and ``meta``, wired to one ``Wiring``;
        ``hook``: told of every write that stores chunks (``Blocks.admitting``). Call on
        the loop the manager runs on (the write-back workers start here)."""
        events = Wiring()
        counters, locks, usage = Counters(), KeyedLocks(), UsageLedger()
        ledger = RefLedger(meta, events)
        index = ChainIndex(MemoryWatch(usage, [j for j, t in enumerate(tiers)
                                               if t.holds_window]), events)
        stack = TierStack(tiers, policy, locks, counters, is_referenced=events.is_referenced,
                          cooldown_s=options.cooldown_s, residency=index,
                          evict_first=events.evict_first if options.retain else None,
                          first_size=events.first_size)
        retention = Retention(enabled=options.retain, ttl_s=options.retain_ttl_s,
                              is_held=events.is_held, is_referenced=events.is_referenced,
                              size_of=index.size, events=events)
        catalog = Catalog(meta, ledger, usage, events)
        blocks = Blocks(stack, ledger, locks, counters, io_concurrency=options.io_concurrency,
                        retention=retention, events=events, hook=hook)
        durability = WriteBackFailures(
            catalog, blocks, counters, spawn=spawn, retry_s=options.writeback_retry_s,
            retry_max_s=options.writeback_retry_max_s, depth=options.writeback_depth,
            workers=options.writeback_workers)
        store = cls(catalog, blocks, stack, locks, ledger, counters, retention,
                    QuotaGate(quotas, usage, events), index, durability, spawn)
        events.store = store
        return store


class Wiring:
    """The ``StoreEvents`` of one ``StoreContext``: each event routed to the part that
    hears it (the table in this module's docstring). Bound to its store by ``build``,
    before any part can tell it anything."""

    store: StoreContext

    def is_referenced(self, key: str) -> bool:
        return self.store.ledger.count(key) > 0

    def is_held(self, key: str) -> bool:
        return bool(self.store.stack.holders(key))

    def window_tier(self, key: str) -> str | None:
        held = self.store.stack.holders(key)
        return self.store.stack.tiers[held[0]].name if held else None

    def evict_first(self, j: int, skip: Container[str]) -> str | None:
        return self.store.retention.victim(self.store.stack.policies[j], skip)

    def first_size(self, key: str) -> int:
        return self.store.retention.size(key)

    def gone(self, key: str) -> None:
        self.store.retention.forget(key)

    def unmarked(self, key: str) -> None:
        self.store.ledger.unmark([key])

    def revived(self, keys: Iterable[str]) -> None:
        self.store.retention.revive(keys)

    def freed(self) -> None:
        self.store.durability.poke()

    async def make_room(self, size: int) -> None:
        await self.store.blocks.shed_durable(size)

    def retained_bytes(self) -> Mapping[str, int]:
        return {scope: size for scope, (_, size) in self.store.retention.by_domain().items()}
