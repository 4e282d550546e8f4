"""Which nodes of a fleet are alive: each node writes a heartbeat object to the shared
bucket (``<prefix>fleet/nodes/<node_id>.json``: its address, its state, the time) every
``interval_s``, and a last one saying ``stopped`` when it stops cleanly. Any node (``kvtier
stat --fleet``) lists them: a heartbeat older than ``down_after_s`` is a node that is
down (killed, hung, cut off from the bucket), whatever its last state said.

Ages are measured against the reader's clock from the writer's: fleet nodes are assumed
to keep their clocks in step (NTP), as the garbage-collection epochs already do.

    beat = Heartbeat(meta.io, meta.paths.root, "kv-1", "kv-1.internal:50051")
    await beat.write("serving")
    nodes = await read_nodes(meta.io, meta.paths.root, down_after_s=30.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass

from kvstore.fleet.bucket import BucketIO
from kvstore.format.errors import KVTierError

log = logging.getLogger(__name__)
STATES = ("serving", "draining", "drained", "stopped")
NODES = "nodes/"
SUFFIX = ".json"


@dataclass(frozen=True)
class NodeLiveness:
    node_id: str
    address: str
    state: str  # the node's last word: one of STATES
    heartbeat_age_s: float  # since its last heartbeat, on this node's clock
    down: bool  # no heartbeat for down_after_s, and it did not say it stopped


class Heartbeat:
    """This node's heartbeat object, rewritten by ``run`` every ``interval_s``."""

    def __init__(self, io: BucketIO, root: str, node_id: str, address: str) -> None:
        self._io = io
        self._key = f"{root}{NODES}{node_id}{SUFFIX}"
        self.node_id = node_id
        self.address = address
        self.state = "serving"

    async def write(self, state: str | None = None) -> None:
        if state is not None:
            if state not in STATES:
                raise ValueError(f"state must be one of {STATES}, got {state!r}")
            self.state = state
        await self._io.put_json(self._key, {"node_id": self.node_id, "address": self.address,
                                            "state": self.state, "unix": time.time()})

    async def run(self, interval_s: float) -> None:
        """Beat until cancelled; a failed write is logged and the next one tried (the
        bucket being away is what makes other nodes see this one as down)."""
        while True:
            try:
                await self.write()
            except KVTierError as exc:
                log.warning("fleet heartbeat not written: %s", exc)
            await asyncio.sleep(interval_s)

    async def stop(self) -> None:
        """The last heartbeat: ``stopped`` (a node that says so is not down)."""
        with contextlib.suppress(KVTierError):
            await self.write("stopped")


async def read_nodes(io: BucketIO, root: str, *, down_after_s: float,
                     now: float | None = None) -> tuple[NodeLiveness, ...]:
    """Every node that ever beat in this bucket, sorted by id; one listing and one GET
    per node."""
    now = time.time() if now is None else now
    found = []
    for item in await io.listing(root + NODES):
        if not item["Key"].endswith(SUFFIX):
            continue
        got = await io.get(item["Key"])
        if got is None:  # removed since the listing
            continue
        try:
            beat = json.loads(got[1])
            node_id, address = str(beat["node_id"]), str(beat["address"])
            state, unix = str(beat["state"]), float(beat["unix"])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("heartbeat object %s does not parse: %s", item["Key"], exc)
            continue
        age = max(0.0, now - unix)
        found.append(NodeLiveness(node_id, address, state, round(age, 3),
                                  state != "stopped" and age > down_after_s))
    return tuple(sorted(found, key=lambda node: node.node_id))
