"""What a fleet node can tell of its fleet: the sessions the shared bucket holds (the
number every node's listing gives, not the ones this node has loaded), the nodes that
wrote the manifests it read, every node's last heartbeat (``kvstore.fleet.liveness``),
the garbage-collection epoch, and its own compare-and-swap outcomes.

    view = await fleet_view(meta)          # meta: the node's SharedMetaStore
    view.sessions, view.gc_state
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.fleet.epochs import read_epoch
from kvstore.fleet.liveness import NodeLiveness, read_nodes
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
    nodes: tuple[NodeLiveness, ...] = ()  # every node's last heartbeat, by id


async def fleet_view(meta: SharedMetaStore, tenant: str | None = None, *,
                     down_after_s: float = 30.0) -> FleetView:
    """One listing of the manifests (``tenant``'s only when given), one read of the
    epoch object and of every node's heartbeat."""
    prefix = meta.paths.root + (MANIFEST_PREFIX if tenant is None
                                else manifest_key(tenant, ""))
    sessions = sum(item["Key"].endswith(SUFFIX) for item in await meta.io.listing(prefix))
    epoch, _ = await read_epoch(meta.io, meta.paths)
    return FleetView(
        node_id=meta.node_id, sessions=sessions,
        nodes_seen=tuple(sorted(meta.writers() | {meta.node_id})),
        gc_epoch=epoch.epoch, gc_state=epoch.state, gc_sweeper=epoch.sweeper,
        cas={result: meta.cas_results[result] for result in CAS_RESULTS},
        nodes=await read_nodes(meta.io, meta.paths.root, down_after_s=down_after_s))
