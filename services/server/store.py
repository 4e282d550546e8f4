"""Open the tier stack a ``ServerConfig`` describes, as one ``TierManager``.

Tiers, highest first: hbm, host, redis, disk, object; a zero capacity (or no Redis URL)
leaves one out. The disk tier's LMDB environment also holds the session manifests and
reference counts, so a server with a disk tier keeps every acknowledged session across
restarts; without one the metadata lives in memory and durable acks are refused.

With an encryption key configured (``encryption_key_file`` or ``KVTIER_ENCRYPTION_KEY``)
the redis, disk and object tiers and the disk MetaStore's manifests are encrypted
(``kvstore.encryption.tiers``); hbm and host never leave the process and stay in clear.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.eviction.policies import HintPolicy, LRUPolicy
from kvstore.eviction.reuse import reuse_policies, window_cost
from kvstore.format.errors import Busy, InvalidRequest
from kvstore.format.shm_names import available as shm_available
from kvstore.placement.stack import is_window_key
from kvstore.session.manager import MANAGER_PRESETS, ManagerConfig, TierManager
from kvstore.session.quota import Quotas
from kvstore.tiers.arena import ArenaTier, fits_shared_memory
from kvstore.tiers.base import MemoryMetaStore, MetaStore, Tier
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.host import HostTier
from services.server.config import ServerConfig
from services.server.limits import s3_pool_connections
from services.server.startup import check_node_name, fit_disk_bytes, prepare_data_dir

if TYPE_CHECKING:  # cryptography is imported only by a server that encrypts
    from kvstore.encryption.seal import Keyring
    from kvstore.encryption.tiers import BlockDomains

log = logging.getLogger(__name__)
# What S3 answers to a key it does not know, a wrong secret or a policy that denies.
S3_REFUSALS = ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
               "InvalidToken", "ExpiredToken")


def _preset(presets: dict, name: str, key: str):
    if name not in presets:
        raise InvalidRequest(f"{key} {name!r} is not one of {sorted(presets)}")
    return presets[name]


def build_tiers(config: ServerConfig, tiers: list[Tier],  # noqa: C901 - one branch per configured tier
                keyring: Keyring | None = None, domains: BlockDomains | None = None
                ) -> MetaStore:
    """Append the configured tiers to ``tiers`` (so a caller can close what was built if
    a later one fails) and return the MetaStore; with ``keyring``, the tiers that leave
    the process and the MetaStore seal what they store (``domains``: the blocks' domains)."""
    meta: MetaStore | None = None

    def outside(tier: Tier) -> Tier:
        if keyring is None:
            return tier
        from kvstore.encryption.tiers import EncryptedTier

        assert domains is not None  # given with the keyring (open_manager)
        return EncryptedTier(tier, keyring, domains)

    if config.hbm_bytes:
        tiers.append(HBMTier(config.hbm_bytes))
    if config.host_bytes:
        # Same-host clients read it in place (kvstore.tiers.arena), unless it feeds a GPU:
        # then it stays in (pinned) torch memory for the copies to the device.
        on_device = bool(config.hbm_bytes) or torch.cuda.is_available()
        shared = shm_available() and not on_device
        if shared and not fits_shared_memory(config.host_bytes):
            log.warning("host tier in process memory, not shared: /dev/shm has no room for "
                        "host_bytes (%d B) and its slabs' slack; same-host reads are copied",
                        config.host_bytes)
            shared = False
        tiers.append(ArenaTier(config.host_bytes) if shared else HostTier(config.host_bytes))
    if config.redis_url:
        from kvstore.tiers.redis import REDIS_PRESETS, RedisTier

        redis_config = _preset(REDIS_PRESETS, config.redis_preset, "redis_preset")
        if config.redis_prefix != redis_config.prefix:
            redis_config = dataclasses.replace(redis_config, prefix=config.redis_prefix)
        # a fleet's nodes find each other's chunks by chain key (kvstore.prefix.fleet_lookup)
        redis_config = dataclasses.replace(
            redis_config, chain_index=config.metadata == "shared",
            breaker_cooldown_s=config.breaker_cooldown_s,
            **{field: value for field, value in (
                ("connect_timeout_s", config.redis_connect_timeout_s),
                ("socket_timeout_s", config.redis_socket_timeout_s),
                ("op_timeout_s", config.redis_deadline_s)) if value})
        tiers.append(outside(RedisTier(config.redis_url, config.redis_bytes, redis_config)))
    if config.disk_bytes:
        from kvstore.tiers.disk import DiskTier

        disk_bytes, lowered = fit_disk_bytes(config)
        disk = DiskTier(config.data_dir / "disk", disk_bytes,
                        segment_bytes=config.disk_segment_bytes,
                        reclaim_dead_fraction=config.disk_reclaim_dead_fraction,
                        reclaim_interval_s=config.disk_reclaim_interval_s)
        if lowered:  # said once the data directory is ours (its writer lock taken)
            log.warning("%s", lowered)
        tiers.append(outside(disk))
        meta = disk.meta
        if keyring is not None:
            from kvstore.encryption.tiers import EncryptedMetaStore

            meta = EncryptedMetaStore(disk.meta, keyring)
    shared = config.metadata == "shared"  # with an S3 bucket (ServerConfig checks it)
    check_node_name(config)
    if config.object_bytes:
        from kvstore.tiers.object import ObjectTier, ObjectTierConfig

        # encrypted values are random bytes: zstd would only cost time
        level = config.object_compression_level if keyring is None else -1
        objects = ObjectTier(config.object_url, config.object_bytes, ObjectTierConfig(
            compression_level=None if level < 0 else level,
            endpoint_url=config.s3_endpoint or None,
            region_name=config.s3_region or None,
            connect_timeout_s=config.s3_connect_timeout_s,
            read_timeout_s=config.s3_read_timeout_s, deadline_s=config.s3_deadline_s,
            breaker_cooldown_s=config.breaker_cooldown_s,
            shared=shared, max_pool_connections=s3_pool_connections(config),
        ))
        tiers.append(outside(objects))
        if shared:  # the manifests live beside the chunks; reference counts stay here
            from kvstore.fleet.shared_meta import SharedMetaStore

            for tier in tiers[:-1]:  # node-local tiers are caches: a durable ack (and a
                tier.durable = False  # write-back) means the shared store (docs/fleet.md)
            for tier in tiers:  # Redis, the fleet's hot tier, and the bucket: every node's
                tier.shared = tier.name in ("redis", "object")  # (kvstore.placement.stack)

            sealer = None
            if keyring is not None:
                from kvstore.encryption.tiers import RecordSealer

                sealer = RecordSealer(keyring)
            return SharedMetaStore(objects, meta or MemoryMetaStore(), config.node_name,
                                   caches=tiers[:-1], sealer=sealer, chunks=tiers[-1])
    return meta if meta is not None else MemoryMetaStore()


def check_bucket(config: ServerConfig) -> None:
    """Refuse an ``s3_bucket`` that S3 says does not exist (a typo would otherwise run as
    an object tier that never works). S3 unreachable, or no credentials: the object tier
    starts unavailable and serves once S3 answers, as it does after a later outage."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client("s3", endpoint_url=config.s3_endpoint or None,
                          region_name=config.s3_region or None,
                          config=Config(connect_timeout=2, read_timeout=5,
                                        retries={"max_attempts": 1}))
    try:
        client.head_bucket(Bucket=config.s3_bucket)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        where = config.s3_endpoint or "AWS"
        if code in ("404", "NoSuchBucket"):
            raise InvalidRequest(f"s3_bucket {config.s3_bucket!r} does not exist at {where}: "
                                 "create it or name another s3_bucket") from exc
        if code in S3_REFUSALS:
            raise InvalidRequest(f"s3_bucket {config.s3_bucket!r} at {where}: S3 refuses the "
                                 f"credentials ({code}): fix AWS_ACCESS_KEY_ID and "
                                 "AWS_SECRET_ACCESS_KEY (or the role) for this bucket") from exc
    except BotoCoreError:
        pass


def manager_config(config: ServerConfig) -> ManagerConfig:
    """The manager settings of ``config`` (its preset, and its retention of chunks)."""
    return dataclasses.replace(
        _preset(MANAGER_PRESETS, config.manager_preset, "manager_preset"),
        retain_unreferenced=config.retain_unreferenced,
        retain_ttl_s=config.retain_ttl_s or None)


async def open_manager(config: ServerConfig) -> TierManager:  # noqa: C901 - opening steps in order, each undone on a later failure
    """The manager over the configured tiers (closing them again if opening fails)."""
    prepare_data_dir(config.data_dir)
    if config.s3_bucket and config.object_bytes:
        await asyncio.to_thread(check_bucket, config)
    keyring: Keyring | None = None
    domains: BlockDomains | None = None
    if config.encrypts:
        from kvstore.encryption.seal import load_keyring
        from kvstore.encryption.tiers import BlockDomains

        keyring = load_keyring(config.encryption_key_file, config.encryption_key)
        domains = BlockDomains()
    tiers: list[Tier] = []
    try:
        meta = build_tiers(config, tiers, keyring, domains)
        for tier in tiers:  # credentials Redis refuses: one line now, not a tier down for good
            if hasattr(tier, "check_access"):
                await tier.check_access()
        if config.metadata == "shared":
            from kvstore.fleet.shared_meta import SharedMetaStore

            assert isinstance(meta, SharedMetaStore)  # build_tiers made one
            await meta.mark_node()
        log.info("tiers: %s", ", ".join(f"{t.name} ({t.capacity_bytes} B)" for t in tiers))
        if keyring is not None:
            log.info("encryption at rest: on (key ids %s, current %s)", keyring.key_ids,
                     keyring.current)
        # reuse_policies() is one factory per stack: its tiers' policies share one model;
        # a window blob lost costs a replay, a chunk lost a read from a lower tier
        policy = {"reuse": reuse_policies(cost=window_cost(is_window_key)), "hint": HintPolicy,
                  "lru": LRUPolicy}[config.eviction]
        hook = None
        if domains is not None:  # the encrypting tiers learn each block's dedupe domain
            from kvstore.encryption.claims import DomainClaims

            hook = DomainClaims(domains)
        return await TierManager.open(tiers, meta, policy=policy, config=manager_config(config),
                                      quotas=Quotas.from_tables(config.quota), write_hook=hook)
    except BaseException as exc:
        for tier in tiers:
            await tier.close()
        if isinstance(exc, Busy):  # the disk tier's writer lock
            raise Busy(f"{exc}: another kvtier server or compaction is using data_dir "
                       f"{config.data_dir}; stop it or choose another data_dir") from exc
        raise


def tiers_holding(manager: TierManager, keys: Sequence[str]) -> list[str]:
    """Names of the tiers holding at least one of ``keys``, highest first."""
    held = {name for key in keys for name in manager.where(key)}
    return [tier.name for tier in manager.tiers if tier.name in held]


def restore_tier(manager: TierManager, keys: Sequence[str]) -> str:
    """The slowest tier a restore of ``keys`` would read from now ("" when none is held)."""
    order = [tier.name for tier in manager.tiers]
    tops = [order.index(names[0]) for names in map(manager.where, keys) if names]
    return order[max(tops)] if tops else ""
