"""Per-tenant quotas: their limits, the usage ledger, and the admission of spills.

``Quotas`` holds a default table and one table per named tenant, which overrides the
default key by key; an absent key is unlimited. What each quota counts (``TenantUsage``):

- ``sessions``: the tenant's stored sessions (committed manifests; an expired one until
  garbage collection deletes it).
- ``durable_bytes``: the logical bytes of its sessions, what the durable tiers hold of
  them (or will, once write-back is done): per session, its chunks' encoded sizes plus
  its tail (which the manifest holds). A chunk that two of its sessions share by dedupe
  counts once per session. That makes the use a function of the tenant's own manifests:
  a spill's cost is known before anything is stored, deleting a session always frees
  exactly its bytes, and no tenant's use moves when another one (in a shared dedupe
  domain) spills or deletes the same chunk. Counted once per tenant, a delete would free
  nothing while a sibling session holds the chunk, and a spill's cost would depend on
  what other sessions hold by the time it commits. It is an upper bound on what the
  tenant makes the tiers store.
- ``memory_bytes``: bytes of its sessions held in memory tiers (the tiers that hold
  windows: hbm, host): per session, each of its chunks that some memory tier holds (once,
  however many do) plus its window blob while a memory tier holds it. ``MemoryWatch``
  (the tier stack's ``Residency`` watcher) sees each memory tier learn or forget a
  block, so every placement, eviction, demotion, promotion, delete and expiry counts.

- ``retained_bytes`` (reported, not a quota of its own): chunks of the tenant's own
  dedupe domain that no manifest names any more, kept as cache (``kvstore.prefix.chains``).
  They are not part of ``durable_bytes`` (a delete still frees exactly the session's
  bytes there) and never make a spill refused: they live in the room the tenant's
  ``durable_bytes`` limit leaves, and a spill that needs that room frees the least
  recently used of them first (``Spiller._shed_retained``), before its admission is
  judged. A shared domain's retained chunks count against no tenant's quota; tier
  capacity and ``retain_ttl_s`` evict them.

The usage is exact across restarts: the ``Catalog`` feeds every manifest to the
``UsageLedger`` at open, and every commit and removal after; memory tiers start empty.

Admission has one path: ``QuotaGate.reserve``. Everything that creates a session or
grows what a tenant holds (a spill, a fork, a rebuilt window kept) reserves its growth
under the session's write lock before it stores anything, and holds the reservation
until the manifest is committed (the ledger then counts it) or the call failed. The
check and the hold happen with no await between them, and every check counts what is
reserved as well as what is committed, so concurrent admissions of one tenant (spills,
forks, both) cannot pass a limit together, and the use rebuilt from manifests after a
restart is the use before it. Going over raises ``QuotaExceeded`` (RESOURCE_EXHAUSTED)
naming the quota, the limit and the use. An admission that does not grow a use is always
admitted: a lowered limit never blocks replacing a session with a smaller one.

A spill's ``memory_bytes`` are its chunks in memory (sent ones land there first) plus
its window, less what the older generation holds there. When that would pass the limit
and a tier lies below the memory tiers, the tenant's own memory-resident data is moved
down first (``demote_own``: chunks as eviction moves them, windows dropped, their resumes
replay); if that is not enough, the sent chunks go straight below the memory tiers and
the window is not kept. The spill is refused only when what must stay in memory (chunks
named by key that no lower tier took) still does not fit, or when no tier lies below.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvstore.format.errors import DataLoss, InvalidRequest, QuotaExceeded
from kvstore.format.keys import dedupe_scope
from kvstore.placement.events import StoreEvents
from kvstore.placement.locks import KeyedLocks
from kvstore.placement.stack import WINDOW_PREFIX, TierStack, is_window_key
from kvstore.session.manifest import SessionManifest, check_name

QUOTA_KEYS = ("memory_bytes", "durable_bytes", "sessions")
DEFAULT_TABLE = "default"  # [quota.default]: every tenant without a table of its own
OTHER = "other"  # the metrics label of every tenant without a table (bounded cardinality)


@dataclass(frozen=True)
class QuotaLimits:
    """A tenant's limits; None is unlimited."""

    memory_bytes: int | None = None
    durable_bytes: int | None = None
    sessions: int | None = None

    @classmethod
    def from_table(cls, name: str, table: object) -> QuotaLimits:
        if not isinstance(table, Mapping):
            raise InvalidRequest(f"quota.{name} must be a table of {', '.join(QUOTA_KEYS)}")
        unknown = sorted(set(table) - set(QUOTA_KEYS))
        if unknown:
            raise InvalidRequest(f"quota.{name}: unknown keys {unknown}; known: {list(QUOTA_KEYS)}")
        for key, value in table.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequest(f"quota.{name}.{key} must be an integer >= 0, got {value!r}")
        return cls(**table)

    def over(self, base: QuotaLimits) -> QuotaLimits:
        """These limits where set, ``base``'s elsewhere."""
        return QuotaLimits(**{key: getattr(self, key) if getattr(self, key) is not None
                              else getattr(base, key) for key in QUOTA_KEYS})

    def table(self) -> dict[str, int]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Quotas:
    default: QuotaLimits = QuotaLimits()
    tenants: Mapping[str, QuotaLimits] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_tables(cls, tables: Mapping[str, object]) -> Quotas:
        """``{"default": {...}, "<tenant>": {...}}`` as the ``[quota.*]`` TOML tables give
        them (sizes already in bytes); a tenant's table is completed from the default's."""
        default = QuotaLimits.from_table(DEFAULT_TABLE, tables.get(DEFAULT_TABLE, {}))
        tenants = {}
        for name, table in tables.items():
            if name == DEFAULT_TABLE:
                continue
            try:
                check_name("tenant", name)
            except InvalidRequest as exc:
                raise InvalidRequest(f"quota.{name}: not a tenant id: {exc}") from None
            if name == OTHER:
                raise InvalidRequest(f"quota.{OTHER}: {OTHER!r} is the metrics label of the "
                                     "tenants without a table of their own")
            tenants[name] = QuotaLimits.from_table(name, table).over(default)
        return cls(default, MappingProxyType(tenants))

    def limits(self, tenant: str) -> QuotaLimits:
        return self.tenants.get(tenant, self.default)

    def label(self, tenant: str) -> str:
        """The tenant's metrics label: its name if it has a table, else ``OTHER``."""
        return tenant if tenant in self.tenants else OTHER


