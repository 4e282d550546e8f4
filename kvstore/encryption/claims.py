"""The spill hook of encrypting tiers (``kvstore.encryption.tiers``): a spill tells them the
dedupe domain of every block it brings in.

A block moves between tiers without session context, so the domain it is sealed for is
claimed when it arrives: only for a block key whose chain part is the one the spill's
own tokens, layout, model and domain chain to (``kvstore.format.keys``), so a spill can never
claim another domain's block. A spill the manager then refuses leaves claims that are
still true (the chain key binds the domain) and are swept with unreferenced blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.encryption.tiers import BlockDomain, BlockDomains
from kvstore.format.errors import KVTierError
from kvstore.format.keys import chain_keys, dedupe_scope
from kvstore.format.registry import get_layout

if TYPE_CHECKING:
    from kvstore.session.context import StoreContext
    from kvstore.session.spill import SpillRequest


class DomainClaims:
    """A ``kvstore.session.spill.SpillHook``: claims before a spill, sweeps after it."""

    def __init__(self, domains: BlockDomains) -> None:
        """``domains``: the map the encrypting tiers read."""
        self.domains = domains

    def before(self, request: SpillRequest) -> None:
        scope = dedupe_scope(request.tenant, request.dedupe_domain)
        try:
            spec = get_layout(request.layout_id)
            chains = chain_keys(spec.layout_id, request.token_ids, spec.chunk_tokens,
                                scope=scope, model_fingerprint=request.model_fingerprint)
        except KVTierError:
            return  # the spill itself refuses these arguments, by name
        domain = BlockDomain(scope, spec.layout_hash)
        for (key, _), chain in zip(request.chunks, chains, strict=False):
            if key.partition(".")[0] == chain:
                self.domains.claim(key, domain)

    def after(self, request: SpillRequest, store: StoreContext) -> None:
        # retained chunks stay readable: a later lookup's spill may name them
        self.domains.sweep(lambda key: store.ledger.count(key) > 0
                           or store.retention.retained(key))
