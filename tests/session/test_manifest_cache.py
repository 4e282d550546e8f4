"""The catalog's decoded manifests: exact after every commit and delete, within budget."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.format.errors import SessionNotFound
from kvstore.session.catalog import ManifestCache, footprint
from kvstore.session.manifest import SessionManifest
from kvstore.tiers.base import MemoryMetaStore
from kvstore.tiers.host import HostTier
from tests.support.manager import make_session, random_tokens

MB = 1 << 20


def manifest(session_id: str, tokens: int) -> SessionManifest:
    return SessionManifest(tenant="t", session_id=session_id, layout_id="l", generation=1,
                           token_ids=np.zeros(tokens, np.uint32), chunk_keys=(),
                           chunk_sizes=())


def test_budget_bounds_what_is_kept_oldest_out_first():
    a, b, c = (manifest(name, 1000) for name in "abc")
    cache = ManifestCache(budget=2 * footprint(a))
    for m in (a, b):
        cache.put(m)
    assert cache.get("t", "a") is a  # now the most recent
    cache.put(c)
    assert cache.get("t", "b") is None and cache.get("t", "a") is a and cache.get("t", "c") is c
    cache.put(manifest("huge", 10**6))  # over the whole budget: not kept, nothing evicted
    assert cache.get("t", "huge") is None and cache.get("t", "c") is c
    cache.drop("t", "c")
    assert cache.get("t", "c") is None


async def test_loads_follow_every_commit_and_delete(managers):
    meta = MemoryMetaStore()
    manager = await managers.open([HostTier(MB)], meta)
    first = make_session(random_tokens(40, seed=1))
    second = make_session(random_tokens(56, seed=2))
    await manager.spill("t", "s", generation=1, **first)
    await manager.spill("t", "s", generation=2, **second)
    got = await manager.get_manifest("t", "s")
    assert got.generation == 2 and list(got.token_ids) == list(second["token_ids"])
    await manager.delete("t", "s")
    with pytest.raises(SessionNotFound):
        await manager.get_manifest("t", "s")
    await managers.close(manager)
