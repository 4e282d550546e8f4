"""What the scheduler side tells the worker side each step, and what comes back.

Each KV cache group kvtier stores has its own layout and plans (``group``); chunk c of a
request in a group covers its tokens [c * block_size, (c + 1) * block_size) and is held
by one paged block of the group; every plan names a run of chunks from ``first_chunk``
and their blocks, one per chunk, in order. ``token_ids`` run from the request's first
token to the end of the plan's last chunk (chain keys cover every token before a chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class ChunkRun:
    req_id: str
    token_ids: tuple[int, ...]
    first_chunk: int
    block_ids: tuple[int, ...]  # one per chunk, from first_chunk on
    group: int = 0  # the KV cache group (index in vLLM's kv_cache_groups) of the blocks

    @property
    def end_chunk(self) -> int:
        return self.first_chunk + len(self.block_ids)


@dataclass(frozen=True)
class LoadPlan(ChunkRun):
    """Read these chunks and write them into their blocks before this step's attention."""


@dataclass(frozen=True)
class SavePlan(ChunkRun):
    """Blocks that are full after this step's forward: write them as chunks."""


@dataclass(frozen=True)
class SpillPlan:
    """A finished session request: spill its computed KV as the session's next generation."""

    req_id: str
    session_id: str  # as the request named it (layout.rank_session makes a rank's)
    generation: int
    token_ids: tuple[int, ...]  # every token with KV in the cache
    block_ids: tuple[int, ...]  # the blocks holding them, the partial last one included


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM's: not installed where mypy runs
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    spills: list[SpillPlan] = field(default_factory=list)
    # Finished requests whose blocks vLLM keeps until the worker reports them done
    # (get_finished): their saves and spill are in flight.
    delayed: list[str] = field(default_factory=list)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]  # vLLM's: not installed where mypy runs
    """``unsaved``: req_id -> the first token whose chunk the worker did not save (its
    blocks were computed over a prefix that failed to load), in any group: the scheduler
    plans every group's chunks from there again once recomputed."""

    unsaved: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        merged = dict(self.unsaved)
        for req_id, chunk in getattr(other, "unsaved", {}).items():
            merged[req_id] = min(chunk, merged.get(req_id, chunk))
        return KVTierWorkerMetadata(merged)


@dataclass
class KVTierHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]  # vLLM's: not installed where mypy runs
    """What a worker tells the scheduler once, after registering its cache: per stored
    latent group, its layers' bytes per block (``layout.worker_pages``), which the
    scheduler's group spec (its first layer's) does not say."""

    page_bytes: dict[int, tuple[int, ...]] = field(default_factory=dict)
