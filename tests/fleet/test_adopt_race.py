"""A window adopted while another node spills the session (``TierManager.adopt_window``
over one moto bucket): the adopter's compare-and-swap loses, the session names the node
that spilled it, and the adopter keeps no copy of the window it was handed."""

from __future__ import annotations

import pytest

from kvstore.format.errors import StaleGeneration
from tests.support.fleet import fleet_nodes
from tests.support.manager import make_session, random_tokens


async def test_a_session_spilled_during_the_adoption_is_left_alone(node_config):
    tokens = random_tokens(100, 1)
    first = make_session(tokens, seed=1, tenant="acme")
    async with fleet_nodes(node_config) as open_node:
        a, b, c = await open_node("a"), await open_node("b"), await open_node("c")
        await a.spill("acme", "s1", generation=1, ack="durable", **first)
        put = b.store.catalog.put

        async def spilled_meanwhile(manifest, **kwargs):
            # c spills the session between b's load and b's compare-and-swap
            await c.spill("acme", "s1", generation=2, ack="durable",
                          **make_session(tokens, seed=2, tenant="acme"))
            return await put(manifest, **kwargs)

        b.store.catalog.put = spilled_meanwhile
        with pytest.raises(StaleGeneration):
            await b.adopt_window("acme", "s1", 1, first["window"], replayed_tokens=0,
                                 from_node="a")
        b.store.catalog.put = put
        stored = await b.store.catalog.load("acme", "s1")
        assert stored.generation == 2 and stored.node_id == "c"
        assert not b.store.stack.holders("win/acme/s1/1r0")  # the adopted copy dropped

        # without the race, b adopts a's window of the session as it is now (c's)
        window = make_session(tokens, seed=2, tenant="acme")["window"]
        assert await b.adopt_window("acme", "s1", 2, window, replayed_tokens=0,
                                    from_node="c") == "host"
        assert (await c.store.catalog.load("acme", "s1")).remote_window is not None
        assert (await b.restore("acme", "s1")).window == window
        assert b.store.stack.holders("win/acme/s1/2r0")  # where a kept copy is named
