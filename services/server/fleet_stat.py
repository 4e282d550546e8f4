"""The fleet's view in the Stat RPC (``StatRequest.fleet``: ``kvtier stat --fleet``), from
``kvstore.fleet.view``; a server that is no fleet node refuses it (InvalidRequest)."""

from __future__ import annotations

from kvstore.format.errors import InvalidRequest
from kvstore.session.manager import TierManager
from proto import kvtier_pb2 as pb


async def fleet_stat(manager: TierManager, tenant: str | None, down_after_s: float
                     ) -> pb.FleetStat:
    """``tenant``: count only that tenant's sessions (a tenant's credential);
    ``down_after_s``: a heartbeat older than this is a node down."""
    from kvstore.fleet.shared_meta import SharedMetaStore
    from kvstore.fleet.view import fleet_view

    if not isinstance(manager.meta, SharedMetaStore):
        raise InvalidRequest("this server is not a fleet node (metadata = 'local'): "
                             "its sessions are its own, as `kvtier stat` counts them")
    view = await fleet_view(manager.meta, tenant, down_after_s=down_after_s)
    return pb.FleetStat(sessions=view.sessions, nodes_seen=view.nodes_seen,
                        gc_epoch=view.gc_epoch, gc_state=view.gc_state,
                        gc_sweeper=view.gc_sweeper, cas=view.cas,
                        nodes=[pb.NodeLiveness(node_id=n.node_id, address=n.address,
                                               state=n.state, heartbeat_age_s=n.heartbeat_age_s,
                                               down=n.down) for n in view.nodes])
