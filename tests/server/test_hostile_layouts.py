"""The worst cases the fuzzer and the adversarial benchmark found in RegisterLayout,
ListLayouts, Lookup and Fork, each over a real server: a registered layout of one-token
chunks whose Lookup or Spill hashed every chunk of a 64 MiB token array on the event loop
(seconds to minutes; now a miss ends the walk and a key count that disagrees is refused
before anything is hashed), a layout name with a trailing newline (accepted by a "$"),
registrations of 64 KiB layouts that filled 138 MiB of RSS and a 16 MB ListLayouts
(now bounded by their JSON in all), and hostile layout JSON, Lookups and Forks, each
answered with its specific status and no server path."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

from kvstore.format.errors import InvalidRequest
from kvstore.format.layout import layout_from_json, layout_to_json
from kvstore.format.layout_bounds import MAX_JSON_BYTES
from kvtier import AsyncClient
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from services.server.config import ServerConfig
from services.server.layout_registry import MAX_REGISTERED, MAX_REGISTERED_BYTES
from stress.adversarial.cases import status, stream
from testing.live_server import LiveServer, channel
from tests.support.security import TOKENS, dev_set, secured_server, spill_one
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for

MiB = 1 << 20
DEADLINE_S = 20.0  # the fuzzer's hang: one-token chunks took ~9 s per million tokens
STREAM = {"name": "a", "entry_shape": [2], "bits": 16}
# the most token ids a Lookup or a Spill header carries, with room for the other fields
MAX_MESSAGE_TOKENS = (ServerConfig.max_header_bytes - 4096) // 4


def layout_json(name: str, **fields) -> str:
    return json.dumps({"name": name, "chunk_tokens": 16, "streams": [STREAM], **fields},
                      separators=(",", ":"))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A server in a child process: a blocked event loop there cannot hide in the test's."""
    tmp = tmp_path_factory.mktemp("hostile")
    with LiveServer(tmp / "data", tmp, replay=False) as server:
        yield server


async def _with_stat(target: str, call) -> tuple[tuple[str, str], str]:
    """(the call's code and details, the code of a Stat sent meanwhile on another
    connection), both bounded by DEADLINE_S."""
    async with channel(target, 1) as attacker, channel(target, 2) as other:
        stub, watcher = pb_grpc.KVTierStub(attacker), pb_grpc.KVTierStub(other)
        attack = asyncio.ensure_future(status(call(stub)))
        await asyncio.sleep(0.2)  # the request is on the server
        watched = await status(watcher.Stat(pb.StatRequest(), timeout=DEADLINE_S))
        return await attack, watched[0]


def test_lookup_of_a_full_message_of_one_token_chunks_answers_in_time(live):
    async def run():
        async with channel(live.target) as ch:
            await pb_grpc.KVTierStub(ch).RegisterLayout(pb.RegisterLayoutRequest(
                layout_json=layout_json("one-token", chunk_tokens=1)))
        request = pb.LookupRequest(tenant="acme", layout_id="one-token",
                                   token_ids=np.zeros(MAX_MESSAGE_TOKENS, "<u4").tobytes())
        return await _with_stat(live.target, lambda stub: stub.Lookup(request,
                                                                      timeout=DEADLINE_S))

    (code, details), stat = asyncio.run(run())
    assert code == "OK", details  # 16.7 million chunks, none held: nothing past the first
    assert stat == "OK"  # the event loop answered another client meanwhile


def test_a_spill_header_of_many_one_token_chunks_naming_no_keys_is_refused_in_time(live):
    async def run():
        async with channel(live.target) as ch:
            await pb_grpc.KVTierStub(ch).RegisterLayout(pb.RegisterLayoutRequest(
                layout_json=layout_json("one-token-spill", chunk_tokens=1)))
        header = pb.SpillHeader(session=pb.SessionRef(tenant="acme", session_id="big"),
                                layout_id="one-token-spill", generation=1,
                                token_ids=np.zeros(MAX_MESSAGE_TOKENS - 64, "<u4").tobytes())
        return await _with_stat(live.target, lambda stub: stub.Spill(
            stream([pb.SpillRequest(header=header)]), timeout=DEADLINE_S))

    (code, details), stat = asyncio.run(run())
    assert code == "INVALID_ARGUMENT" and "header.chunk_keys names 0" in details
    assert stat == "OK"