@dataclass
class TenantUsage:
    sessions: int = 0
    durable_bytes: int = 0
    memory_bytes: int = 0
    retained_bytes: int = 0  # its own domain's retained chunks (reported, see above)

    def add(self, other: TenantUsage, sign: int = 1) -> None:
        for key in (*QUOTA_KEYS, "retained_bytes"):
            setattr(self, key, getattr(self, key) + sign * getattr(other, key))

    def empty(self) -> bool:
        return not any(getattr(self, key) for key in (*QUOTA_KEYS, "retained_bytes"))


@dataclass(frozen=True)
class TenantReport:
    """One tenant's (or, for ``OTHER``, all unnamed tenants') use, limits and rejections."""

    tenant: str
    usage: TenantUsage
    limits: QuotaLimits
    rejections: Mapping[str, int]  # quota -> admissions refused


@dataclass(frozen=True)
class _Session:
    keys: tuple[str, ...]
    stored_bytes: int  # chunks + tail


class UsageLedger:
    """Each tenant's use, kept from manifests (``record``, ``forget``) and from what the
    memory tiers hold (``entered``, ``left``, called by ``MemoryWatch``)."""

    def __init__(self) -> None:
        self._use: dict[str, TenantUsage] = {}
        self._sessions: dict[str, dict[str, _Session]] = {}  # tenant -> session id -> entry
        self._refs: dict[str, Counter[str]] = {}  # chunk key -> tenant -> its references
        self._memory: dict[str, list[int]] = {}  # block key -> [memory tiers holding it, bytes]
        self._windows: dict[str, set[str]] = {}  # tenant -> its window keys in memory

    def usage(self, tenant: str) -> TenantUsage:
        return dataclasses.replace(self._use.get(tenant, TenantUsage()))

    def tenants(self) -> list[str]:
        return sorted(self._use)

    def record(self, manifest: SessionManifest) -> None:
        """The session's manifest was committed (replacing its older one, if any)."""
        tenant = manifest.tenant
        self.forget(tenant, manifest.session_id)
        entry = _Session(manifest.chunk_keys, manifest.stored_bytes)
        self._sessions.setdefault(tenant, {})[manifest.session_id] = entry
        use = self._use.setdefault(tenant, TenantUsage())
        use.sessions += 1
        use.durable_bytes += entry.stored_bytes
        for key in entry.keys:
            self._refs.setdefault(key, Counter())[tenant] += 1
            use.memory_bytes += self.memory_bytes(key)

    def forget(self, tenant: str, session_id: str) -> None:
        """The session's manifest was removed (a no-op for one never recorded)."""
        entry = self._sessions.get(tenant, {}).pop(session_id, None)
        if entry is None:
            return
        if not self._sessions[tenant]:
            del self._sessions[tenant]
        use = self._use[tenant]
        use.sessions -= 1
        use.durable_bytes -= entry.stored_bytes
        for key in entry.keys:
            refs = self._refs[key]
            refs[tenant] -= 1
            if not refs[tenant]:
                del refs[tenant]
                if not refs:
                    del self._refs[key]
            use.memory_bytes -= self.memory_bytes(key)
        self._prune(tenant)

    def memory_bytes(self, key: str | None) -> int:
        """Bytes of ``key`` in memory tiers (0 when none holds it)."""
        held = self._memory.get(key) if key is not None else None
        return held[1] if held else 0

    def in_memory(self, tenant: str) -> list[str]:
        """The chunks of the tenant's sessions that a memory tier holds, each once, then
        its window blobs there."""
        keys = {key for entry in self._sessions.get(tenant, {}).values() for key in entry.keys}
        return [key for key in keys if key in self._memory] + sorted(
            self._windows.get(tenant, ()))

    def entered(self, key: str, size: int) -> None:
        """A memory tier now holds ``key`` (``size`` bytes)."""
        held = self._memory.get(key)
        if held is not None:
            held[0] += 1
            return
        self._memory[key] = [1, size]
        self._charge(key, size)

    def left(self, key: str) -> None:
        """A memory tier no longer holds ``key``."""
        held = self._memory.get(key)
        if held is None:
            return
        held[0] -= 1
        if not held[0]:
            del self._memory[key]
            self._charge(key, -held[1])

    def _charge(self, key: str, size: int) -> None:
        if is_window_key(key):  # win/<tenant>/<session>/<generation>
            owner = key[len(WINDOW_PREFIX):].split("/")[0]
            charged: Iterable[tuple[str, int]] = [(owner, 1)]
            windows = self._windows.setdefault(owner, set())
            if size > 0:
                windows.add(key)
            else:
                windows.discard(key)
                if not windows:
                    del self._windows[owner]
        else:
            charged = list(self._refs.get(key, {}).items())
        for tenant, times in charged:
            self._use.setdefault(tenant, TenantUsage()).memory_bytes += times * size
            self._prune(tenant)

    def _prune(self, tenant: str) -> None:
        if self._use[tenant].empty() and tenant not in self._sessions:
            del self._use[tenant]


