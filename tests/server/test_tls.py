"""Transport security over real gRPC: TLS and mTLS with certificates the tests make, the
metrics endpoint over HTTPS on loopback, the replay worker behind TLS and the replay role,
and the safe default that refuses a non-loopback listen in clear."""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvstore.format.errors import PermissionDenied, TierUnavailable, Unauthenticated
from kvtier import AsyncClient
from kvtier.channel import Credentials
from replay.worker import ReplayWorker
from services.cli.health import check
from services.replay.remote import RemoteReplay
from services.replay.server import create_server as create_worker_server
from services.replay.server import security
from services.serving.tls import exposure_problem
from tests.support.replay import TINY_SPEC, tiny_model, tiny_session
from tests.support.security import NO_RETRY, data_dir, dev_set, secured_server, spill_one
from tests.support.servers import free_port
from tests.support.service import running_server

ROOT = Path(__file__).resolve().parents[2]


async def test_a_plaintext_client_cannot_talk_to_a_tls_server(tmp_path):
    certs = dev_set(tmp_path)
    async with running_server(data_dir(tmp_path), **certs.server_tls()) as (_, target):
        async with AsyncClient(target, retry=NO_RETRY, timeout_s=5) as plain:
            with pytest.raises(TierUnavailable, match="serves TLS and this client spoke "
                               "plaintext"):
                await plain.list()
        async with certs.client(target) as kv:  # TLS, no authentication: tenants named
            await spill_one(kv, "acme", "s1")
            assert [s.session.tenant for s in await kv.list()] == ["acme"]
        # A CA that did not sign the server's certificate: the handshake fails, named so.
        async with AsyncClient(target, tls_ca=certs.path("stranger.pem"), retry=NO_RETRY,
                               timeout_s=5) as wrong:
            with pytest.raises(TierUnavailable, match="not signed by the CA given"):
                await wrong.list()
        for flags, named in (([], "spoke plaintext"),
                             (["--tls-ca", certs.path("stranger.pem")], "not signed")):
            done = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "services.cli", "list", "--server",
                                 target, *flags], cwd=ROOT, capture_output=True, text=True,
                timeout=60)
            assert done.returncode == 1 and named in done.stderr, done
            assert "kvtier serve` running" not in done.stderr
            health = await check(target, "", 5.0, {"tls_ca": flags[1]} if flags else {})
            assert health.startswith("UNAVAILABLE (TLS:") and named in health


async def test_a_tls_client_against_a_plaintext_server_is_told_so(tmp_path):
    certs = dev_set(tmp_path)
    async with running_server(data_dir(tmp_path)) as (_, target), \
            AsyncClient(target, tls_ca=certs.ca, retry=NO_RETRY, timeout_s=5) as kv:
        with pytest.raises(TierUnavailable, match="does not speak TLS"):
            await kv.list()


async def test_a_server_that_is_not_there_is_not_called_a_tls_mismatch(tmp_path):
    async with AsyncClient(f"127.0.0.1:{free_port()}", retry=NO_RETRY, timeout_s=5) as kv:
        with pytest.raises(TierUnavailable) as raised:
            await kv.list()
    assert "TLS" not in str(raised.value)


def test_a_token_never_travels_in_clear_off_loopback():
    with pytest.raises(Exception, match="travel in clear"):
        AsyncClient("10.1.2.3:50051", token="secret")


async def test_mtls_names_the_identity_by_certificate(tmp_path):
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs, tls_client_ca=certs.ca) as (_, target):
        # The dev client certificate (CN acme-client) is mapped to tenant acme.
        async with certs.client(target, tls_cert=certs.path("client.pem"),
                                tls_key=certs.path("client-key.pem")) as acme:
            await spill_one(acme, "acme", "s1")
            assert [s.session.tenant for s in await acme.list()] == ["acme"]
            with pytest.raises(PermissionDenied):
                await acme.stat("beta", "x")
        # No client certificate: the handshake itself is refused.
        async with certs.client(target, "admin", timeout_s=5) as bare:
            with pytest.raises(TierUnavailable):
                await bare.list()
        # The mapped CN from another CA is refused too.
        async with certs.client(target, tls_cert=certs.path("stranger.pem"),
                                tls_key=certs.path("stranger-key.pem"), timeout_s=5) as fake:
            with pytest.raises(TierUnavailable):
                await fake.list()
        # The server's own certificate (CN kvtier) is valid but maps to no identity.
        async with certs.client(target, tls_cert=certs.path("server.pem"),
                                tls_key=certs.path("server-key.pem")) as unmapped:
            with pytest.raises(Unauthenticated, match="CN='kvtier'"):
                await unmapped.list()
        # A token wins over the certificate's identity.
        async with certs.client(target, "admin", tls_cert=certs.path("client.pem"),
                                tls_key=certs.path("client-key.pem")) as admin:
            assert len(await admin.list()) == 1


