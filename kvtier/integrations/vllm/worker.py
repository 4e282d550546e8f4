"""The connector's worker side (each worker process): loads before attention, saves after
it, spills at a session's end, and what vLLM is told back.

Per step: ``start_load_kv`` starts this step's loads in background threads;
``wait_for_layer_load(layer)`` waits only until that layer's blocks are written, so the
forward pass runs layer ``l`` while later layers are still being written;
``save_kv_layer`` copies the blocks a save plan names out of each layer as attention
leaves it (a copy, so vLLM may reuse the blocks at once); ``wait_for_save`` queues the
step's saves and spills on one background thread, in order, so a session spills only after
its saves. A request's saves of a step whose load failed are dropped (their blocks were
computed over blocks that are to be recomputed) and reported back (``unsaved``).
``get_block_ids_with_load_errors`` names every block that did not load; ``get_finished``
reports a finished request once its saves and spill are done, and only then does vLLM free
its blocks.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.integrations.vllm.layout import CacheShape, rank_session
from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.repack import PagedLayout
from kvtier.integrations.vllm.stats import KVTierStats
from kvtier.integrations.vllm.transfers import LoadJob, Store, run_load, run_save, run_spill


def recorded(tensors: list[torch.Tensor]):
    """A CUDA event after the work queued so far on this thread's stream (None on the
    CPU, where it is done): a background thread waits on it before it touches
    ``tensors`` (the save thread before reading block copies, a load before writing
    blocks vLLM zeroes first)."""
    if not tensors[0].is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class WorkerSide:
    def __init__(self, store_of, shape: CacheShape, rank: int, paged: PagedLayout) -> None:
        """``store_of(layers, paged)``: the ``transfers.Store`` of the registered cache;
        ``paged``: the layout of this rank's cache layers."""
        self.shape = shape
        self.rank = rank
        self.paged = paged
        self._store_of = store_of
        self.store: Store | None = None
        self._layer_index: dict[str, int] = {}
        self._loads: list[LoadJob] = []
        self._staged: dict[str, list[torch.Tensor | None]] = {}
        self._unsaved: dict[str, int] = {}
        self._load_pool = ThreadPoolExecutor(2, thread_name_prefix="kvtier-load")
        self._save_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-save")
        self._lock = threading.Lock()
        self._pending: dict[str, int] = defaultdict(int)  # req_id -> saves/spills queued
        self._delayed: set[str] = set()
        self._finished: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layer_index) -> None:
        """``layer_index(name)``: the layer number of an attention layer's name."""
        names = sorted(kv_caches, key=layer_index)
        if len(names) != self.shape.layers:
            raise ValueError(f"kvtier connector: {len(names)} KV cache layers registered, the "
                             f"layout has {self.shape.layers}")
        for name in names:
            self.paged.check(kv_caches[name])
        self._layer_index = {name: i for i, name in enumerate(names)}
        self.store = self._store_of([kv_caches[n] for n in names], self.paged)

    # -- loads --

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        queued = recorded(self.store.layers) if meta.loads else None
        for plan in meta.loads:
            job = LoadJob.of(plan, self.shape.layers, queued)
            self._loads.append(job)
            self._load_pool.submit(run_load, self.store, job)

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        for job in self._loads:
            if index is None:
                job.done.wait()
            else:
                job.layer_ready[index].wait()

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
        index = self._layer_index.get(layer_name)
        if index is None or not meta.saves:
            return
        for plan in meta.saves:
            staged = self._staged.setdefault(plan.req_id, [None] * self.shape.layers)
            staged[index] = self.paged.take(kv_layer, self.store.block_index(plan.block_ids))

    def wait_for_save(self, meta: KVTierConnectorMetadata) -> None:
        failed_loads = {job.plan.req_id: job.first_failed_chunk for job in self._loads_done()
                        if job.first_failed_chunk is not None}
        for plan in meta.saves:
            raw = self._staged.pop(plan.req_id, None)
            if plan.req_id in failed_loads or raw is None or any(r is None for r in raw):
                # computed over blocks that failed to load, or not every layer ran
                self._unsaved[plan.req_id] = min(plan.first_chunk,
                                                 self._unsaved.get(plan.req_id, plan.first_chunk))
                continue
            self._queue(plan.req_id, run_save, self.store, plan, raw, recorded(raw))
        self._staged.clear()
        for plan in meta.spills:
            self._queue(plan.req_id, run_spill, self.store, plan,
                        rank_session(plan.session_id, self.shape, self.rank))
        with self._lock:
            self._delayed.update(meta.delayed)

    def _queue(self, req_id: str, work, *args) -> None:
        with self._lock:
            self._pending[req_id] += 1

        def run() -> None:
            try:
                work(*args)
            finally:
                with self._lock:
                    self._pending[req_id] -= 1
                    if not self._pending[req_id]:
                        del self._pending[req_id]

        self._save_pool.submit(run)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        with self._lock:
            # A delayed request's id comes in the same step as its delay (wait_for_save
            # runs first): only those are kept.
            self._finished = (self._finished | finished_req_ids) & self._delayed
            done = {r for r in self._finished if r not in self._pending}
            self._delayed -= done
            self._finished -= done
        return done or None, None

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        if not self._unsaved:
            return None
        meta, self._unsaved = KVTierWorkerMetadata(self._unsaved), {}
        return meta

    def take_stats(self) -> KVTierStats | None:
        return self.store.stats.take() if self.store is not None else None

    def shutdown(self) -> None:
        self._load_pool.shutdown(wait=True)
        self._save_pool.shutdown(wait=True)
