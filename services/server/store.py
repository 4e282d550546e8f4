"""Open the tier stack a ``ServerConfig`` describes, as one ``TierManager``.

Tiers, highest first: hbm, host, redis, disk, object; a zero capacity (or no Redis URL)
leaves one out. The disk tier's LMDB environment also holds the session manifests and
reference counts, so a server with a disk tier keeps every acknowledged session across
restarts; without one the metadata lives in memory and durable acks are refused.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from kvstore.errors import InvalidRequest
from kvstore.manager import MANAGER_PRESETS, TierManager
from kvstore.policy import HintPolicy, LRUPolicy
from kvstore.tiers.base import MemoryMetaStore, MetaStore, Tier
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.host import HostTier
from services.server.config import ServerConfig

log = logging.getLogger(__name__)


def _preset(presets: dict, name: str, key: str):
    if name not in presets:
        raise InvalidRequest(f"{key} {name!r} is not one of {sorted(presets)}")
    return presets[name]


def build_tiers(config: ServerConfig, tiers: list[Tier]) -> MetaStore:
    """Append the configured tiers to ``tiers`` (so a caller can close what was built if
    a later one fails) and return the MetaStore."""
    meta: MetaStore | None = None
    if config.hbm_bytes:
        tiers.append(HBMTier(config.hbm_bytes))
    if config.host_bytes:
        tiers.append(HostTier(config.host_bytes))
    if config.redis_url:
        from kvstore.tiers.redis import REDIS_PRESETS, RedisTier

        redis_config = _preset(REDIS_PRESETS, config.redis_preset, "redis_preset")
        if config.redis_prefix != redis_config.prefix:
            redis_config = dataclasses.replace(redis_config, prefix=config.redis_prefix)
        tiers.append(RedisTier(config.redis_url, config.redis_bytes, redis_config))
    if config.disk_bytes:
        from kvstore.tiers.disk import DiskTier

        disk = DiskTier(config.data_dir / "disk", config.disk_bytes,
                        segment_bytes=config.disk_segment_bytes)
        tiers.append(disk)
        meta = disk.meta
    if config.object_bytes:
        from kvstore.tiers.object import ObjectTier, ObjectTierConfig

        level = config.object_compression_level
        tiers.append(ObjectTier(config.object_url, config.object_bytes, ObjectTierConfig(
            compression_level=None if level < 0 else level,
            endpoint_url=config.s3_endpoint or None,
            region_name=config.s3_region or None,
        )))
    return meta if meta is not None else MemoryMetaStore()


async def open_manager(config: ServerConfig) -> TierManager:
    """The manager over the configured tiers (closing them again if opening fails)."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    tiers: list[Tier] = []
    try:
        meta = build_tiers(config, tiers)
        log.info("tiers: %s", ", ".join(f"{t.name} ({t.capacity_bytes} B)" for t in tiers))
        policy = HintPolicy if config.eviction == "hint" else LRUPolicy
        return await TierManager.open(tiers, meta, policy=policy, config=_preset(
            MANAGER_PRESETS, config.manager_preset, "manager_preset"))
    except BaseException:
        for tier in tiers:
            await tier.close()
        raise


def tiers_holding(manager: TierManager, keys: Sequence[str]) -> list[str]:
    """Names of the tiers holding at least one of ``keys``, highest first."""
    held = {name for key in keys for name in manager.where(key)}
    return [tier.name for tier in manager.tiers if tier.name in held]


def top_tier(manager: TierManager, keys: Sequence[str]) -> str:
    """The highest tier holding any of ``keys`` ("" when none is held)."""
    names = tiers_holding(manager, keys)
    return names[0] if names else ""


def restore_tier(manager: TierManager, keys: Sequence[str]) -> str:
    """The slowest tier a restore of ``keys`` would read from now ("" when none is held)."""
    order = [tier.name for tier in manager.tiers]
    tops = [order.index(names[0]) for names in map(manager.where, keys) if names]
    return order[max(tops)] if tops else ""