def test_registrations_stop_at_the_bound_on_their_json_with_memory_bounded(live):
    """64 KiB layouts (3,500 layer modes) until the server refuses: well before 256 of
    them, with the server's RSS and the ListLayouts reply bounded by the JSON bound."""
    modes = [f"mode{i:011d}" for i in range(3500)]

    async def run():
        async with channel(live.target) as ch:
            stub = pb_grpc.KVTierStub(ch)
            live.server.reset_peak()
            base = live.rss()["rss"]
            codes = []
            for i in range(MAX_REGISTERED):
                text = layout_json(f"wide{i}", layer_modes=modes)
                assert len(text) <= MAX_JSON_BYTES
                code, details = await status(stub.RegisterLayout(
                    pb.RegisterLayoutRequest(layout_json=text)))
                codes.append(code)
                if code != "OK":
                    break
            grown = live.rss()["peak"] - base
            listed = await stub.ListLayouts(pb.ListLayoutsRequest())
            return codes, details, grown, listed

    codes, details, grown, listed = asyncio.run(run())
    assert codes[-1] == "RESOURCE_EXHAUSTED" and set(codes[:-1]) == {"OK"}, codes
    assert "registered layouts' JSON" in details and "/" not in details
    assert 16 < len(codes) - 1 < MAX_REGISTERED  # the byte bound, not the count, stopped it
    wide = [info for info in listed.layouts if info.layout_id.startswith("wide")]
    assert len(wide) == len(codes) - 1
    assert sum(len(info.layout_json) for info in wide) <= MAX_REGISTERED_BYTES
    assert grown < 100 * MiB  # 256 of them grew it by 138 MiB


async def test_the_257th_registration_is_refused_and_the_256_survive_a_restart(tmp_path):
    async with running_server(tmp_path) as (server, target), channel(target) as ch:
        stub = pb_grpc.KVTierStub(ch)
        for i in range(MAX_REGISTERED):
            await stub.RegisterLayout(pb.RegisterLayoutRequest(
                layout_json=layout_json(f"count{i}")))
        over = await status(stub.RegisterLayout(pb.RegisterLayoutRequest(
            layout_json=layout_json("count-over"))))
        again = await stub.RegisterLayout(pb.RegisterLayoutRequest(
            layout_json=layout_json("count7")))  # a known one is still answered
    assert over[0] == "RESOURCE_EXHAUSTED" and f"{MAX_REGISTERED} registered" in over[1]
    assert not again.created
    async with running_server(tmp_path) as (restarted, _):
        kept = restarted.servicer.layouts.registered
    assert len(kept) == MAX_REGISTERED and "count-over" not in kept


def test_a_layout_name_with_a_trailing_newline_is_refused():
    with pytest.raises(InvalidRequest, match="layout name"):
        layout_from_json(layout_json("nl\n"))
    with pytest.raises(InvalidRequest, match="stream name"):
        layout_from_json(layout_json("ok", streams=[{**STREAM, "name": "a\n"}]))


HOSTILE_JSON = {
    "nested past the recursion limit": "[" * 30_000 + "]" * 30_000,
    "nested objects": '{"a":' * 10_000 + "1" + "}" * 10_000,
    "over 64 KiB": layout_json("big", notes="x" * MAX_JSON_BYTES),
    "a float": layout_json("f", chunk_tokens=16.0),
    "NaN": '{"name":"n","chunk_tokens":NaN,"streams":[]}',
    "a non-ASCII name": layout_json("l\u00e9"),
    "a NUL in the name": layout_json("a\u0000"),
    "a newline after the name": layout_json("nl\n"),
    "an integer of 5,000 digits": '{"name":"h","chunk_tokens":' + "9" * 5000 + ',"streams":[]}',
    "a dimension of 1,000 digits": layout_json("d", streams=[{**STREAM,
                                                               "entry_shape": [10**1000]}]),
    "5,000 dimensions": layout_json("d", streams=[{**STREAM, "entry_shape": [1] * 5000}]),
    "10^30 layers": layout_json("l", streams=[{**STREAM, "layers": 10**30}]),
    "one stream twice": layout_json("s", streams=[STREAM, STREAM]),
    "65 streams": layout_json("s", streams=[{**STREAM, "name": f"s{i}"} for i in range(65)]),
    "a repeated key": '{"name":"a","name":"b","chunk_tokens":4,"streams":[]}',
    "bits true": layout_json("b", streams=[{**STREAM, "bits": True}]),
    "streams a string": layout_json("w", streams="abc"),
    "a list": json.dumps([json.loads(layout_json("l"))]),
    "null": "null",
    "empty": "",
    "chunks over a message": layout_json("c", chunk_tokens=1 << 16,
                                         streams=[{**STREAM, "entry_shape": [1 << 20]}]),
    "a builtin's name, another shape": layout_json("kvtier-bundled"),
}


async def test_hostile_layout_json_is_invalid_argument_naming_no_path(tmp_path):
    async with running_server(tmp_path) as (server, target), channel(target) as ch:
        stub = pb_grpc.KVTierStub(ch)
        answers = {name: await status(stub.RegisterLayout(pb.RegisterLayoutRequest(
            layout_json=text))) for name, text in HOSTILE_JSON.items()}
        again = await stub.RegisterLayout(pb.RegisterLayoutRequest(
            layout_json=layout_to_json(LAYOUT)))
    wrong = {name: answer for name, answer in answers.items()
             if answer[0] != "INVALID_ARGUMENT" or str(tmp_path) in answer[1]
             or len(answer[1]) > 2048}
    assert not wrong
    assert not server.servicer.layouts.registered  # nothing of it was kept
    assert not again.created and again.layout.layout_id == LAYOUT.layout_id


