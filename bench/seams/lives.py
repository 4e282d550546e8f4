"""A simulated server's lives: stopped (SIGTERM, every ack drained; or SIGKILL, the
memory-acked versions maybe gone) with the model told, and started again, the
combination given up (``Abort``) when its server will not start."""

from __future__ import annotations

from bench.seams import prefix


class Abort(Exception):
    """The combination cannot go on (its server would not start again)."""


async def stop(sim, how: str) -> None:
    await sim.end_life(how)
    prefix.after_stop(sim, how)
    for held in sim.model.values():
        if how == "term":
            held.drained()
        else:
            held.uncertain = True
        for version in held.versions:
            version.window = None  # memory tiers only
        held.window_replayed = False


async def start(sim, why: str, config=None) -> None:
    if not await sim.start(config):
        sim.ledger.add("unexpected", sim.combo.name, sim.step, f"start-after-{why}", "-",
                       "the server starts again", sim.node.refusal)
        raise Abort(sim.node.refusal)
