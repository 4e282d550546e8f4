"""A fleet node's duties on a timer (``metadata = "shared"``): its heartbeat in the bucket
(``kvstore.fleet.liveness``), and from the bucket the fleet's figures its metrics export
(``services.server.remote_metrics``): the last garbage-collection sweep and the nodes
down. Every ``fleet_heartbeat_s``, busy or idle; a bucket that does not answer leaves the
last figures and is logged (the other nodes then see this one down). It also holds the
node's ``PeerMover`` (``services.server.peers``), by which a drain moves the node's
windows to live peers.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvstore.fleet.gc import last_run
from kvstore.fleet.liveness import Heartbeat, read_nodes
from kvstore.fleet.shared_meta import SharedMetaStore
from kvstore.format.errors import KVTierError
from services.server.config import ServerConfig
from services.server.peers import PeerMover
from services.server.remote_metrics import RemoteMetrics
from services.serving.lifecycle import end_task

log = logging.getLogger(__name__)


class FleetNode:
    def __init__(self, meta: SharedMetaStore, config: ServerConfig, address: str,
                 metrics: RemoteMetrics) -> None:
        self.heartbeat = Heartbeat(meta.io, meta.paths.root, config.node_name, address)
        self.peers = PeerMover(meta, config, config.node_name)
        self._meta = meta
        self._config = config
        self._metrics = metrics
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except KVTierError as exc:
                log.warning("fleet heartbeat or figures not refreshed: %s", exc)
            await asyncio.sleep(self._config.fleet_heartbeat_s)

    async def refresh(self) -> None:
        """One heartbeat, then the fleet's figures read back."""
        await self.heartbeat.write()
        run = await last_run(self._meta)
        if run is not None:
            self._metrics.gc_last_run.set(time.time() - run.age_s)
            self._metrics.gc_last_failed.set(run.result != "ok")
        nodes = await read_nodes(self._meta.io, self._meta.paths.root,
                                 down_after_s=self._config.fleet_down_after_s)
        self._metrics.nodes_down.set(sum(node.down for node in nodes))

    async def stop(self) -> None:
        """The last heartbeat says ``stopped``: a clean stop is not a node down."""
        await end_task(self._task)
        await self.heartbeat.stop()
        await self.peers.close()