async def test_metrics_are_served_over_https_on_loopback(tmp_path):
    certs = dev_set(tmp_path)
    port = free_port()
    async with running_server(data_dir(tmp_path), metrics_port=port,
                              **certs.server_tls()) as (server, _):
        assert server.metrics_port == port
        trusted = ssl.create_default_context(cafile=certs.ca)
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=trusted,
                                    timeout=10) as response:
            assert "kvtier_tier_used_bytes" in response.read().decode()
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
        bound = server.metrics._http.server_address[0]
        assert bound == "127.0.0.1"


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _worker_args(certs, **changes):
    args = argparse.Namespace(
        tls_cert=certs.path("server.pem"), tls_key=certs.path("server-key.pem"),
        tls_client_ca="", auth_tokens_file=certs.path("tokens.toml"), auth_jwt_key="",
        auth_jwt_audience="", audit_log=certs.path("worker-audit.jsonl"))
    for name, value in changes.items():
        setattr(args, name, value)
    return args


async def test_only_the_replay_role_may_call_a_secured_worker(tmp_path, model):
    certs = dev_set(tmp_path)
    state, chunks, tail = tiny_session(model, 45)
    worker = ReplayWorker(model, default_tokens=16)
    credentials, interceptors = security(_worker_args(certs))
    server, port = await create_worker_server("127.0.0.1:0", worker, name="w1",
                                              credentials=credentials,
                                              interceptors=interceptors)
    address = f"127.0.0.1:{port}"
    try:
        for name, expected in (("replay", None), ("acme", PermissionDenied),
                               ("admin", PermissionDenied), (None, Unauthenticated)):
            token = certs.tokens[name] if name else None
            backend = RemoteReplay([address], timeout_s=30,
                                   credentials=Credentials(tls_ca=certs.ca, token=token))
            try:
                if expected is None:
                    result = await backend.rebuild(TINY_SPEC.layout_id, state.token_ids,
                                                   chunks, tail)
                    assert result.replayed_tokens == 16
                else:
                    with pytest.raises(expected):
                        await backend.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks,
                                              tail)
            finally:
                await backend.close()
        plain = RemoteReplay([address], timeout_s=5)  # no TLS: no answer at all
        try:
            with pytest.raises(TierUnavailable):
                await plain.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail)
        finally:
            await plain.close()
    finally:
        await server.stop(0)
        await worker.close()
    audit = (certs.root / "worker-audit.jsonl").read_text()
    assert '"role": "tenant"' in audit and '"result": "PERMISSION_DENIED"' in audit


def _kvtier(*argv: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "AWS_"))}
    return subprocess.Popen([sys.executable, "-m", "services.cli", *argv], cwd=ROOT, env=clean,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_non_loopback_listen_in_clear_is_refused_unless_insecure(tmp_path):
    refused = _kvtier("serve", "--data-dir", str(tmp_path / "d"), "--listen", "0.0.0.0:0")
    out, err = refused.communicate(timeout=120)
    assert refused.returncode == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier serve: refusing to serve 0.0.0.0:0")
    assert "--insecure" in lines[0] and "TLS" in lines[0] and "authentication" in lines[0]
    assert not (tmp_path / "d").exists()  # refused before the store was opened
    started = _kvtier("serve", "--data-dir", str(tmp_path / "d"), "--listen", "0.0.0.0:0",
                      "--insecure")
    try:
        line = started.stdout.readline()
        assert line.startswith("kvtier serving on 0.0.0.0:"), (line, started.stderr.read())
    finally:
        started.terminate()
        started.communicate(timeout=60)
    assert started.returncode == 0


def test_the_safe_default_needs_both_tls_and_authentication():
    assert exposure_problem("127.0.0.1:50051", False, False) is None
    assert exposure_problem("[::1]:50051", False, False) is None
    assert exposure_problem("localhost:50051", False, False) is None
    assert exposure_problem("0.0.0.0:50051", True, True) is None
    for tls, auth in ((False, False), (True, False), (False, True)):
        assert exposure_problem("0.0.0.0:50051", tls, auth) is not None
    assert exposure_problem("kv.example:50051", True, False) is not None


def test_the_replay_worker_refuses_a_non_loopback_listen_in_clear():
    worker = _kvtier("replay-worker", "--listen", "0.0.0.0:0", "--weights", "/nonexistent")
    out, err = worker.communicate(timeout=120)
    lines = err.splitlines()
    assert worker.returncode == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("kvtier replay-worker: refusing to serve 0.0.0.0:0")