class MemoryWatch:
    """The ``TierStack``'s ``Residency`` watcher: tells the ledger when a memory tier
    starts or stops holding a block."""

    def __init__(self, ledger: UsageLedger, memory_tiers: Collection[int]) -> None:
        self._ledger = ledger
        self._memory = frozenset(memory_tiers)

    def held(self, j: int, key: str, size: int) -> None:
        if j in self._memory:
            self._ledger.entered(key, size)

    def dropped(self, j: int, key: str) -> None:
        if j in self._memory:
            self._ledger.left(key)


class Reservation:
    """What an admission in flight was granted; ``release`` once its manifest committed or
    it failed (``with reservation:`` releases on leaving, whichever happened)."""

    def __init__(self, reserved: dict[str, TenantUsage], tenant: str, need: TenantUsage) -> None:
        self._reserved, self._tenant, self._need = reserved, tenant, need
        self._held = True

    def release(self) -> None:
        if self._held and not self._need.empty():
            self._held = False
            held = self._reserved[self._tenant]
            held.add(self._need, -1)
            if held.empty():
                del self._reserved[self._tenant]

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


class QuotaGate:
    def __init__(self, quotas: Quotas, ledger: UsageLedger,
                 events: StoreEvents | None = None) -> None:
        """``events``: says the retained bytes of each dedupe domain."""
        self.quotas = quotas
        self.ledger = ledger
        self._events = events
        self._reserved: dict[str, TenantUsage] = {}  # admitted, not yet committed
        self._rejections: Counter[tuple[str, str]] = Counter()  # (label, quota)

    def _retained(self) -> Mapping[str, int]:
        return {} if self._events is None else self._events.retained_bytes()

    def in_use(self, tenant: str) -> TenantUsage:
        """Committed use plus what spills in flight were admitted for."""
        use = self.ledger.usage(tenant)
        use.add(self._reserved.get(tenant, TenantUsage()))
        return use

    def room(self, tenant: str, quota: str) -> int | None:
        """How much more of ``quota`` the tenant may take now (None: unlimited)."""
        limit = getattr(self.quotas.limits(tenant), quota)
        return None if limit is None else limit - getattr(self.in_use(tenant), quota)

    def check(self, tenant: str, need: TenantUsage, *, count: bool = True,
              what: str = "spill") -> None:
        """``QuotaExceeded`` for the first quota ``need`` would take the tenant over (a
        check alone admits nothing: ``reserve`` does)."""
        use = self.in_use(tenant)
        limits = self.quotas.limits(tenant)
        for quota in QUOTA_KEYS:
            more, limit = getattr(need, quota), getattr(limits, quota)
            if limit is not None and more > 0 and getattr(use, quota) + more > limit:
                if count:
                    self._rejections[self.quotas.label(tenant), quota] += 1
                raise QuotaExceeded(
                    f"quota {quota} for tenant {tenant}: limit {limit}, in use "
                    f"{getattr(use, quota)}, this {what} needs {more} more")

    def reserve(self, tenant: str, need: TenantUsage, *, count: bool = True,
                what: str = "spill") -> Reservation:
        """Admit ``need`` (only its growth counts) and hold it until released: the one
        way anything is admitted (module docstring). ``count``: whether a refusal counts
        in the tenant's rejections."""
        grows = TenantUsage(**{q: max(0, getattr(need, q)) for q in QUOTA_KEYS})
        self.check(tenant, grows, count=count, what=what)
        if not grows.empty():  # so a tenant's entry is dropped with its last reservation
            self._reserved.setdefault(tenant, TenantUsage()).add(grows)
        return Reservation(self._reserved, tenant, grows)

    def usage(self, tenant: str) -> TenantUsage:
        """Committed use, with the retained bytes of the tenant's own domain."""
        use = self.ledger.usage(tenant)
        use.retained_bytes = self._retained().get(dedupe_scope(tenant), 0)
        return use

    def report(self, tenant: str) -> TenantReport:
        label = self.quotas.label(tenant)
        return TenantReport(tenant, self.usage(tenant), self.quotas.limits(tenant),
                            {q: self._rejections[label, q] for q in QUOTA_KEYS
                             if label == tenant})

    def reports(self) -> tuple[TenantReport, ...]:
        """Every tenant with a table of its own, then the others together as ``OTHER``
        (whose limits are the default's): as many reports as tables, plus one."""
        named = [self.report(tenant) for tenant in self.quotas.tenants]
        other = TenantUsage()
        for tenant in self.ledger.tenants():
            if tenant not in self.quotas.tenants:
                other.add(self.ledger.usage(tenant))
        own = {dedupe_scope(tenant) for tenant in self.quotas.tenants}
        other.retained_bytes = sum(size for scope, size in self._retained().items()
                                   if scope.startswith(dedupe_scope("")) and scope not in own)
        rejected = {q: self._rejections[OTHER, q] for q in QUOTA_KEYS}
        return (*named, TenantReport(OTHER, other, self.quotas.default, rejected))


