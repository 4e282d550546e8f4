"""A fleet node that hangs (its process stopped with SIGSTOP: connections accepted, nothing
answered) is down for a routed client exactly like one that refuses: the call goes to
the next node within its share of the deadline, the node is skipped for the cool-down and
used again after it; with every node silent the call ends at its deadline
(``DeadlineExceeded``), whatever the call (unary or stream), and the default deadline is
finite. Real ``kvtier serve`` processes, two standalone nodes (calls naming no session go
to the first node up, so ``Stat``'s ``node_id`` says which node answered)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from kvtier import Client, DeadlineExceeded, RoutingPolicy
from kvtier import codec as cc
from kvtier.client import DEFAULT_TIMEOUT_S
from testing.live_server import LiveServer
from tests.support.service import LAYOUT, streams_for, tokens_for

C = LAYOUT.chunk_tokens


@pytest.fixture
def nodes(tmp_path):
    """Two live servers, a and b: name -> LiveServer."""
    with contextlib.ExitStack() as stack:
        live = {}
        for name in "ab":
            (tmp_path / name).mkdir()
            live[name] = stack.enter_context(
                LiveServer(tmp_path / name / "data", tmp_path / name, replay=False,
                           env={"KVTIER_NODE_ID": name}))
        yield live


@contextlib.contextmanager
def hung(*servers: LiveServer):
    """The servers stopped (SIGSTOP) inside the block, continued after it."""
    for server in servers:
        os.kill(server.server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for server in servers:
            os.kill(server.server.pid, signal.SIGCONT)


def node_of(client: Client) -> str:
    return client.stat().node_id


@pytest.mark.timeout(120)
def test_a_hung_node_fails_over_within_the_deadline_and_is_used_again_after_its_cool_down(
        nodes):
    a, b = nodes["a"], nodes["b"]
    timeout_s = 4.0
    with Client(servers=[a.target, b.target], timeout_s=timeout_s,
                routing=RoutingPolicy(cooldown_s=1.0)) as kv:
        node_a = node_of(kv)
        with hung(a):
            started = time.monotonic()
            node_b = node_of(kv)  # A first, silent for its share; then B
            assert time.monotonic() - started < timeout_s
            assert node_b != node_a
            started = time.monotonic()
            assert kv.layouts()  # A in its cool-down: straight to B
            assert kv.lookup("acme", "kvtier-bundled", list(range(64))) == 0
            assert time.monotonic() - started < timeout_s / 2  # A was not waited for
        time.sleep(1.5)  # past the cool-down, A continued
        assert node_of(kv) == node_a


@pytest.mark.timeout(120)
def test_with_every_node_hung_each_call_ends_at_its_deadline(nodes):
    a, b = nodes["a"], nodes["b"]
    timeout_s = 3.0
    with Client(servers=[a.target, b.target], timeout_s=timeout_s) as kv:
        kv.layouts()  # connected, and the layouts known
        calls = {
            "stat": kv.stat,
            "restore (a stream)": lambda: kv.restore("acme", "s1"),
            "restore_layers (a stream)": lambda: list(kv.restore_layers("acme", "s1")),
            "read_chunks (a stream)": lambda: kv.read_chunks("acme", "kvtier-bundled",
                                                             list(range(64))),
        }
        with hung(a, b):
            each_ends_at_the_deadline(calls, timeout_s)


def each_ends_at_the_deadline(calls: dict, timeout_s: float) -> None:
    """Every call raises ``DeadlineExceeded`` at its deadline: not before, nor long after."""
    for name, call in calls.items():
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            call()
        took = time.monotonic() - started
        assert timeout_s * 0.95 <= took < 2 * timeout_s, (name, took)


@pytest.mark.timeout(120)
def test_writes_fail_over_from_a_hung_node_and_end_at_the_deadline_when_all_hang(nodes):
    """Spill and WriteChunks (client streams) go to the next node within the deadline,
    and are whole there; with both nodes silent they end at the deadline."""
    a, b = nodes["a"], nodes["b"]
    timeout_s = 4.0
    tokens = cc.as_tokens(tokens_for(2 * C))
    streams = streams_for(LAYOUT, 2 * C)
    chunks = cc.encode_chunks(LAYOUT, tokens, streams)
    with Client(servers=[a.target, b.target], timeout_s=timeout_s,
                routing=RoutingPolicy(cooldown_s=60.0)) as kv:
        kv.layouts()
        with hung(a):
            started = time.monotonic()
            # acme/s3's chosen node is A (the hash over servers), write_chunks's the first up
            kv.spill("acme", "s3", LAYOUT.name, tokens, streams, generation=1)
            written = kv.write_chunks("acme", LAYOUT.name, tokens, chunks, skip_held=False)
            assert time.monotonic() - started < 2 * timeout_s  # two calls, each within one
            assert written.chunks_written + written.chunks_deduped == 2
            assert len(kv.restore("acme", "s3").token_ids) == 2 * C  # on B, whole
            assert sorted(kv.read_chunks("acme", LAYOUT.name, tokens).chunks) == [0, 1]
        with hung(a, b):
            each_ends_at_the_deadline({
                "spill": lambda: kv.spill("acme", "s2", LAYOUT.name, tokens, streams,
                                          generation=1),
                "write_chunks": lambda: kv.write_chunks("acme", LAYOUT.name, tokens, chunks),
            }, timeout_s)


@pytest.mark.timeout(60)
def test_a_single_hung_server_ends_the_call_at_its_deadline(nodes):
    a = nodes["a"]
    with Client(a.target, timeout_s=2.0) as kv, hung(a):
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            kv.stat()
        assert 1.9 <= time.monotonic() - started < 4.0


@pytest.mark.timeout(60)
def test_a_delete_is_not_sent_again_after_a_silent_node(nodes):
    """A Delete that may have landed on the silent node is reported, not repeated on the
    next node (which would answer as if there had been nothing to delete)."""
    a, b = nodes["a"], nodes["b"]
    with Client(servers=[a.target, b.target], timeout_s=4.0) as kv:
        kv.stat()
        with hung(a):
            with pytest.raises(DeadlineExceeded, match="may have been applied"):
                kv.delete("acme", "s1")
            assert node_of(kv) != ""  # A in its cool-down: B answers at once


def test_every_client_has_a_finite_deadline_unless_told_otherwise():
    with Client(servers=["127.0.0.1:1", "127.0.0.1:2"]) as kv:
        assert kv._async.timeout_s == DEFAULT_TIMEOUT_S < float("inf")


@pytest.mark.slow  # waits half the default deadline for the hung node
@pytest.mark.timeout(DEFAULT_TIMEOUT_S * 2)
def test_the_default_deadline_fails_over_from_a_hung_node(nodes):
    a, b = nodes["a"], nodes["b"]
    with Client(servers=[a.target, b.target]) as kv:
        node_a = node_of(kv)
        with hung(a):
            assert node_of(kv) not in ("", node_a)
