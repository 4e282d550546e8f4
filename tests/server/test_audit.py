"""The audit trail of a real secured server: one JSON line per authentication failure,
permission denial, admin action and delete, with time, identity, method, peer and
result, never a token; and the Prometheus counter per kind."""

from __future__ import annotations

import asyncio
import json
import logging
import stat

import pytest

from kvtier import AsyncClient, PermissionDenied, Unauthenticated
from services.cli.main import main as kvtier_main
from tests.support.security import dev_set, secured_server, spill_one
from tests.support.service import running_server


def _count(server, kind: str) -> float:
    return server.metrics.registry.get_sample_value("kvtier_audit_events_total",
                                                    {"kind": kind})


async def test_every_kind_is_audited_without_the_token(tmp_path):
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs) as (server, target):
        assert {_count(server, k) for k in ("auth_failure", "permission_denied",
                                            "delete", "admin")} == {0.0}
        async with certs.client(target, token="wrong-token-value") as wrong:
            with pytest.raises(Unauthenticated):
                await wrong.list()
        async with certs.client(target, "acme") as acme, \
                certs.client(target, "admin") as admin:
            await spill_one(acme, "acme", "s1")
            await spill_one(acme, "acme", "s2")
            with pytest.raises(PermissionDenied):
                await acme.delete("beta", "s1")
            await acme.delete("acme", "s1")
            await admin.list()
            await admin.delete("acme", "s2")
        counts = {k: _count(server, k) for k in ("auth_failure", "permission_denied",
                                                   "delete", "admin")}
    assert counts == {"auth_failure": 1, "permission_denied": 1, "delete": 2, "admin": 1}
    events = [json.loads(line) for line in certs.audit_lines()]
    assert [(e["kind"], e["role"], e["tenant"], e["method"], e["result"]) for e in events] == [
        ("auth_failure", "anonymous", "", "List", "UNAUTHENTICATED"),
        ("permission_denied", "tenant", "acme", "Delete", "PERMISSION_DENIED"),
        ("delete", "tenant", "acme", "Delete", "OK"),
        ("admin", "admin", "", "List", "OK"),
        ("delete", "admin", "", "Delete", "OK"),
    ]
    for event in events:
        assert event["time"].endswith("+00:00") and event["peer"].startswith("ipv4:127.0.0.1:")
    # a denial names the tenant whose sessions were asked for, beside the caller's
    assert [e.get("target") for e in events] == [None, "beta", "acme", None, "acme"]
    text = (certs.root / "audit.jsonl").read_text()
    for token in (*certs.tokens.values(), "wrong-token-value"):
        assert token not in text


async def test_an_open_server_with_an_audit_log_records_anonymous_deletes(tmp_path):
    log = tmp_path / "audit.jsonl"
    async with running_server(tmp_path / "data", audit_log=str(log)) as (server, target):
        async with AsyncClient(target) as kv:
            await spill_one(kv, "acme", "s1")
            await kv.delete("acme", "s1")
            await kv.list()  # not an audited kind
        assert _count(server, "delete") == 1
    [event] = [json.loads(line) for line in log.read_text().splitlines()]
    assert (event["kind"], event["role"], event["method"]) == ("delete", "anonymous", "Delete")


async def test_the_cli_sends_tls_and_a_token_file(tmp_path, capsys, monkeypatch):
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs) as (_, target), \
            certs.client(target, "acme") as acme:
        await spill_one(acme, "acme", "s1")
        flags = ["--server", target, "--tls-ca", certs.ca]
        code = await asyncio.to_thread(kvtier_main, ["list", *flags, "--token-file",
                                                     certs.path("admin.token")])
        assert code == 0 and "acme/s1" in capsys.readouterr().out
        monkeypatch.setenv("KVTIER_TOKEN", certs.tokens["beta"])
        code = await asyncio.to_thread(kvtier_main, ["list", *flags])
        assert code == 0 and "0 sessions" in capsys.readouterr().out
        monkeypatch.delenv("KVTIER_TOKEN")
        code = await asyncio.to_thread(kvtier_main, ["stat", *flags])
        assert code == 1 and "UNAUTHENTICATED" in capsys.readouterr().err


async def test_the_audit_log_and_the_data_directory_are_the_owners_only(tmp_path, caplog):
    log, data = tmp_path / "audit.jsonl", tmp_path / "data"
    async with running_server(data, audit_log=str(log)):
        pass
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    log.chmod(0o644)  # made by hand, or by an older release: tightened, with a warning
    data.chmod(0o755)
    with caplog.at_level(logging.WARNING):
        async with running_server(data, audit_log=str(log)):
            pass
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert "audit_log" in caplog.text and "data_dir" in caplog.text