async def test_lookup_and_fork_answer_their_specific_status_and_nothing_of_others(tmp_path):
    tokens = tokens_for(2 * LAYOUT.chunk_tokens + 5)
    raw = tokens.numpy().astype("<u4").tobytes()
    async with running_server(tmp_path) as (_, target), channel(target) as ch:
        async with AsyncClient(target) as kv:
            await kv.spill("victim", "s1", LAYOUT.name, tokens,
                           streams_for(LAYOUT, len(tokens)), generation=1)
        stub = pb_grpc.KVTierStub(ch)

        def lookup(tenant: str, **fields):
            return status(stub.Lookup(pb.LookupRequest(
                tenant=tenant, layout_id=LAYOUT.name, **{"token_ids": raw, **fields})))

        own = await stub.Lookup(pb.LookupRequest(tenant="victim", layout_id=LAYOUT.name,
                                                 token_ids=raw))
        probe = await stub.Lookup(pb.LookupRequest(tenant="evil", layout_id=LAYOUT.name,
                                                   token_ids=raw))
        codes = {
            "unaligned": (await lookup("evil", token_ids=raw[:-1]))[0],
            "another tenant's domain": (await lookup("evil", dedupe_domain="victim"))[0],
            "an unlisted shared domain": (await lookup("evil", dedupe_domain="public"))[0],
            "an unknown layout": (await status(stub.Lookup(pb.LookupRequest(
                tenant="evil", layout_id="nope", token_ids=raw))))[0],
        }
        source = pb.SessionRef(tenant="victim", session_id="s1")

        def fork(new: str, upto: int, ref: pb.SessionRef = source):
            return status(stub.Fork(pb.ForkRequest(source=ref, new_session_id=new,
                                                   upto_tokens=upto)))

        forks = {
            "past the source": (await fork("f1", len(tokens) + 1))[0],
            "at 2^64 - 1": (await fork("f2", (1 << 64) - 1))[0],
            "onto itself": (await fork("s1", LAYOUT.chunk_tokens))[0],
            "a missing source": (await fork("f3", 0, pb.SessionRef(tenant="victim",
                                                                   session_id="zz")))[0],
            "a path as the new id": (await fork("../x", 0))[0],
        }
        first = (await fork("f4", LAYOUT.chunk_tokens))[0]
        onto_a_fork = (await fork("f4", LAYOUT.chunk_tokens))[0]
    assert own.tokens_held == 2 * LAYOUT.chunk_tokens
    assert probe.tokens_held == 0 and not probe.chunks  # victim's prefix is not evil's
    assert codes == {"unaligned": "INVALID_ARGUMENT", "another tenant's domain":
                     "PERMISSION_DENIED", "an unlisted shared domain": "PERMISSION_DENIED",
                     "an unknown layout": "INVALID_ARGUMENT"}
    assert forks == {"past the source": "FAILED_PRECONDITION",
                     "at 2^64 - 1": "FAILED_PRECONDITION", "onto itself": "INVALID_ARGUMENT",
                     "a missing source": "NOT_FOUND", "a path as the new id": "INVALID_ARGUMENT"}
    assert (first, onto_a_fork) == ("OK", "FAILED_PRECONDITION")


async def test_a_tenant_cannot_fork_or_look_up_another_tenants_sessions(tmp_path):
    """With identities: beta's Fork of acme's session and Lookup under acme are
    PERMISSION_DENIED; beta's Lookup of acme's tokens in its own domain finds nothing."""
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs) as (_, target), \
            certs.client(target, "acme") as acme:
        await spill_one(acme, "acme", "s1")
        raw = tokens_for(TOKENS).numpy().astype("<u4").tobytes()
        bearer = (("authorization", f"Bearer {certs.tokens['beta']}"),)
        ca = (tmp_path / "certs" / "ca.pem").read_bytes()
        async with grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(ca)) as ch:
            stub = pb_grpc.KVTierStub(ch)
            fork = await status(stub.Fork(pb.ForkRequest(
                source=pb.SessionRef(tenant="acme", session_id="s1"), new_session_id="mine",
                upto_tokens=LAYOUT.chunk_tokens), metadata=bearer))
            as_acme = await status(stub.Lookup(pb.LookupRequest(
                tenant="acme", layout_id=LAYOUT.name, token_ids=raw), metadata=bearer))
            own = await stub.Lookup(pb.LookupRequest(tenant="beta", layout_id=LAYOUT.name,
                                                     token_ids=raw), metadata=bearer)
        assert [s.session.session_id for s in await acme.list()] == ["s1"]
    assert fork[0] == "PERMISSION_DENIED" and "tenant 'beta'" in fork[1]
    assert as_acme[0] == "PERMISSION_DENIED"
    assert own.tokens_held == 0 and not own.chunks
