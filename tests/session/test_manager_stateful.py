"""The tier manager against a plain dict model, driven by Hypothesis (RuleBasedStateMachine).

Real tiers: a small host tier (so eviction moves blocks to disk) over a disk tier in a
fresh directory per example, whose MetaStore holds the manifests. Rules spill (new
sessions, next generations, chunks named by key only, stale generations), delete,
restore (bytes compared with the model), demote, reopen after a clean close, and reopen
after a crash right after a spill (the disk tier closes before the spill's write-back
runs, and host memory is lost).

The model knows per session what must restore exactly: everything until a crash; after
one, only what was acked durable, demoted to disk or written back by a clean close.
Token ids come from a two-letter alphabet so sessions often share chunks (dedupe).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.format.errors import DataLoss, SessionNotFound, StaleGeneration
from kvstore.session.manager import TierManager
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from tests.support.manager import make_session

TENANT = "t"
SESSIONS = ("a", "b", "c")
HOST_BYTES = 2500  # about five 440-byte chunks of the tiny layout: spills evict
DISK_BYTES = 64 << 20

def token_lists(min_size: int) -> st.SearchStrategy[np.ndarray]:
    return st.lists(st.integers(0, 1), min_size=min_size, max_size=56).map(
        lambda ids: np.asarray(ids, dtype=np.uint32))


tokens_st = token_lists(1)


@dataclass
class Stored:
    generation: int
    args: dict  # the spill's keyword arguments: token ids, chunks, tail, window
    exact: bool  # must restore byte for byte (False: a crash may have lost chunks)
    durable: bool  # every chunk is on disk, so it stays exact across a crash
    window: bytes | None  # the window blob if it may still be held (None: gone)


class ManagerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.path = Path(tempfile.mkdtemp(prefix="kvtier-stateful-"))
        self.model: dict[str, Stored] = {}
        self.manager = self.run(self._open())

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def _open(self) -> TierManager:
        self.disk = DiskTier(self.path / "disk", DISK_BYTES, map_size=64 << 20)
        return await TierManager.open([HostTier(HOST_BYTES), self.disk], self.disk.meta)

    def teardown(self) -> None:
        try:
            self.run(self.manager.close())
        finally:
            self.run(self._stop_leftovers())
            self.loop.close()
            shutil.rmtree(self.path, ignore_errors=True)

    @staticmethod
    async def _stop_leftovers() -> None:
        """Cancel what a crashed manager left running (its write-back workers)."""
        leftovers = asyncio.all_tasks() - {asyncio.current_task()}
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)

    # -- spills --

    async def _spill(self, sid, tokens, window, ack, step) -> None:
        old = self.model.get(sid)
        generation = old.generation + step if old else step - 1
        args = make_session(tokens, window=window)
        await self.manager.spill(TENANT, sid, generation=generation, ack=ack, **args)
        self.model[sid] = Stored(generation, args, exact=True, durable=ack == "durable",
                                 window=args["window"])

    @rule(sid=st.sampled_from(SESSIONS), tokens=tokens_st, window=st.booleans(),
          ack=st.sampled_from(["memory", "durable"]), step=st.integers(1, 2))
    def spill(self, sid, tokens, window, ack, step):
        self.run(self._spill(sid, tokens, window, ack, step))

    @precondition(lambda self: any(s.exact for s in self.model.values()))
    @rule(data=st.data(), extra=tokens_st, ack=st.sampled_from(["memory", "durable"]))
    def spill_extending_by_key(self, data, extra, ack):
        """The next generation of a session that kept growing: the chunks it already
        stored are named by key only."""
        sid = data.draw(st.sampled_from(sorted(s for s, v in self.model.items() if v.exact)))
        old = self.model[sid]
        args = make_session(np.concatenate([old.args["token_ids"], extra]))
        held = {key for key, _ in old.args["chunks"]}
        sent = dict(args, chunks=[(key, None if key in held else data_)
                                  for key, data_ in args["chunks"]])
        self.run(self.manager.spill(TENANT, sid, generation=old.generation + 1, ack=ack,
                                    **sent))
        self.model[sid] = Stored(old.generation + 1, args, exact=True,
                                 durable=ack == "durable", window=args["window"])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), back=st.integers(0, 1))
    def stale_spill_is_refused(self, data, back):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        stored = self.model[sid]
        tokens = np.asarray([1, 0, 1], dtype=np.uint32)
        if np.array_equal(tokens, stored.args["token_ids"]):
            tokens = tokens[:2]  # the same content at its generation is a retry, answered
        args = make_session(tokens)
        try:
            self.run(self.manager.spill(TENANT, sid, generation=max(0, stored.generation - back),
                                        **args))
        except StaleGeneration:
            return
        raise AssertionError("a spill of an old generation was accepted")

    # -- reads and removals --

    @rule(sid=st.sampled_from(SESSIONS))
    def restore(self, sid):
        stored = self.model.get(sid)
        try:
            result = self.run(self.manager.restore(TENANT, sid))
        except SessionNotFound:
            assert stored is None, f"{sid} was lost"
            return
        except DataLoss:
            assert stored is not None and not stored.exact, f"{sid} lost chunks"
            return
        assert stored is not None, f"{sid} came back from the dead"
        args = stored.args
        assert result.manifest.generation == stored.generation
        assert np.array_equal(result.manifest.token_ids, args["token_ids"])
        assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in args["chunks"]]
        assert result.manifest.tail == bytes(args["tail"])
        if result.window is not None:
            assert stored.window is not None and bytes(result.window) == stored.window
        assert result.replay_needed == (result.window is None)
        stored.exact = True  # every chunk was found intact, so it is still held

    @rule(sid=st.sampled_from(SESSIONS))
    def delete(self, sid):
        stored = self.model.pop(sid, None)
        try:
            result = self.run(self.manager.delete(TENANT, sid))
        except SessionNotFound:
            assert stored is None, f"{sid} was lost"
            return
        assert stored is not None, f"{sid} came back from the dead"
        assert result.chunks_released == len(stored.args["chunks"])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def demote_to_disk(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        stored = self.model[sid]
        self.run(self.manager.drain())  # no promotion from an earlier restore runs during it
        try:
            manifest = self.run(self.manager.demote(TENANT, sid, "disk"))
        except DataLoss:
            assert not stored.exact, f"{sid} lost chunks"
            return
        assert manifest.window_tier is None  # disk holds no windows
        assert all(self.manager.where(key) == ["disk"] for key in manifest.chunk_keys)
        stored.window = None
        stored.exact = stored.durable = True

    # -- restarts --

    @rule()
    def reopen_after_close(self):
        self.run(self.manager.close())  # drains write-back: every chunk reaches disk
        self.manager = self.run(self._open())
        for stored in self.model.values():
            stored.window = None  # it lived in host memory
            stored.durable = stored.exact

    @precondition(lambda self: all(stored.window is None for stored in self.model.values()))
    @rule(sid=st.sampled_from(SESSIONS), tokens=token_lists(16),  # a chunk or more to lose
          ack=st.sampled_from(["memory", "durable"]))
    def spill_then_crash(self, sid, tokens, ack):
        """The process dies as soon as a spill returns: the disk tier closes before any
        other task runs, so the spill's write-back never happens and only a durable ack
        promises its chunks.

        The crash starts from a quiet manager (drained, no window that an eviction could
        drop and record): DiskTier.close deadlocks if another task starts an index commit
        while it closes, which is the disk tier's to fix, not this model's to hit.
        """
        async def spill_and_die() -> None:
            await self.manager.drain()
            await self._spill(sid, tokens, False, ack, 1)
            await self.disk.close()

        self.run(spill_and_die())
        self.manager = self.run(self._open())
        for stored in self.model.values():
            stored.exact = stored.durable
        self.restore(sid)  # the promise just made: exact if acked durable

    @invariant()
    def sessions_match_the_model(self):
        assert self.manager.session_count() == len(self.model)
        listed = self.run(self.manager.list_sessions(TENANT))
        assert {m.session_id: m.generation for m in listed} == {
            sid: stored.generation for sid, stored in self.model.items()}


ManagerModel.TestCase.settings = settings(
    max_examples=50, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerModel = ManagerModel.TestCase
