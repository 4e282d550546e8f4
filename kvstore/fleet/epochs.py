"""The fleet's garbage-collection epochs: how a sweep (``kvstore.fleet.gc``) and the spills
of every node agree on which chunks may be deleted. The protocol and its proof are in
docs/fleet.md ("Garbage collection"); this module holds the objects and the spill side.

Objects, under ``<s3_prefix>fleet/gc/``:

* ``epoch``: ``Epoch`` as JSON. Only sweeps write it, by conditional PUT on the ETag
  they read, so one sweep at a time moves it: ``done`` -> ``marking`` (candidates
  published) -> ``deleting`` -> ``done``. Absent: epoch 0, done.
* ``<e>/candidates``: the chunk keys sweep ``e`` may delete, written before ``e`` is
  published and never changed.
* ``<e>/claim/<key>``: a spill named ``key`` while ``e`` was marking; sweep ``e``
  keeps it.
* ``<e>/deleted/<sweeper>``: the keys that sweeper deletes in ``e``, written before
  its first delete, so a node learns every deletion of a done epoch.
* ``unnamed``: when a sweep first saw each chunk that no manifest names (retention).
* ``last_run``: the last sweep's result (``kvstore.fleet.gc``), for the nodes' metrics.

``SpillGate.admit`` runs just before a manifest's conditional PUT, for the chunks the
new manifest names and the one it replaces did not (a chunk named by both stays named
throughout: a PUT replaces an object whole). It costs one small GET of ``epoch`` per
``spill_bound_s / 4`` at most, reused across spills; more only while a sweep marks a
chunk the spill names, or after a sweep deleted one this node may still believe held.
Each admit's time, however it ends, is reported to ``SpillGate.observer``
(``kvstore.remote.observe``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import asdict, dataclass

from kvstore.fleet.bucket import BucketIO
from kvstore.format.errors import DataLoss, TierUnavailable
from kvstore.remote.observe import IGNORE

log = logging.getLogger(__name__)

STATES = ("marking", "deleting", "done")
# The longest a spill may take from reading the epoch to sending its manifest's PUT,
# until a sweep publishes another (the epoch object carries the one in force).
DEFAULT_SPILL_BOUND_S = 20.0
DELETING_WAIT_S = 30.0  # a spill naming a chunk a sweep may be deleting waits this long
_ROUNDS = 8  # epoch reads one admit tries before giving up (each is a sweep's step)


@dataclass(frozen=True)
class Epoch:
    epoch: int = 0
    state: str = "done"
    spill_bound_s: float = DEFAULT_SPILL_BOUND_S
    # marking: how long after publishing the sweep waits before deleting (a sweep taking
    # over a dead one waits what is left of it)
    mark_s: float = 0.0
    sweeper: str = ""

    def __post_init__(self) -> None:
        if self.state not in STATES or self.epoch < 0 or not self.spill_bound_s > 0:
            raise TierUnavailable(f"the fleet's gc epoch object is not valid: {self}")

    @property
    def last_done(self) -> int:
        """The newest epoch whose deletions are all over."""
        return self.epoch if self.state == "done" else self.epoch - 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: object) -> Epoch:
        try:
            return cls(**value)  # type: ignore[arg-type]
        except TypeError as exc:
            raise TierUnavailable(f"the fleet's gc epoch object is not valid: {exc}") from exc


class GcPaths:
    """Object names of the protocol under ``root`` (``<s3_prefix>fleet/``)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.gc = root + "gc/"
        self.epoch = self.gc + "epoch"
        self.unnamed = self.gc + "unnamed"
        self.last_run = self.gc + "last_run"

    def of(self, e: int) -> str:
        return f"{self.gc}{e:012d}/"

    def candidates(self, e: int) -> str:
        return self.of(e) + "candidates"

    def claims(self, e: int) -> str:
        return self.of(e) + "claim/"

    def deleted(self, e: int) -> str:
        return self.of(e) + "deleted/"


async def read_epoch(io: BucketIO, paths: GcPaths) -> tuple[Epoch, str | None]:
    """The epoch object and its ETag (None: absent, epoch 0 done)."""
    found = await io.get_json(paths.epoch)
    if found is None:
        return Epoch(), None
    return Epoch.from_dict(found[1]), found[0]


