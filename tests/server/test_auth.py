"""Authentication and authorization over real gRPC with TLS: bearer tokens from the tokens
file (reloaded while serving) and JWTs; every cross-tenant call is PERMISSION_DENIED and
answers nothing of the other tenant; admins see every tenant; health stays open."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvtier import AsyncClient, PermissionDenied, SessionNotFound, Unauthenticated
from services.server.devcerts import tokens_toml
from tests.support.security import (
    JWT_SECRET,
    TOKENS,
    data_dir,
    dev_set,
    jwt_for,
    secured_server,
    spill_one,
)
from tests.support.service import running_server, tokens_for


async def test_a_missing_or_wrong_token_is_unauthenticated(tmp_path):
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs) as (_, target):
        async with certs.client(target) as kv:
            with pytest.raises(Unauthenticated, match="needs a credential"):
                await kv.list()
        async with certs.client(target, token="not-a-token") as kv:
            with pytest.raises(Unauthenticated, match="unknown credential"):
                await kv.stat()
        async with certs.client(target, "acme") as kv:
            assert await kv.list() == []


async def test_cross_tenant_calls_are_denied_and_answer_nothing(tmp_path):
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs) as (_, target), \
            certs.client(target, "acme") as acme, certs.client(target, "beta") as beta:
        await spill_one(acme, "acme", "s1")
        await spill_one(beta, "beta", "b1", seed=3)
        denied = {
            "restore": beta.restore("acme", "s1"),
            "resume": beta.resume("acme", "s1"),
            "list": beta.list("acme"),
            "stat": beta.stat("acme", "s1"),
            "delete": beta.delete("acme", "s1"),
            "evict": beta.evict("acme", "s1", "disk"),
            "prefetch": beta.prefetch("acme", "s1"),
            # A spill under acme's name: no dedupe answer about acme's chunks either.
            "spill": spill_one(beta, "acme", "probe"),
            # A session that does not exist is denied alike: no existence oracle.
            "stat missing": beta.stat("acme", "nothing-here"),
            "quota usage": beta.stat(usage_of="acme"),
        }
        for name, call in denied.items():
            with pytest.raises(PermissionDenied, match="tenant 'beta'"):
                await call
                pytest.fail(f"{name} was answered")
        assert (await beta.stat(usage_of="beta")).tenant_usage is not None
        # An empty filter lists the caller's own sessions only.
        assert [s.session.tenant for s in await beta.list()] == ["beta"]
        # Same bytes spilled by beta into its own domain: no dedupe against acme's.
        again = await spill_one(beta, "beta", "copy")
        assert again.chunks_deduped == 0
        # acme's session is intact.
        restored = await acme.restore("acme", "s1")
        assert restored.token_ids.tolist() == tokens_for(TOKENS).tolist()
        with pytest.raises(SessionNotFound):
            await acme.restore("acme", "probe")


async def test_an_admin_lists_and_stats_every_tenant_but_reads_no_kv(tmp_path):
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs) as (_, target), \
            certs.client(target, "acme") as acme, certs.client(target, "beta") as beta, \
            certs.client(target, "admin") as admin:
        await spill_one(acme, "acme", "s1")
        await spill_one(beta, "beta", "b1", seed=3)
        listed = {f"{s.session.tenant}/{s.session.session_id}" for s in await admin.list()}
        assert listed == {"acme/s1", "beta/b1"}
        assert (await admin.stat("beta", "b1")).session.session.session_id == "b1"
        with pytest.raises(PermissionDenied, match="role 'admin' may not call Restore"):
            await admin.restore("acme", "s1")
        await admin.evict("acme", "s1", "disk")  # what a live compaction asks
        assert (await admin.delete("beta", "b1")).chunks_released > 0
        with pytest.raises(PermissionDenied, match="role 'replay' may not call List"):
            async with certs.client(target, "replay") as replay:
                await replay.list()


async def test_the_tokens_file_is_reloaded_while_serving(tmp_path):
    certs = dev_set(tmp_path)
    tokens_file = certs.root / "tokens.toml"
    async with secured_server(tmp_path, certs) as (_, target), \
            certs.client(target, token="gamma-new-token") as gamma, \
            certs.client(target, "acme") as acme:
        with pytest.raises(Unauthenticated):
            await gamma.list()
        # Rotation: gamma added, acme's token revoked, written whole (as an editor does).
        replaced = tokens_file.with_suffix(".new")
        replaced.write_text(tokens_toml({"gamma-new-token": ("gamma", "tenant"),
                                         certs.tokens["admin"]: ("", "admin")}))
        replaced.replace(tokens_file)
        for _ in range(100):  # checked at most once a second
            try:
                assert await gamma.list() == []
                break
            except Unauthenticated:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("the new token was never accepted")
        with pytest.raises(Unauthenticated):
            await acme.list()
        # An edit that does not parse keeps the last good version
        # (tests/server/test_tokens_file.py).
        tokens_file.write_text("[[token]\nbroken")
        await asyncio.sleep(1.2)
        assert await gamma.list() == []
        with pytest.raises(Unauthenticated):
            await acme.list()


async def test_jwts_are_checked_for_signature_expiry_and_audience(tmp_path):
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs, auth_jwt_key=JWT_SECRET,
                              auth_jwt_audience="kvtier") as (_, target):
        good = jwt_for({"tenant": "acme", "role": "tenant", "aud": "kvtier"})
        async with certs.client(target, token=good) as kv:
            await spill_one(kv, "acme", "s1")
            with pytest.raises(PermissionDenied):
                await kv.list("beta")
        for bad, why in [
            (jwt_for({"tenant": "acme", "aud": "kvtier"}, lifetime_s=-60), "expired"),
            (jwt_for({"tenant": "acme", "aud": "someone-else"}), "unknown credential"),
            (jwt_for({"tenant": "acme"}), "unknown credential"),  # no audience
            (jwt_for({"tenant": "acme", "aud": "kvtier"}, key=JWT_SECRET[::-1]),
             "unknown credential"),  # signed with another secret
        ]:
            async with certs.client(target, token=bad) as kv:
                with pytest.raises(Unauthenticated, match=why):
                    await kv.list()


async def test_jwts_signed_with_a_private_key_are_checked_with_its_public_key(tmp_path):
    certs = dev_set(tmp_path)
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public_file = tmp_path / "jwt-public.pem"
    public_file.write_bytes(private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    pem = private.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    async with secured_server(tmp_path, certs, auth_jwt_key=str(public_file)) as (_, target):
        token = jwt_for({"tenant": "", "role": "admin"}, key=pem, algorithm="RS256")
        async with certs.client(target, token=token) as kv:
            assert await kv.list() == []
        forged = jwt_for({"tenant": "", "role": "admin"}, key=JWT_SECRET)  # HS256
        async with certs.client(target, token=forged) as kv:
            with pytest.raises(Unauthenticated):
                await kv.list()


async def test_health_stays_open_and_reflection_is_off_unless_configured(tmp_path):
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs) as (_, target):
        credentials = grpc.ssl_channel_credentials(Path(certs.ca).read_bytes())
        async with grpc.aio.secure_channel(target, credentials) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier"))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                _ = [r async for r in stream]
            assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_loopback_without_authentication_stays_open_with_named_tenants(tmp_path):
    async with running_server(data_dir(tmp_path)) as (_, target), \
            AsyncClient(target) as kv:
        await spill_one(kv, "acme", "s1")
        await spill_one(kv, "beta", "s1")
        assert {s.session.tenant for s in await kv.list()} == {"acme", "beta"}