def memory_floor(stack: TierStack) -> int | None:
    """The first tier below the memory (window) tiers, None when there is none (or no
    memory tier)."""
    memory = [j for j, tier in enumerate(stack.tiers) if tier.holds_window]
    return memory[-1] + 1 if memory and memory[-1] + 1 < len(stack.tiers) else None


async def demote_own(ledger: UsageLedger, stack: TierStack, locks: KeyedLocks, tenant: str,
                     amount: int, below: int, protect: Collection[str] = ()) -> None:
    """Move the tenant's memory-resident blocks (but ``protect``) to tier ``below`` or
    lower until its memory use fell by ``amount``, or none is left to move: what an
    admission that would pass ``memory_bytes`` does first."""
    before = ledger.usage(tenant).memory_bytes
    for key in ledger.in_memory(tenant):
        if before - ledger.usage(tenant).memory_bytes >= amount:
            return
        if key not in protect:
            await demote_out_of_memory(stack, locks, key, below)


async def demote_out_of_memory(stack: TierStack, locks: KeyedLocks, key: str,
                               below: int) -> bool:
    """Move ``key`` from the memory tiers (those above ``below``) to tier ``below`` or
    lower (``TierStack.demote``; a window blob, which lives only in memory, is dropped);
    False when no tier there takes it."""
    async with locks.hold(key):
        if not any(i < below for i in stack.holders(key)):
            return True
        if is_window_key(key):
            await stack.drop_window(key)
            return True
        try:
            return await stack.demote(key, below)
        except DataLoss:
            return False
