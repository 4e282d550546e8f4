"""Retiring an encryption key: ``kvtier keygen --rotate`` adds a current key, the servers
reload (or restart) with it, ``kvtier rekey`` reseals what is stored under the old one in
Redis and the bucket while each live server reseals its own disk, it says when the old key
is no longer needed, and a server holding only the new key then restores every session
bit-exact, all without stopping the node.
Against a real ``kvtier serve`` process with a real redis-server, and a fleet over moto S3."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from kvstore.encryption.seal import MAGIC, keyring_from_file, read_header
from kvstore.format.errors import InvalidRequest
from kvtier import AsyncClient
from services import cli
from tests.support.compaction import ROOT, SPECS, snapshot, spill_all
from tests.support.fleet import SPEC, assert_persistent, fleet, fleet_env, model_state

__all__ = ["fleet_env", "model_state"]  # fixtures, used by name


def keygen(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "keygen", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def rekey(capsys, config: Path, *argv: str) -> tuple[int, dict, str]:
    rc = cli.main(["rekey", "--config", str(config), "--json", *argv])
    out, err = capsys.readouterr()
    return rc, json.loads(out) if rc == 0 else {}, err


def rekey_process(config: Path) -> tuple[int, dict, str]:
    """``kvtier rekey`` in its own process, as beside servers on another host."""
    done = subprocess.run([sys.executable, "-m", "services.cli", "rekey", "--config",
                           str(config), "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return done.returncode, json.loads(done.stdout) if done.returncode == 0 else {}, done.stderr


def drop_key(keyring: Path, key_id: str) -> None:
    """Remove ``key_id``'s ``[[key]]`` table, as an operator does once rekey says so."""
    tables = re.split(r"(?m)^(?=\[\[key\]\])", keyring.read_text())
    kept = [t for t in tables if not re.search(rf'(?m)^id = "{key_id}"$', t)]
    assert len(kept) == len(tables) - 1
    keyring.write_text("".join(kept))


def redis_key_ids(url: str) -> set[str]:
    client = redis.Redis.from_url(url)
    values = [client.get(k) for k in client.scan_iter() if client.type(k) == b"string"]
    return {read_header(v).key_id for v in values if v and v.startswith(MAGIC)}


def test_rotate_adds_a_current_key_and_keeps_the_old_ones(tmp_path):
    path = tmp_path / "keys.toml"
    assert keygen(str(path), "--id", "k1").returncode == 0
    old = keyring_from_file(path)
    sealed = old.seal("chunk", "tenant:acme", b"hello")
    rotated = keygen("--rotate", str(path), "--id", "k2")
    assert rotated.returncode == 0, rotated.stderr
    assert "material" not in rotated.stdout
    keyring = keyring_from_file(path)
    assert keyring.key_ids == ["k1", "k2"] and keyring.current == "k2"
    assert keyring.open("chunk", sealed)[1] == b"hello"  # old values still open
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.toml"]  # nothing staged left
    again = keygen("--rotate", str(path), "--id", "k2")
    assert again.returncode == 2 and "already holds" in again.stderr
    assert keygen("--rotate", str(tmp_path / "none.toml")).returncode == 2


async def test_a_value_that_does_not_open_is_reported_and_the_rest_resealed(tmp_path):
    from kvstore.encryption.rekey import RekeyReport, census_tier_keys, rekey_tier
    from kvstore.encryption.seal import Keyring, MasterKey
    from kvstore.tiers.host import HostTier

    old, new = MasterKey("k1", bytes(range(32))), MasterKey("k2", bytes(range(1, 33)))
    medium = HostTier(1 << 20)
    sealed = Keyring([old]).seal("good", "tenant:acme", b"kv bytes", 7)
    damaged = bytearray(Keyring([old]).seal("bad", "tenant:acme", b"other bytes"))
    damaged[-1] ^= 1
    await medium.put("good", sealed)
    await medium.put("bad", bytes(damaged))
    keyring = Keyring([old, new], current="k2")
    report = RekeyReport(keyring.current, keyring.key_ids)
    await rekey_tier(medium, keyring, report)
    assert report.resealed == 1 and report.unreadable == ["bad"]
    header, plaintext = keyring.open("good", await medium.get("good"))
    assert (header.key_id, header.domain, header.layout_hash, plaintext) == \
        ("k2", "tenant:acme", 7, b"kv bytes")
    await census_tier_keys(medium, report)
    assert report.sealed_under_old == 1 and report.retired == []  # k1 still seals "bad"
    assert any("do not open" in line for line in report.lines())


