"""``KVTierConnector``: kvtier as a vLLM v1 KV connector (``KVConnectorBase_V1``, HMA).

    KVTransferConfig(kv_connector="KVTierConnector",
                     kv_connector_module_path="kvtier.integrations.vllm", kv_role="kv_both",
                     kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"server": "127.0.0.1:50051",
                                                "model_fingerprint": "..."})

vLLM makes one instance per role: the scheduler's (``scheduler.SchedulerSide``) in the
engine core, a worker's (``worker.WorkerSide``) in each worker; this class hands every hook
to its side. The settings are checked as the connector is built (``config``: a
``ValueError`` naming the key). Neither side waits for kvtier: each has a ``breaker.Link``
that registers its layouts in the background once the server answers (and again after an
outage or a restart); until then the engine serves by recomputing, and vLLM's log says so.
``kv_role`` decides what runs: ``kv_consumer`` loads only, ``kv_producer`` saves only.

A latent (MLA) group's layout names its layers' page sizes, which only the workers know
(the scheduler's spec of a group is its first layer's: DeepSeek-V4's global group holds
layers of three page sizes). Each worker tells them once after registering its cache
(``get_handshake_metadata``, ``KVTierHandshake``), and the scheduler side starts when
vLLM's engine core hands them over (``set_xfer_handshake_metadata``), before its first
step; until then, or without them, every lookup is a miss and nothing is saved.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.format.layout import LayoutSpec
from kvtier.integrations.breaker import Link
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.layout import (
    PAGE,
    CacheShape,
    cache_groups,
    check_arrangement,
    group_line,
    hit_alignment,
    rank_layout,
    with_worker_pages,
    worker_pages,
)
from kvtier.integrations.vllm.metadata import (
    KVTierConnectorMetadata,
    KVTierHandshake,
    KVTierWorkerMetadata,
)
from kvtier.integrations.vllm.repack import PagedLayout, layout_kind
from kvtier.integrations.vllm.scheduler import (
    AllocatedBlocks,
    ConnectorOutput,
    EngineRequest,
    SchedulerOutput,
    SchedulerSide,
)
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats, StatsCounter
from kvtier.integrations.vllm.transfers import Store
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.sync import Client
from kvtier.types import RetryPolicy

logger = init_logger("vllm." + __name__)  # under vLLM's logger: its format and level

# A lookup has milliseconds (lookup_timeout_ms): one quick retry at most.
SCHEDULER_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.005, max_backoff_s=0.05)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]  # vLLM's: not installed where mypy runs
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: Any, role: KVConnectorRole,  # vLLM's configs
                 kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config or {})
        if transfer.kv_load_failure_policy != "recompute":
            logger.warning("kvtier connector: kv_load_failure_policy is %r: a block that "
                           "fails to load fails its request; set 'recompute' to recompute it",
                           transfer.kv_load_failure_policy)
        self.loads: bool = transfer.is_kv_consumer
        self.saves: bool = transfer.is_kv_producer
        groups = cache_groups(vllm_config, kv_cache_config)
        self.groups = [g for g in groups if g.stored]
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._all_groups = groups
            self._alignment = hit_alignment(groups, kv_cache_config)
            if waiting := worker_pages(self.groups):
                logger.info("kvtier connector: latent groups %s: their layouts wait for "
                            "the workers' page sizes", sorted(waiting))
            else:
                self._start_scheduler(groups)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            from vllm.platforms import current_platform

            self._rank = get_tensor_model_parallel_rank()
            self._specs = {g.group: rank_layout(g, self._rank, self.config.value_format)
                           for g in self.groups}
            self._is_cpu = current_platform.is_cpu()

    def _start_scheduler(self, groups: list[CacheShape]) -> None:
        """The scheduler side over ``groups``, each stored one's layouts known."""
        self.groups = [g for g in groups if g.stored]
        layouts = {g.group: [rank_layout(g, r, self.config.value_format)
                             for r in range(g.tp_size)] for g in self.groups}
        every = [spec for specs in layouts.values() for spec in specs]
        self._scheduler = SchedulerSide(self.config, groups, layouts,
                                        self._link(every, SCHEDULER_RETRY),
                                        alignment=self._alignment, loads=self.loads,
                                        saves=self.saves)
        logger.info("kvtier connector: server %s, tenant %s, layouts %s, model "
                    "fingerprint %s, value format %s, kv_role %s (%s); groups: %s",
                    self.config.server, self.config.tenant,
                    ", ".join(specs[0].layout_id for specs in layouts.values()),
                    self.config.model_fingerprint, self.config.value_format,
                    self._kv_transfer_config.kv_role,
                    " and ".join(w for w, on in (("loads", self.loads),
                                                 ("saves", self.saves)) if on),
                    "; ".join(group_line(g) for g in groups))

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """The workers' latent page sizes (rank 0's: latent groups run on one rank):
        the scheduler side starts with them."""
        if self._scheduler is not None or self.role != KVConnectorRole.SCHEDULER:
            return
        sent = [m for _, m in sorted(metadata.items()) if isinstance(m, KVTierHandshake)]
        if not sent:
            logger.warning("kvtier connector: the workers sent no page sizes: latent "
                           "groups cannot be kept, every lookup is a miss")
            return
        self._start_scheduler(with_worker_pages(self._all_groups, sent[0].page_bytes))

    def get_handshake_metadata(self) -> KVTierHandshake | None:
        """This worker's latent groups' page sizes, for the scheduler; None without any."""
        pages = worker_pages(self.groups)
        return KVTierHandshake(pages) if pages else None

    def _link(self, layouts: Sequence[LayoutSpec], retry: RetryPolicy) -> Link:
        client = Client(self.config.server, retry=retry, **self.config.client_options())
        return Link(client, layouts, server=self.config.server,
                    failures=self.config.breaker_failures,
                    probe_interval_s=self.config.probe_interval_s, logger=logger)

    # -- worker side --

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        context = self._vllm_config.compilation_config.static_forward_context
        paged = {}
        for group in self.groups:
            names = [n for n in group.layer_names if n in kv_caches] or list(kv_caches)
            stream = self._specs[group.group].streams[0]
            pages = stream.format == PAGE
            if pages and group.arrangement != "raw":
                check_arrangement(group, [context[n] for n in names if n in context])
            paged[group.group] = PagedLayout(
                layout_kind(self._is_cpu, kv_caches[names[0]], group.arrangement),
                stream.entry_shape[0], group.head_size, group.block_size, pages=pages)
        self._link_w = self._link(list(self._specs.values()), RetryPolicy())
        # vLLM's CPU worker binds this (the forward's) thread to its cores
        bound = os.sched_getaffinity(0) if self._is_cpu and hasattr(os, "sched_getaffinity") \
            else None
        self._worker = WorkerSide(self._store_of, self.groups, self._rank, paged,
                                  self._link_w, queue_depth=self.config.save_queue_depth,
                                  saves=self.saves, forward_cores=bound)
        self._worker.register_kv_caches(kv_caches, extract_layer_index)

    def _store_of(self, group: CacheShape, layers: list[torch.Tensor], paged: PagedLayout,
                  stats: StatsCounter) -> Store:
        return Store(self._link_w.client, self.config, self._specs[group.group], paged,
                     layers, group.dtype, stats)

    @property
    def _worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker hook on the scheduler or before registration"
        return self._worker

    def start_load_kv(self, forward_context: object, **kwargs: object) -> None:
        self._worker_side.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object,
                      **kwargs: object) -> None:
        self._worker_side.save_kv_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker_side.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        return self._worker_side.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        return self._worker_side.build_connector_worker_meta()

    def get_kv_connector_stats(self) -> KVTierStats | None:
        side = self._scheduler if self._scheduler is not None else self._worker
        return side.take_stats() if side is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def _meta(self) -> KVTierConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        return meta

    # -- scheduler side --

    # Until the scheduler side has started (``set_xfer_handshake_metadata``): a miss,
    # nothing planned.

    def get_num_new_matched_tokens(self, request: EngineRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: EngineRequest, blocks: AllocatedBlocks,
                                 num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> KVTierConnectorMetadata:
        if self._scheduler is None:
            return KVTierConnectorMetadata()
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: ConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: EngineRequest, block_ids: list[int]
                         ) -> tuple[bool, dict[str, str | int] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: EngineRequest,
                                    block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, str | int] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request, block_ids)

    # -- metrics --

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats:
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any,  # vLLM's
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
