"""Reload without a restart, on a real ``kvtier serve`` process with a client spilling and
restoring in a loop: ``kvtier reload`` (SIGHUP) changes tokens, quotas, the log level and
the keyring and no request fails; a config or keyring file that does not parse is refused
with its line and column, the last good version stays in force, and the metrics say so.
SIGHUP never ends the server."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvtier import AsyncClient, Unauthenticated
from services.server.devcerts import tokens_toml
from tests.support.servers import free_port
from tests.support.service import LAYOUT, ROOT, stop_child, streams_for, tokens_for

TOKENS = LAYOUT.chunk_tokens + 10
GOOD = {"acme-token": ("acme", "tenant"), "beta-token": ("beta", "tenant")}


def _keyring(*ids: str, current: str) -> str:
    return "".join(f'[[key]]\nid = "{key_id}"\nmaterial = "'
                   f'{base64.b64encode(bytes([n]) * 32).decode()}"\n'
                   f'current = {"true" if key_id == current else "false"}\n\n'
                   for n, key_id in enumerate(ids, 1))


def _config(root: Path, *, tokens: str, sessions: int, level: str, metrics_port: int) -> str:
    return (f'log_level = "{level}"\nauth_tokens_file = "{root / tokens}"\n'
            f'encryption_key_file = "{root / "keys.toml"}"\nmetrics_port = {metrics_port}\n'
            f"[quota.acme]\nsessions = {sessions}\n")


def _reload(data_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "reload", "--data-dir",
                           str(data_dir)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


async def _traffic(target: str, stop: asyncio.Event, failures: list, done: list) -> None:
    """acme spills and restores in a loop until ``stop``; every failure is kept."""
    async with AsyncClient(target, token="acme-token") as kv:
        n = 0
        while not stop.is_set():
            name = f"loop-{n % 8}"
            try:
                await kv.spill("acme", name, LAYOUT.name, tokens_for(TOKENS, n),
                               streams_for(LAYOUT, TOKENS, seed=n), generation=n + 1)
                await kv.restore("acme", name)
                done.append(n)
            except Exception as exc:  # noqa: BLE001 - the test counts every kind
                failures.append(exc)
            n += 1


async def _accepted(target: str, token: str) -> bool:
    async with AsyncClient(target, token=token) as kv:
        try:
            await kv.list("beta" if token.startswith("beta") else "acme")
        except Unauthenticated:
            return False
    return True


async def _sessions_limit(target: str) -> int:
    async with AsyncClient(target, token="acme-token") as kv:
        return (await kv.stat(usage_of="acme")).tenant_usage.sessions_limit


async def _until_more(done: list, more: int) -> None:
    start = len(done)
    while len(done) < start + more:
        await asyncio.sleep(0.05)


async def test_reload_under_traffic_drops_no_request_and_keeps_the_last_good(tmp_path):
    root, data = tmp_path / "etc", tmp_path / "data"
    root.mkdir()
    (root / "tokens.toml").write_text(tokens_toml(GOOD))
    (root / "tokens-2.toml").write_text(tokens_toml({"acme-token": ("acme", "tenant")}))
    (root / "keys.toml").write_text(_keyring("k1", current="k1"))
    config = root / "kvtier.toml"
    metrics_port = free_port()
    config.write_text(_config(root, tokens="tokens.toml", sessions=100, level="WARNING",
                              metrics_port=metrics_port))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--preset", "test", "--config",
         str(config), "--data-dir", str(data), "--listen", "127.0.0.1:0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("kvtier serving on "), line
        target = line.split()[3].rstrip(",")
        stop, failures, done = asyncio.Event(), [], []
        traffic = asyncio.create_task(_traffic(target, stop, failures, done))
        await _until_more(done, 3)
        assert await _accepted(target, "beta-token")
        assert await _sessions_limit(target) == 100

        # tokens (another file: beta gone), quota, log level and keyring, all at once
        (root / "keys.toml").write_text(_keyring("k1", "k2", current="k2"))
        config.write_text(_config(root, tokens="tokens-2.toml", sessions=50, level="INFO",
                                  metrics_port=metrics_port))
        reloaded = _reload(data)
        assert reloaded.returncode == 0, reloaded
        assert "keyring (current k2)" in reloaded.stdout and "log level INFO" in reloaded.stdout
        await _until_more(done, 3)
        assert not await _accepted(target, "beta-token")
        assert await _sessions_limit(target) == 50
        assert _metric(metrics_port, "kvtier_config_reload_success") == 1

        # a config file that does not parse: refused with its position, nothing changes
        good = config.read_text()
        config.write_text(good.replace("sessions = 50", "sessions = 7\n[quota.acme"))
        refused = _reload(data)
        assert refused.returncode == 1 and "line 7, column" in refused.stderr, refused
        assert _metric(metrics_port, "kvtier_config_reload_success") == 0
        assert _metric(metrics_port, 'kvtier_config_reloads_total{result="failure"}') == 1
        # a keyring that does not parse: refused with its line and column
        config.write_text(good)
        (root / "keys.toml").write_text(_keyring("k1", "k2", current="k2")
                                        + '[[key]]\nid = "k3\n')
        refused = _reload(data)
        assert refused.returncode == 1, refused
        assert "encryption_key_file" in refused.stderr and "line 12, column" in refused.stderr
        await _until_more(done, 3)
        assert await _sessions_limit(target) == 50 and not await _accepted(target, "beta-token")

        process.send_signal(signal.SIGHUP)  # a bare SIGHUP: never the end of the server
        await _until_more(done, 3)
        assert process.poll() is None
        stop.set()
        await traffic
        assert failures == [], failures[:3]
    finally:
        stop_child(process)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "reloaded:" in text  # at INFO: the reloaded log level took effect first
    assert "reload refused" in text and "acme-token" not in text


def test_reload_without_a_server_says_so(tmp_path):
    result = _reload(tmp_path)
    assert result.returncode == 2 and "no kvtier serve runs" in result.stderr
    # a pid file left by a crash, its number reused by another process (this one): not
    # signalled (SIGHUP would end it)
    (tmp_path / "server.pid").write_text(f"{os.getpid()}\n")
    result = _reload(tmp_path)
    assert result.returncode == 2 and "no kvtier serve runs" in result.stderr


@pytest.mark.parametrize("missing", ["keys.toml"])
def test_a_missing_keyring_says_not_found(tmp_path, missing):
    from kvstore.encryption.seal import keyring_from_file
    from kvstore.format.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="does not exist"):
        keyring_from_file(tmp_path / missing)