def test_keyring_errors_name_the_line_and_column_and_a_missing_file(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text('[[key]]\nid = "k1"\nmaterial = "c2VjcmV0\n')
    with pytest.raises(InvalidRequest, match=r"line 3, column \d+") as caught:
        keyring_from_file(path)
    assert "c2VjcmV0" not in str(caught.value)  # no key material quoted
    with pytest.raises(InvalidRequest, match="does not exist"):
        keyring_from_file(tmp_path / "missing.toml")


@contextlib.contextmanager
def serving(config: Path, log: Path):
    """``kvtier serve --config`` in its own process; its address."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVTIER_ENCRYPTION_KEY", None)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--config",
                                 str(config), "--listen", "127.0.0.1:0"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("kvtier serving on "), log.read_text()[-3000:]
        yield line.split()[3].rstrip(",")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


async def spill_and_snapshot(address: str, only) -> dict:
    async with AsyncClient(address) as kv:
        await spill_all(kv, only=only)
        return {name: await snapshot(kv, name) for name in only}


async def snapshots(address: str, names) -> dict:
    async with AsyncClient(address) as kv:
        return {name: await snapshot(kv, name) for name in names}


def rekey_until_retired(run: Callable[[], tuple[int, dict, str]], key_id: str) -> dict:
    """``run`` (a ``kvtier rekey``) again until it says ``key_id`` is no longer needed: a
    live node's server reseals its own disk in the background (bounded wait)."""
    deadline = time.monotonic() + 120
    while True:
        rc, report, err = run()
        assert rc == 0, err
        if report["no_longer_needed"] == [key_id] or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def test_rekey_retires_a_key_on_a_live_encrypted_node(tmp_path, capsys, redis_server):
    keys = tmp_path / "keys.toml"
    assert keygen(str(keys), "--id", "k1").returncode == 0
    config = tmp_path / "kvtier.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\nredis_url = "{redis_server}"\n'
                      f'host_bytes = "64KiB"\nencryption_key_file = "{keys}"\n'
                      "retain_unreferenced = false\n")
    first = [spec.session_id for spec in SPECS[:4]]
    later = [spec.session_id for spec in SPECS[4:]]
    with serving(config, tmp_path / "serve1.log") as address:
        want = asyncio.run(spill_and_snapshot(address, first))
        assert redis_key_ids(redis_server) == {"k1"}
        assert keygen("--rotate", str(keys), "--id", "k2").returncode == 0
        reload(config)  # the live server takes k2 and reseals its own disk and manifests
        want |= asyncio.run(spill_and_snapshot(address, later))
        # this run reseals Redis; the server reseals its disk: until both are done
        report = rekey_until_retired(lambda: rekey(capsys, config), "k1")
        assert any("server running on them reseals" in line for line in report["skipped"])
        assert report["sealed_under_old"] == 0 and report["no_longer_needed"] == ["k1"], \
            report
        assert redis_key_ids(redis_server) == {"k2"}
        assert asyncio.run(snapshots(address, want)) == want  # served while rekeyed
        cli.main(["rekey", "--config", str(config)])
        assert "key k1 is no longer needed: remove it from the keyring" in \
            capsys.readouterr().out
        drop_key(keys, "k1")
        assert keyring_from_file(keys).key_ids == ["k2"]
        reload(config)  # the server forgets k1, still live
        assert asyncio.run(snapshots(address, want)) == want
    assert "reseal under k2" in (tmp_path / "serve1.log").read_text()
    with serving(config, tmp_path / "serve2.log") as address:  # and after a restart
        assert asyncio.run(snapshots(address, want)) == want


def reload(config: Path) -> None:
    """``kvtier reload`` of the server of ``config``'s data directory; it must take."""
    data_dir = re.search(r'data_dir = "(.*)"', config.read_text()).group(1)
    done = subprocess.run([sys.executable, "-m", "services.cli", "reload", "--data-dir",
                           data_dir], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done


def fleet_config(path: Path, env: dict, redis_url: str, keys: Path, data_dir: Path) -> Path:
    lines = [f"{name} = {json.dumps(value)}" for name, value in env.items()]
    path.write_text("\n".join([*lines, f'redis_url = "{redis_url}"',
                               f'encryption_key_file = "{keys}"', f'data_dir = "{data_dir}"',
                               'node_id = "a"', ""]))
    return path


async def test_rekey_retires_a_key_on_an_encrypted_fleet(tmp_path, capsys, fleet_env,
                                                         redis_server, model_state):
    _, ids, chunks, tail, _ = model_state
    keys = tmp_path / "keys.toml"
    assert keygen(str(keys), "--id", "k1").returncode == 0
    shared = {**fleet_env, "encryption_key_file": str(keys)}
    async with (fleet(tmp_path, shared, redis_server, names="ab") as nodes,
                AsyncClient(nodes["a"]) as on_a):
        for session in ("s1", "s2"):
            await on_a.spill("acme", session, SPEC, ids, chunks=chunks, tail=tail,
                             generation=1, ack="durable")
    assert keygen("--rotate", str(keys), "--id", "k2").returncode == 0
    config = fleet_config(tmp_path / "a.toml", fleet_env, redis_server, keys, tmp_path / "a")
    async with (fleet(tmp_path, shared, redis_server, names="ab") as nodes,
                AsyncClient(nodes["b"]) as on_b):
        await on_b.spill("acme", "s3", SPEC, ids, chunks=chunks, tail=tail,
                         generation=1, ack="durable")
        rc, report, err = await asyncio.to_thread(rekey_process, config)  # online
        assert rc == 0, err
        assert report["resealed"] > 0
        assert any("bucket" in place for place in report["places"])
        assert redis_key_ids(redis_server) <= {"k2"}
        for session in ("s1", "s2", "s3"):
            assert_persistent(await on_b.restore("acme", session, want_window=False),
                              chunks, tail)
        for node in "ab":  # each node's disk cache, resealed by its running server
            node_config = fleet_config(tmp_path / f"{node}.toml", fleet_env, redis_server,
                                       keys, tmp_path / node)
            report = await asyncio.to_thread(  # its own process: this one serves the disk
                rekey_until_retired, functools.partial(rekey_process, node_config), "k1")
            assert report["sealed_under_old"] == 0, report
        assert report["no_longer_needed"] == ["k1"]
    drop_key(keys, "k1")
    async with fleet(tmp_path, shared, redis_server, names="ab") as nodes:
        for node in "ab":
            async with AsyncClient(nodes[node]) as kv:
                for session in ("s1", "s2", "s3"):
                    assert_persistent(await kv.restore("acme", session, want_window=False),
                                      chunks, tail)
