"""The connector's worker side (each worker process): loads before attention, saves after
it, spills at a session's end, and what vLLM is told back.

Per step: ``start_load_kv`` starts this step's loads in background threads;
``wait_for_layer_load(layer)`` waits only until that layer's blocks are written, so the
forward pass runs layer ``l`` while later layers are still being written.

Saving never slows the engine: on the forward path the worker only copies blocks out, one
gather per layer for all of the step's save plans (``save_kv_layer``) and one per layer for
each spill of a finished session (``wait_for_save``); encoding and writing run on one
background thread behind a queue of ``save_queue_depth`` jobs, in order, so a session
spills only after its saves. A save that finds the queue full, or kvtier down, is skipped
and counted (``saves_skipped``), never waited on, and the request's later saves are
skipped too (a chunk after a gap is never found). A request's saves of a step whose load
failed are dropped (their blocks were computed over blocks that are to be recomputed) and
reported back (``unsaved``). Since every save works on copies, no block is held for one: a
finished session request's blocks are released (``get_finished``) in the step that copies
them for its spill, whether the spill is queued or skipped. While kvtier is down no block
is copied for a save at all. The writer and the client's event loop run off the cores
vLLM binds the forward to when the machine has others, the writer below the engine's
priority (``off_forward_cores``); loads stay there, as the forward waits for them.
``get_block_ids_with_load_errors`` names every block that did not load.

Each KV cache group kvtier stores has its own ``transfers.Store`` (its layout, its layers,
its paged layout); plans name their group. A group the engine rebuilds has none: its
layers are neither loaded nor saved.

Layers without per-layer hooks: vLLM calls ``wait_for_layer_load`` and ``save_kv_layer``
only from its own attention ops, which some layers never run (DeepSeek-V4's caches, an
MLA layer that calls its backend directly). A layer is taken as hooked once a hook named
it; until then a load of its group is waited for in ``start_load_kv``, before the forward
pass, and its blocks are copied out in ``wait_for_save``, after it (the step's KV is
then in the cache, and its blocks are the request's until the step's output is back).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from vllm.logger import init_logger

from kvtier.integrations.breaker import Link
from kvtier.integrations.vllm.layout import CacheShape, rank_session
from kvtier.integrations.vllm.metadata import (
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    SavePlan,
)
from kvtier.integrations.vllm.repack import PagedLayout
from kvtier.integrations.vllm.stats import KVTierStats, StatsCounter
from kvtier.integrations.vllm.transfers import LoadJob, Store, run_load, run_save, run_spill

logger = init_logger("vllm." + __name__)  # under vLLM's logger: its format and level

# ``run_save``'s arguments: the group's store, the plan, its blocks' copies per layer, and
# the CUDA event after which the copies are complete (None on the CPU)
Save = tuple[Store, SavePlan, list[torch.Tensor], torch.cuda.Event | None]
# the ``transfers.Store`` of a stored group's registered layers (group, layers, the layers'
# paged layout, the counters it adds to)
StoreFactory = Callable[[CacheShape, list[torch.Tensor], PagedLayout, StatsCounter], Store]



# The save thread yields to the engine's threads where they share a core: saves are
# never waited on, while every step is.
SAVE_NICENESS = 5


def off_forward_cores(forward: set[int] | None, niceness: int = 0) -> None:
    """Run the calling thread on CPUs outside ``forward`` (the cores vLLM bound the forward
    thread to; None: it bound none, nothing moves) when the machine has others, and
    ``niceness`` below the engine's threads. vLLM's CPU worker binds its forward thread to
    its cores and every thread it starts inherits that binding, so kvtier's background
    work would otherwise share the forward's own core."""
    others = set(range(os.cpu_count() or 1)) - forward if forward else set()
    if others and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):  # none of them allowed to this process: stay
            os.sched_setaffinity(0, others)  # 0: this thread alone
    if niceness:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


async def _run_off_forward_cores(forward: set[int] | None) -> None:
    off_forward_cores(forward)


def save_all(saves: list[Save]) -> bool:
    """``run_save`` of each (store, plan, blocks, ready) in order; whether all were
    written (each is tried, whatever the others did)."""
    return all([run_save(*save) for save in saves])


def recorded(tensors: list[torch.Tensor]) -> torch.cuda.Event | None:
    """A CUDA event after the work queued so far on this thread's stream (None on the
    CPU, where it is done): a background thread waits on it before it touches
    ``tensors`` (the save thread before reading block copies, a load before writing
    blocks vLLM zeroes first)."""
    if not tensors[0].is_cuda:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves its __new__ unannotated
    event.record()
    return event


