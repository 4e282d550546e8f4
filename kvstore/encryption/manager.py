"""A ``TierManager`` over sealed tiers (``kvstore.encryption.tiers``): its spills tell them
the dedupe domain of every block they bring in.

A block moves between tiers without session context, so the domain it is sealed for is
claimed when it arrives: only for a block key whose chain part is the one the spill's
own tokens, layout, model and domain chain to (``kvstore.format.keys``), so a spill can never
claim another domain's block. A spill the manager then refuses leaves claims that are
still true (the chain key binds the domain) and are swept with unreferenced blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.encryption.tiers import BlockDomain, BlockDomains
from kvstore.format.errors import KVTierError
from kvstore.format.keys import chain_keys, dedupe_scope
from kvstore.format.registry import get_layout
from kvstore.session.manager import TierManager
from kvstore.session.manifest import SessionManifest
from kvstore.tiers.base import Buffer, MetaStore, Tier


class SealingTierManager(TierManager):
    def __init__(self, tiers: Sequence[Tier], meta: MetaStore, *, domains: BlockDomains,
                 **options) -> None:
        """``domains``: the map the sealed tiers among ``tiers`` read."""
        super().__init__(tiers, meta, **options)
        self.domains = domains

    async def spill(self, tenant: str, session_id: str, *, layout_id: str,
                    token_ids: Sequence[int] | np.ndarray,
                    chunks: Sequence[tuple[str, Buffer | None]], model_fingerprint: str = "",
                    dedupe_domain: str | None = None, **options) -> SessionManifest:
        self._claim(tenant, layout_id, token_ids, chunks, model_fingerprint, dedupe_domain)
        try:
            return await super().spill(tenant, session_id, layout_id=layout_id,
                                       token_ids=token_ids, chunks=chunks,
                                       model_fingerprint=model_fingerprint,
                                       dedupe_domain=dedupe_domain, **options)
        finally:
            # retained chunks stay readable: a later lookup's spill may name them
            self.domains.sweep(lambda key: self._ledger.count(key) > 0
                               or self._retention.retained(key))

    def _claim(self, tenant: str, layout_id: str, token_ids: Sequence[int] | np.ndarray,
               chunks: Sequence[tuple[str, Buffer | None]], model_fingerprint: str,
               dedupe_domain: str | None) -> None:
        scope = dedupe_scope(tenant, dedupe_domain)
        try:
            spec = get_layout(layout_id)
            chains = chain_keys(spec.layout_id, token_ids, spec.chunk_tokens, scope=scope,
                                model_fingerprint=model_fingerprint)
        except KVTierError:
            return  # the spill itself refuses these arguments, by name
        domain = BlockDomain(scope, spec.layout_hash)
        for (key, _), chain in zip(chunks, chains, strict=False):
            if key.partition(".")[0] == chain:
                self.domains.claim(key, domain)
