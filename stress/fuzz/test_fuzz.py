"""The fuzz campaign's generators (``stress.fuzz.cases``) against a real server and replay
worker in child processes, driven by Hypothesis's random source: every request ends with
a status in time, none INTERNAL or UNKNOWN, no process dies, and sessions spilled through
the client before (and probes between) restore bit-exact."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.format.errors import InvalidRequest
from kvstore.format.layout import layout_from_json
from kvstore.format.layout_bounds import MAX_JSON_BYTES, check_bounds
from stress.fuzz.campaign import IDLE_S, Campaign
from stress.fuzz.cases import METHODS, SERVICES, CaseGenerator
from stress.fuzz.layouts import layout_body
from stress.fuzz.pool import build_pool
from testing.live_server import Credentials, LiveServer

DEADLINE_S = 20.0  # a request still running after this is a hang


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    with LiveServer(tmp / "data", tmp, env={"KVTIER_STREAM_IDLE_S": str(IDLE_S)}) as server:
        yield server


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz-auth")
    with LiveServer(tmp / "data", tmp, env={"KVTIER_STREAM_IDLE_S": str(IDLE_S)},
                    creds=Credentials.write(tmp / "certs")) as server:
        yield server


def test_the_generators_cover_every_method_of_both_services():
    generator = CaseGenerator(random.Random(0), build_pool())
    drawn = {generator.next().method for _ in range(2000)}
    assert drawn == {m.name for s in SERVICES for m in s.methods} == set(METHODS)
    assert {"LeaseSegment", "ReleaseSegments", "Rebuild", "RegisterLayout", "ListLayouts",
            "Lookup", "Fork"} <= drawn


def test_layout_bodies_are_what_their_family_says():
    """Honest and flood layouts pass the server's checks, every hostile one fails them;
    every hostile kind is drawn."""
    rng, kinds = random.Random(0), set()
    for serial in range(1500):
        family, text, name = layout_body(rng, serial)
        try:
            if len(text.encode()) > MAX_JSON_BYTES:
                raise InvalidRequest("over 64 KiB")
            spec = layout_from_json(text)
            check_bounds(spec, 64 << 20)
            valid = True
        except InvalidRequest:
            valid = False
        assert valid == (not family.startswith("hostile")), (family, text[:200])
        assert name is None or spec.name == name
        kinds.add(family)
    assert len([k for k in kinds if k.startswith("hostile:")]) == 28
    assert {"honest", "builtin", "flood"} <= kinds


def test_a_seed_gives_the_same_cases():
    pool = build_pool()
    first, second = (CaseGenerator(random.Random(7), pool) for _ in range(2))
    assert [first.next().messages for _ in range(200)] == \
        [second.next().messages for _ in range(200)]


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.large_base_example,
                                 HealthCheck.data_too_large])
@given(rng=st.randoms(use_true_random=False))
def test_fuzzed_requests_leave_the_server_standing_and_sessions_exact(live, rng):
    campaign = Campaign(live, 0, DEADLINE_S, concurrency=8, rng=rng)
    result = asyncio.run(campaign.run(100, probe_every=50))
    assert result["requests"] == 100
    assert result["crashes"] == 0, result["examples"]
    assert result["hangs"] == 0, result["examples"].get("hang")
    assert result["internal_or_unknown"] == 0, result["examples"]
    assert result["server_internal_or_unknown"] == 0
    assert result["wrong_tensors"] == 0, result["examples"].get("wrong_tensor")
    assert result["probe_errors"] == 0, result["examples"].get("probe_error")
    assert result["preexisting_sessions_intact"]
    assert result["probes"] == 2
    assert result["prefix_leaks"] == result["path_leaks"] == result["stalls"] == 0, \
        result["examples"]


def test_fuzz_of_an_authenticated_server_with_credential_attacks(secured):
    """TLS and tokens: no token or a wrong one is UNAUTHENTICATED, another tenant's
    session named with a valid token (Restore, Fork, Lookup) is PERMISSION_DENIED with no
    data, a tenant's RegisterLayout is PERMISSION_DENIED, every time."""
    campaign = Campaign(secured, 0, DEADLINE_S, concurrency=8, rng=random.Random(5))
    result = asyncio.run(campaign.run(150, probe_every=50))
    assert result["auth"] and result["requests"] == 150
    assert result["credential_attacks"] > 10
    assert result["credential_breaches"] == 0, result["examples"].get("credential_breach")
    assert result["by_code"].get("UNAUTHENTICATED", 0) > 0
    assert result["by_code"].get("PERMISSION_DENIED", 0) > 0
    assert result["crashes"] == result["hangs"] == 0, result["examples"]
    assert result["internal_or_unknown"] == result["server_internal_or_unknown"] == 0
    assert result["wrong_tensors"] == 0, result["examples"].get("wrong_tensor")
    assert result["probe_errors"] == 0, result["examples"].get("probe_error")
    assert result["preexisting_sessions_intact"] and result["probes"] == 3
    assert result["prefix_leaks"] == result["path_leaks"] == result["stalls"] == 0, \
        result["examples"]
    # a tenant's RegisterLayout is refused where only admins register (the default)
    assert result["by_method"]["RegisterLayout"].get("PERMISSION_DENIED", 0) > 0