class SpillGate:
    """The spill side. ``exists(key)``: whether the bucket holds the chunk now (a HEAD);
    ``reupload(key)``: put the chunk back from this node's caches, False when none holds
    it intact; ``gone_since_listing()``: the chunks this node believes in the bucket that
    a fresh listing lacks (used when the deletion lists of epochs it missed are pruned)."""

    def __init__(self, io: BucketIO, paths: GcPaths, node_id: str, *,
                 exists: Callable[[str], Awaitable[bool]],
                 reupload: Callable[[str], Awaitable[bool]],
                 gone_since_listing: Callable[[], Awaitable[Collection[str]]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._io, self._paths, self._node = io, paths, node_id
        self._exists, self._reupload, self._gone_since = exists, reupload, gone_since_listing
        self._clock = clock
        self._last: tuple[Epoch, float] | None = None  # last read, when its GET was sent
        self._applied: int | None = None  # deletion lists applied through this epoch
        self._gone: set[str] = set()  # deleted by a sweep, maybe still believed held here
        self._candidates: dict[int, frozenset[str] | None] = {}  # epoch -> its candidates
        self._lock = asyncio.Lock()  # one reader of new epochs at a time
        self.observer = IGNORE

    async def baseline(self) -> None:
        """Note the epoch this node's view of the bucket starts from: call before the
        node first lists the bucket's chunks (deletions after it are learnt)."""
        if self._applied is None:
            epoch, _ = await read_epoch(self._io, self._paths)
            self._applied = epoch.last_done

    async def _read(self) -> tuple[Epoch, float]:
        sent = self._clock()
        epoch, _ = await read_epoch(self._io, self._paths)
        async with self._lock:
            await self._learn(epoch)
            if self._last is None or self._last[1] <= sent:
                self._last = (epoch, sent)
        return epoch, sent

    async def _current(self) -> tuple[Epoch, float]:
        """A read of the epoch recent enough to commit on (reused for a quarter of the
        bound: any commit within the bound of a read is safe, docs/fleet.md)."""
        if self._last is not None:
            epoch, sent = self._last
            if self._clock() - sent < epoch.spill_bound_s / 4 and epoch.state != "deleting":
                return self._last
        return await self._read()

    async def _learn(self, epoch: Epoch) -> None:
        """Take in the deletion lists of the epochs done since the last one applied."""
        if self._applied is None:  # no baseline: compare a listing with what we hold
            self._gone.update(await self._gone_since())
            self._applied = epoch.last_done
        for e in range(self._applied + 1, epoch.last_done + 1):
            listed = await self._io.listing(self._paths.deleted(e))
            if not listed:  # pruned: this node missed too many sweeps
                log.warning("gc epoch %d's deletion lists are gone: checking the bucket's "
                            "listing instead", e)
                self._gone.update(await self._gone_since())
                break
            for item in listed:
                found = await self._io.get_json(item["Key"])
                self._gone.update(found[1] if found else ())
        for e in [e for e in self._candidates if e <= epoch.last_done]:
            del self._candidates[e]
        self._applied = max(self._applied, epoch.last_done)

    async def _candidates_of(self, epoch: Epoch) -> frozenset[str] | None:
        """Sweep ``epoch``'s candidates; None when they were cleaned up (it is done)."""
        if epoch.epoch not in self._candidates:
            found = await self._io.get_json(self._paths.candidates(epoch.epoch))
            self._candidates[epoch.epoch] = None if found is None else frozenset(found[1])
        return self._candidates[epoch.epoch]

    async def admit(self, names: Collection[str], what: str) -> None:
        """Return when a manifest newly naming ``names`` may be written now: none of
        them is deleted, nor will be, by any sweep. Raises ``TierUnavailable`` (retry)
        when a sweep keeps it waiting, ``DataLoss`` when a named chunk is gone from the
        bucket and no cache here holds its bytes (the client sends them again)."""
        started = self._clock()
        try:
            await self._admit(frozenset(names), what)
        finally:
            self.observer.gate_wait(self._clock() - started)

    async def _admit(self, names: frozenset[str], what: str) -> None:
        for _ in range(_ROUNDS):
            epoch, sent = await self._current()
            marked: frozenset[str] = frozenset()
            if epoch.state != "done":
                candidates = await self._candidates_of(epoch)
                if candidates is None:  # cleaned up: the read is stale
                    self._last = None
                    continue
                marked = names & candidates
            if marked and epoch.state == "deleting":
                await self._wait_out(epoch, what)
                continue
            await self._verify(names & self._gone, what)
            if marked:  # marking: claim, then make sure the sweep has not moved on
                await asyncio.gather(*(self._io.put(self._paths.claims(epoch.epoch) + key,
                                                    self._node.encode()) for key in marked))
                again, _ = await self._read()
                if (again.epoch, again.state) != (epoch.epoch, "marking"):
                    continue  # judge the claimed chunks against the sweep's new state
            if self._clock() - sent < epoch.spill_bound_s:
                return
            self._last = None  # too slow for that read: read again
        raise TierUnavailable(f"{what}: the fleet's garbage collection kept this spill "
                              "from committing in time: spill again")

    async def _wait_out(self, epoch: Epoch, what: str) -> None:
        """Wait until the sweep deleting now is done (its deletion lists then learnt)."""
        deadline, pause = self._clock() + DELETING_WAIT_S, 0.05
        while self._clock() < deadline:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)
            now, _ = await self._read()
            if (now.epoch, now.state) != (epoch.epoch, "deleting"):
                return
        raise TierUnavailable(f"{what}: the fleet's garbage collection is deleting chunks "
                              "this spill names: spill again shortly")

    async def _verify(self, keys: Collection[str], what: str) -> None:
        """Chunks a sweep deleted that the spill names: each must be in the bucket again
        (written since), or be put back from this node's caches."""
        async def one(key: str) -> None:
            if await self._exists(key) or await self._reupload(key):
                self._gone.discard(key)
                return
            raise DataLoss(f"{what}: chunk {key} was collected from the object store and "
                           "this node holds no copy: spill it again with its bytes")
        await asyncio.gather(*(one(key) for key in keys))