class WorkerSide:
    def __init__(self, store_of: StoreFactory, groups: list[CacheShape], rank: int,
                 paged: dict[int, PagedLayout], link: Link, *, queue_depth: int,
                 saves: bool = True, forward_cores: set[int] | None = None) -> None:
        """``store_of(group, layers, paged, stats)``: the ``transfers.Store`` of a stored group's
        registered layers; ``groups``: the stored groups; ``paged``: per group, the layout
        of this rank's cache layers; ``link``: this worker's kvtier link (saves are skipped
        while it is down); ``queue_depth``: saves and spills that may wait for the writer;
        ``saves``: whether the engine's ``kv_role`` saves; ``forward_cores``: the CPUs
        vLLM bound the forward thread to (None: unbound), which kvtier's threads keep off
        (``off_forward_cores``)."""
        self.groups = groups
        self.shape = groups[0]  # a session's group (sessions: one full group only)
        self.rank = rank
        self.paged = paged
        self.link = link
        self.saves = saves
        self._store_of = store_of
        self.stores: dict[int, Store] = {}
        self._layer_index: dict[str, tuple[int, int]] = {}  # name -> (group, layer)
        self._names: dict[int, list[str]] = {}  # group -> its layers' names, in order
        self._hooked: set[str] = set()  # layers a per-layer hook has named
        self._loads: list[LoadJob] = []
        # this step's saves, per group: every plan's blocks, in plan order, copied per layer
        self._step_meta: KVTierConnectorMetadata | None = None
        self._step_index: dict[int, torch.Tensor] = {}
        self._staged: dict[int, list[torch.Tensor | None]] = {}
        self._step_down = False  # kvtier was down at the step's first layer: no copies
        self.stats = StatsCounter()  # every group's transfers
        self._unsaved: dict[str, int] = {}  # req_id -> the first token not saved
        self._abandoned: set[str] = set()  # requests a save was skipped of
        self._released: set[str] = set()  # finished requests whose blocks were copied
        self._forward_cores = forward_cores
        # loads stay on the forward's cores: the forward waits for them there
        self._load_pool = ThreadPoolExecutor(2, thread_name_prefix="kvtier-load")
        # the client's event loop thread: a save's digests and gRPC work run there
        link.client.submit(_run_off_forward_cores(self._forward_cores))
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(queue_depth)
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name="kvtier-save")
        self._writer.start()

    @property
    def store(self) -> Store:
        """The first stored group's store (a session's), once the caches are registered."""
        return self.stores[self.shape.group]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor],
                           layer_index: Callable[[str], int]) -> None:
        """``layer_index(name)``: the layer number of an attention layer's name. A group's
        layers are taken in its order (``layout.cache_groups`` sorts them by layer
        number); every registered one by layer number when it names none."""
        for group in self.groups:
            names = list(group.layer_names) or sorted(kv_caches, key=layer_index)
            missing = [n for n in names if n not in kv_caches]
            if missing or len(names) != group.layers:
                raise ValueError(f"kvtier connector: group {group.group}'s layers "
                                 f"{missing or names} are not the {group.layers} registered")
            paged = self.paged[group.group]
            self._names[group.group] = names
            for i, name in enumerate(names):
                paged.check(kv_caches[name], group.page_bytes[i] if group.page_bytes else 0)
                self._layer_index[name] = (group.group, i)
            self.stores[group.group] = self._store_of(group, [kv_caches[n] for n in names],
                                                      paged, self.stats)

    # -- loads --

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        queued = recorded(self.store.layers) if meta.loads else None
        for plan in meta.loads:
            store = self.stores[plan.group]
            job = LoadJob.of(plan, len(store.layers), queued)
            self._loads.append(job)
            self._load_pool.submit(run_load, store, job)
        for job in self._loads:
            if not self._hooked.issuperset(self._names[job.plan.group]):
                job.done.wait()  # no hook waits for it: done before the forward pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._hooked.add(layer_name)
        where = self._layer_index.get(layer_name)
        for job in self._loads:
            if where is None:
                job.done.wait()
            elif job.plan.group == where[0]:
                job.layer_ready[where[1]].wait()

    def _loads_done(self) -> list[LoadJob]:
        for job in self._loads:
            job.done.wait()
        return self._loads

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = {block for job in self._loads_done() for block in job.failed_blocks}
        self._loads = []
        return failed

    # -- saves, spills --

    def save_kv_layer(self, meta: KVTierConnectorMetadata, layer_name: str,
                      kv_layer: torch.Tensor) -> None:
        self._hooked.add(layer_name)
        where = self._layer_index.get(layer_name)
        if where is None or not meta.saves or not self.saves:
            return
        self._begin_step(meta)
        group, index = where
        if group in self._step_index and self._step_index[group].numel():
            self._staged[group][index] = self.paged[group].take(kv_layer,
                                                                self._step_index[group])

    def _begin_step(self, meta: KVTierConnectorMetadata) -> None:
        """The step's save blocks per group, in plan order, once per step."""
        if self._step_meta is meta:
            return
        self._step_meta = meta
        # kvtier down: the step's saves are skipped (``wait_for_save``), so no block is
        # copied for them
        self._step_down = not self.link.up
        self._step_index = {} if self._step_down else {
            g: store.block_index([b for plan in meta.saves if plan.group == g
                                  for b in plan.block_ids])
            for g, store in self.stores.items()}
        self._staged = {g: [None] * len(store.layers) for g, store in self.stores.items()}

    def _take_unhooked(self, meta: KVTierConnectorMetadata) -> None:
        """After the forward pass: the save blocks of every layer no hook ever named."""
        if not meta.saves or not self.saves:
            return
        self._begin_step(meta)
        for g, store in self.stores.items():
            if g not in self._step_index or not self._step_index[g].numel():
                continue
            for i, name in enumerate(self._names[g]):
                if name not in self._hooked:
                    self._staged[g][i] = self.paged[g].take(store.layers[i],
                                                            self._step_index[g])

    def wait_for_save(self, meta: KVTierConnectorMetadata) -> None:
        failed_loads = {job.plan.req_id for job in self._loads_done()
                        if job.first_failed_chunk is not None}
        self._take_unhooked(meta)
        staged = self._staged if self._step_meta is meta else {}
        down = self._step_down and self._step_meta is meta
        at = dict.fromkeys(self.stores, 0)
        batches: dict[str, list[Save]] = {}  # req_id -> its saves of every group: one job
        for plan in meta.saves:
            if down:  # nothing was copied: skipped as while kvtier is down, one per request
                batches.setdefault(plan.req_id, [])
                continue
            group = self.stores[plan.group]
            count = len(plan.block_ids)
            at[plan.group] += count
            staged_layers = staged.get(plan.group, [])
            layers = [t for t in staged_layers if t is not None]
            if plan.req_id in failed_loads or not layers or len(layers) < len(staged_layers):
                # computed over blocks that failed to load, or not every layer ran: the
                # scheduler plans them again from this token on
                token = plan.first_chunk * group.block_size
                self._unsaved[plan.req_id] = min(token, self._unsaved.get(plan.req_id, token))
                continue
            dim = self.paged[plan.group].block_dim
            raw = [t.narrow(dim, at[plan.group] - count, count) for t in layers]
            batches.setdefault(plan.req_id, []).append((group, plan, raw, recorded(raw)))
        for req_id, saves in batches.items():
            if down:
                self._skip(req_id)
            elif self._may_queue(req_id):
                self._offer(req_id, partial(save_all, saves))
        self._step_meta, self._step_index, self._staged = None, {}, {}
        self._step_down = False
        for spill in meta.spills:
            if self._may_queue(spill.req_id):
                index = self.store.block_index(spill.block_ids)
                raw = [self.store.paged.take(layer, index) for layer in self.store.layers]
                self._offer(spill.req_id, partial(
                    run_spill, self.store, spill,
                    rank_session(spill.session_id, self.shape, self.rank), raw, recorded(raw)))
        # every spill's blocks are copied (or its spill skipped): vLLM may free them now
        self._released.update(meta.delayed)

    def _may_queue(self, req_id: str) -> bool:
        """Whether a save of ``req_id`` may be offered: not while kvtier is down, nor after
        one of its saves was skipped (counted when it is not)."""
        if req_id in self._abandoned or not self.link.up or self._jobs.full():
            self._skip(req_id)
            return False
        return True

    def _skip(self, req_id: str) -> None:
        """A save of ``req_id`` skipped (counted), and its later saves with it."""
        self._abandoned.add(req_id)
        self.stats.add(saves_skipped=1)

    def _offer(self, req_id: str, work: Callable[[], bool]) -> None:
        """Queue ``work()`` for the writer, or skip it (counted) if the queue filled
        meanwhile: never wait."""
        try:
            self._jobs.put_nowait(lambda: self._report(work()))
        except queue.Full:
            self._skip(req_id)

    def _report(self, ok: bool) -> None:
        if ok:
            self.link.succeeded()
        else:
            self.link.failed("save", RuntimeError("a save or spill failed"))

    def _write_loop(self) -> None:
        off_forward_cores(self._forward_cores, SAVE_NICENESS)
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a bug in a job must not stop every later save
                logger.exception("kvtier save job failed")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        self._abandoned -= finished_req_ids
        done, self._released = self._released, set()
        return done or None, None

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        if not self._unsaved:
            return None
        meta, self._unsaved = KVTierWorkerMetadata(self._unsaved), {}
        return meta

    def take_stats(self) -> KVTierStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        self._load_pool.shutdown(wait=True)
        # the queued saves land first, for a bounded time (the server may hang)
        store = self.stores.get(self.shape.group)
        bound = store.config.timeout_s if store is not None else 1
        with contextlib.suppress(queue.Full):
            self._jobs.put(None, timeout=bound)
        self._writer.join(timeout=bound)
        self.link.close()
