"""The disk tier: append-only segment files indexed in LMDB (see ``tier.py``)."""

from kvstore.tiers.disk.tier import DiskTier

__all__ = ["DiskTier"]
