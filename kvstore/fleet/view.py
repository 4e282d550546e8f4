"""What a fleet node can tell of its fleet: the sessions the shared bucket holds (the
number every node's listing gives, not the ones this node has loaded), the nodes that
wrote the manifests it read, the garbage-collection epoch, and its own compare-and-swap
outcomes.

    view = await fleet_view(meta)          # meta: the node's SharedMetaStore
    view.sessions, view.gc_state
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.fleet.epochs import read_epoch
from kvstore.fleet.shared_meta import SUFFIX, SharedMetaStore
from kvstore.remote.observe import CAS_RESULTS
from kvstore.session.manifest import MANIFEST_PREFIX, manifest_key


@dataclass(frozen=True)
class FleetView:
    node_id: str
    sessions: int  # manifests in the bucket (of one tenant when asked)
    nodes_seen: tuple[str, ...]  # sorted; this node included
    gc_epoch: int
    gc_state: str  # kvstore.fleet.epochs.STATES
    gc_sweeper: str
    cas: dict[str, int] = field(default_factory=dict)  # result -> count, this node's


async def fleet_view(meta: SharedMetaStore, tenant: str | None = None) -> FleetView:
    """One listing of the manifests (``tenant``'s only when given) and one read of the
    epoch object."""
    prefix = meta.paths.root + (MANIFEST_PREFIX if tenant is None
                                else manifest_key(tenant, ""))
    sessions = sum(item["Key"].endswith(SUFFIX) for item in await meta.io.listing(prefix))
    epoch, _ = await read_epoch(meta.io, meta.paths)
    return FleetView(
        node_id=meta.node_id, sessions=sessions,
        nodes_seen=tuple(sorted(meta.writers() | {meta.node_id})),
        gc_epoch=epoch.epoch, gc_state=epoch.state, gc_sweeper=epoch.sweeper,
        cas={result: meta.cas_results[result] for result in CAS_RESULTS})
