"""kvtier as SGLang's HiCache L3 storage (``KVTierStorage``: README "SGLang")."""

from kvtier.integrations.sglang.storage import KVTierStorage

__all__ = ["KVTierStorage"]
