"""The write hook of encrypting tiers (``kvstore.encryption.tiers``): every write that
stores chunks tells them the dedupe domain of each block it brings in or names.

A block moves between tiers without session context, so the domain it is sealed for is
claimed when a write admits it (``Blocks.admitting``: a spill, a WriteChunks).
The write's own checks proved each key's chain part is the one its tokens, layout, model
and domain chain to (``kvstore.format.keys``), so a write can never claim another
domain's block. A write the manager then refuses leaves claims that are still true (the
chain key binds the domain) and are swept with unreferenced blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvstore.encryption.tiers import BlockDomain, BlockDomains
from kvstore.placement.blocks import BlockWrite


class DomainClaims:
    """A ``kvstore.placement.blocks.WriteHook``: claims before a write, sweeps after it."""

    def __init__(self, domains: BlockDomains) -> None:
        """``domains``: the map the encrypting tiers read."""
        self.domains = domains
        self._writing: Counter[str] = Counter()  # keys of the writes between the two

    def before(self, write: BlockWrite) -> None:
        domain = BlockDomain(write.scope, write.layout_hash)
        for key in write.keys:
            self.domains.claim(key, domain)
        self._writing.update(write.keys)

    def after(self, write: BlockWrite, in_use: Callable[[str], bool]) -> None:
        for key in write.keys:
            self._writing[key] -= 1
            if self._writing[key] <= 0:
                del self._writing[key]
        # blocks of a write in flight, referenced or retained stay readable and movable:
        # a placement, a write-back, an eviction or a later lookup's spill may need them
        self.domains.sweep(lambda key: key in self._writing or in_use(key))
