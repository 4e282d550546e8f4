"""A TLS port is kvtier's own (``services.serving.tls_front``): a plaintext connection is
refused with a TLS alert and audited with the client's address, at most one line per host
a minute, every attempt counted; a TLS connection is relayed still encrypted, so mTLS,
the real peer of every call, health checks and the drain work as on gRPC's own port."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvstore.format.errors import PermissionDenied, TierUnavailable
from kvtier import AsyncClient
from services.cli.health import check
from services.serving import tls_front
from services.serving.audit import AuditLog
from services.serving.auth import client_peer
from services.serving.lifecycle import read_reload
from services.serving.tls_front import (
    PROTOCOL_VERSION_ALERT,
    PlaintextAudit,
    grpc_peer,
)
from tests.support.security import NO_RETRY, data_dir, dev_set, secured_server, spill_one
from tests.support.servers import free_port
from tests.support.service import running_server, serve_child, stop_child

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _plaintext_attempt(target: str) -> tuple[str, bytes]:
    """A plaintext HTTP/2 client's first bytes sent to ``target``: (the address it
    connected from, as gRPC names a peer; what the server answered before hanging up)."""
    host, _, port = target.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(H2_PREFACE + bytes(9))
        answer = b""
        while chunk := raw.recv(64):
            answer += chunk
        return grpc_peer(raw.getsockname()), answer


def _metric(port: int, ca: str, name: str) -> float:
    trusted = ssl.create_default_context(cafile=ca)
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=trusted,
                                timeout=10) as reply:
        text = reply.read().decode()
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def _plaintext_records(audit: Path) -> list[dict]:
    lines = audit.read_text().splitlines() if audit.exists() else []
    return [event for line in lines if (event := json.loads(line))["kind"] == "plaintext"]


async def test_a_server_process_audits_a_plaintext_client_with_its_address(tmp_path):
    certs = dev_set(tmp_path)
    audit = tmp_path / "audit.jsonl"
    metrics_port = free_port()
    config = tmp_path / "kvtier.toml"
    config.write_text(f'tls_cert = "{certs.path("server.pem")}"\n'
                      f'tls_key = "{certs.path("server-key.pem")}"\n'
                      f'audit_log = "{audit}"\nmetrics_port = {metrics_port}\n')
    process, target = serve_child(data_dir(tmp_path), config)
    try:
        peer, answer = await asyncio.to_thread(_plaintext_attempt, target)
        assert answer == PROTOCOL_VERSION_ALERT  # what a TLS server answers
        (record,) = _plaintext_records(audit)
        assert (record["peer"], record["reason"], record["result"], record["role"]) == (
            peer, "plaintext on a TLS port", "UNAVAILABLE", "anonymous")
        assert peer.startswith("ipv4:127.0.0.1:")
        # kvtier's own client names the mismatch; the record is not repeated within the
        # minute, the attempt is counted
        async with AsyncClient(target, retry=NO_RETRY, timeout_s=5) as plain:
            with pytest.raises(TierUnavailable, match="serves TLS and this client spoke "
                               "plaintext"):
                await plain.list()
        async with certs.client(target) as kv:  # TLS works unchanged through the front
            await spill_one(kv, "acme", "s1")
            assert [s.session.tenant for s in await kv.list()] == ["acme"]
        assert await check(target, "", 5.0, {"tls_ca": certs.ca}) == "SERVING"
        attempts = _metric(metrics_port, certs.ca, "kvtier_plaintext_attempts_total")
        assert attempts >= 2  # the raw attempt, the client's call (and its probe)
        # A flood: bounded connections, no new lines, every attempt counted, nothing left open
        await asyncio.gather(*(asyncio.to_thread(_plaintext_attempt, target)
                               for _ in range(200)))
        assert len(_plaintext_records(audit)) == 1
        # (a closed gRPC channel may have made one more connection attempt meanwhile)
        counted = _metric(metrics_port, certs.ca, "kvtier_plaintext_attempts_total")
        assert attempts + 200 <= counted <= attempts + 202
        assert _metric(metrics_port, certs.ca, "kvtier_tls_front_connections") == 0
        # SIGHUP: the reload is taken and the port keeps serving TLS
        process.send_signal(signal.SIGHUP)
        for _ in range(100):
            if (reloaded := read_reload(data_dir(tmp_path))) is not None:
                break
            await asyncio.sleep(0.1)
        assert reloaded is not None and reloaded[1].startswith("ok"), reloaded
        async with certs.client(target) as kv:
            assert [s.session.tenant for s in await kv.list()] == ["acme"]
    finally:
        stop_child(process)
    assert process.returncode == 0


def test_one_record_per_host_a_minute_and_the_hosts_remembered_are_bounded():
    now = [0.0]
    records: list[tuple[str, str]] = []
    counted = []

    class Recorder(AuditLog):
        def record(self, kind, identity, method, peer, result, reason="", target=""):
            records.append((peer, reason))

    attempts = PlaintextAudit(Recorder, lambda: counted.append(1), interval_s=60,
                              max_hosts=3, clock=lambda: now[0])
    for port in (1, 2, 3):
        attempts(f"ipv4:10.0.0.1:{port}")
    attempts("ipv6:[::1]:7")
    now[0] = 61.0
    attempts("ipv4:10.0.0.1:4")
    assert records == [("ipv4:10.0.0.1:1", "plaintext on a TLS port"),
                       ("ipv6:[::1]:7", "plaintext on a TLS port"),
                       ("ipv4:10.0.0.1:4", "plaintext on a TLS port (2 more from this host "
                                           "since the last record)")]
    assert len(counted) == 5
    for host in range(100):  # a flood from many hosts: the oldest forgotten first
        attempts(f"ipv4:10.1.0.{host}:1")
    assert len(attempts) == 3 and len(records) == 103


def test_the_relayed_peer_is_the_clients_address():
    class Context:
        def __init__(self, seen: str) -> None:
            self.seen = seen

        def peer(self) -> str:
            return self.seen

    assert client_peer(Context("unix-abstract:kvtier-peer/0a1b/ipv4:10.1.2.3:40000")) == \
        "ipv4:10.1.2.3:40000"
    assert client_peer(Context("ipv4:10.1.2.3:40000")) == "ipv4:10.1.2.3:40000"
    assert grpc_peer(("::ffff:10.1.2.3", 5, 0, 0)) == "ipv4:10.1.2.3:5"
    assert grpc_peer(("::1", 5, 0, 0)) == "ipv6:[::1]:5"


async def test_mtls_and_the_audit_see_the_client_through_the_front(tmp_path):
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs, tls_client_ca=certs.ca) as (server, target):
        assert server.front is not None
        client_tls = {"tls_cert": certs.path("client.pem"),
                      "tls_key": certs.path("client-key.pem")}
        async with certs.client(target, **client_tls) as acme:  # CN acme-client: acme
            await spill_one(acme, "acme", "s1")
            with pytest.raises(PermissionDenied):
                await acme.stat("beta", "x")
        async with certs.client(target, **client_tls) as again:
            with pytest.raises(PermissionDenied):
                await again.stat("beta", "y")
        for _ in range(50):  # a denial's line may be written just after its reply
            if len(certs.audit_lines()) == 2:
                break
            await asyncio.sleep(0.05)
        peers = [json.loads(line)["peer"] for line in certs.audit_lines()]
        assert len(peers) == 2 and all(p.startswith("ipv4:127.0.0.1:") for p in peers)
        assert peers[0] != peers[1]  # one per connection, as limits and leases need
        private = Path(server.front.private_target.removeprefix("unix:"))
        assert oct(os.stat(private).st_mode & 0o777) == "0o600"
        assert oct(os.stat(private.parent).st_mode & 0o777) == "0o700"
        # the drain: a connection open at stop is closed, the private socket removed
        kv = certs.client(target, "admin", **client_tls)
        await kv.list()
        await server.stop(0.5)
        assert not private.parent.exists()
        with pytest.raises(TierUnavailable):
            await kv.list()
        await kv.close()
    assert threading.active_count() < 50


async def test_connections_past_the_bound_and_silent_ones_are_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(tls_front, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(tls_front, "FIRST_BYTE_S", 1.0)
    certs = dev_set(tmp_path)
    async with running_server(data_dir(tmp_path), **certs.server_tls()) as (server, target):
        host, _, port = target.rpartition(":")

        def closed_at(raw: socket.socket) -> float:
            """When the server closed ``raw`` (which sends nothing)."""
            assert raw.recv(1) == b""
            return time.monotonic()

        connected = time.monotonic()
        silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(2)]
        await asyncio.sleep(0.2)  # both admitted: the bound is reached
        with socket.create_connection((host, int(port)), timeout=10) as third:
            started = time.monotonic()
            assert await asyncio.to_thread(closed_at, third) - started < 0.5  # at accept
        for raw in silent:  # closed unclassified once FIRST_BYTE_S passed
            assert 0.9 < await asyncio.to_thread(closed_at, raw) - connected < 5
            raw.close()
        for _ in range(50):  # the count drops just after the socket is closed
            if server.metrics.registry.get_sample_value("kvtier_tls_front_connections") == 0:
                break
            await asyncio.sleep(0.05)
        assert server.metrics.registry.get_sample_value("kvtier_tls_front_connections") == 0
        async with certs.client(target) as kv:  # room again
            assert await kv.list() == []
