"""``KVTierConnector``: kvtier as a vLLM v1 KV connector (``KVConnectorBase_V1``, HMA).

    KVTransferConfig(kv_connector="KVTierConnector",
                     kv_connector_module_path="kvtier.integrations.vllm", kv_role="kv_both",
                     kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"server": "127.0.0.1:50051",
                                                "model_fingerprint": "..."})

vLLM makes one instance per role: the scheduler's (``scheduler.SchedulerSide``) in the
engine core, a worker's (``worker.WorkerSide``) in each worker; this class hands every hook
to its side. Both register their layouts with the server at start (``layout``): a server
that cannot be reached or refuses them stops the engine from starting.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.layout import PAGE, cache_shape, check_arrangement, rank_layout
from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata
from kvtier.integrations.vllm.repack import PagedLayout, layout_kind
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats, StatsCounter
from kvtier.integrations.vllm.transfers import Store
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.sync import Client
from kvtier.types import RetryPolicy

logger = logging.getLogger(__name__)

# The scheduler waits on its lookups: a store that does not answer soon is a miss.
SCHEDULER_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.05, max_backoff_s=0.2)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config or {})
        if transfer.kv_load_failure_policy != "recompute":
            logger.warning("kvtier connector: kv_load_failure_policy is %r: a block that "
                           "fails to load fails its request; set 'recompute' to recompute it",
                           transfer.kv_load_failure_policy)
        self.shape = cache_shape(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            layouts = [rank_layout(self.shape, r, self.config.value_format)
                       for r in range(self.shape.tp_size)]
            client = self._client(SCHEDULER_RETRY)
            for spec in layouts:
                client.register_layout(spec)
            self._scheduler = SchedulerSide(self.config, self.shape, layouts, client)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            from vllm.platforms import current_platform

            self._rank = get_tensor_model_parallel_rank()
            self._spec = rank_layout(self.shape, self._rank, self.config.value_format)
            self._client_w = self._client(RetryPolicy())
            self._client_w.register_layout(self._spec)
            self._is_cpu = current_platform.is_cpu()

    def _client(self, retry: RetryPolicy) -> Client:
        return Client(self.config.server, retry=retry, **self.config.client_options())

    # -- worker side --

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        first = next(iter(kv_caches.values()))
        stream = self._spec.streams[0]
        pages = stream.format == PAGE
        if pages:
            context = self._vllm_config.compilation_config.static_forward_context
            check_arrangement(self.shape, [context[n] for n in kv_caches if n in context])
        paged = PagedLayout(layout_kind(self._is_cpu, first), stream.entry_shape[0],
                            self.shape.head_size, self.shape.block_size, pages=pages)
        self._worker = WorkerSide(self._store_of, self.shape, self._rank, paged)
        self._worker.register_kv_caches(kv_caches, extract_layer_index)

    def _store_of(self, layers, paged) -> Store:
        return Store(self._client_w, self.config, self._spec, paged, layers, self.shape.dtype,
                     StatsCounter())

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_kv_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self._worker.build_connector_worker_meta()

    def get_kv_connector_stats(self) -> KVTierStats | None:
        side = self._scheduler if self._scheduler is not None else self._worker
        return side.take_stats() if side is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        client = self._scheduler.client if self._scheduler is not None \
            else getattr(self, "_client_w", None)
        if client is not None:
            client.close()

    def _meta(self) -> KVTierConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        return meta

    # -- scheduler side --

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVTierConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict | None]:
        return self._scheduler.request_finished(request, block_ids[0])

    # -- metrics --

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats:
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
