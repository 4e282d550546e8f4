"""The offline tools on an encrypted data directory filled by the real server through the
real client: without the server's key (``--config`` key file or ``KVTIER_ENCRYPTION_KEY``)
``kvtier compact`` refuses before touching anything, with it every step works (sessions
expire and demote, dead space is reclaimed, the scrub opens sealed chunks and quarantines
only a truly corrupt one) and a real server with the key restores every session
bit-exact afterwards. A wrong key, or a key given to a clear directory, is refused too.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.encryption.census import Census
from kvstore.encryption.seal import MAGIC, Keyring, MasterKey
from kvstore.format.errors import InvalidRequest, SessionNotFound
from kvtier import AsyncClient
from services import cli
from tests.support.compaction import (
    HOUR,
    ROOT,
    SPECS,
    Snapshot,
    embedded_server,
    flip_value_byte,
    snapshot,
    spill_all,
)

KEY = base64.b64encode(bytes(range(40, 72))).decode()
WRONG = base64.b64encode(bytes(range(1, 33))).decode()  # another key under the same id


async def fill(data_dir: Path, *, key: str | None = KEY, delete=("d", "f")
               ) -> tuple[dict[str, Snapshot], float]:
    """Spill SPECS through a sealing server, delete ``delete`` (dead segment space), and
    return what restores give for the others, and a time after every spill."""
    async with embedded_server(data_dir, key) as target, AsyncClient(target) as kv:
        await spill_all(kv)
        for session_id in delete:
            await kv.delete("acme", session_id)
        done = time.time()
        return {spec.session_id: await snapshot(kv, spec.session_id) for spec in SPECS
                if spec.session_id not in delete}, done


async def restore_all(data_dir: Path, names, key: str | None = KEY) -> dict[str, Snapshot]:
    async with embedded_server(data_dir, key) as target, AsyncClient(target) as kv:
        return {name: await snapshot(kv, name) for name in names}


def files(root: Path) -> dict[str, bytes]:
    """Every file's bytes but the lock files' (they name the pid that last held them)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix != ".lock"}


def key_config(tmp_path: Path, material: str, key_id: str = "env", extra: str = "") -> Path:
    key_file = tmp_path / f"{key_id}-{material[:6]}.keys.toml"
    key_file.write_text(f'[[key]]\nid = "{key_id}"\nmaterial = "{material}"\n')
    config = tmp_path / f"{key_id}-{material[:6]}.toml"
    config.write_text(f'encryption_key_file = "{key_file}"\n{extra}')
    return config


def compact(capsys, monkeypatch, data: Path, *args: str, key: str | None = None
            ) -> tuple[int, dict | None, str]:
    """``kvtier compact`` in-process, with ``key`` (or none) in the environment."""
    monkeypatch.delenv("KVTIER_ENCRYPTION_KEY", raising=False)
    monkeypatch.delenv("KVTIER_ENCRYPTION_KEY_FILE", raising=False)
    if key is not None:
        monkeypatch.setenv("KVTIER_ENCRYPTION_KEY", key)
    rc = cli.main(["compact", "--data-dir", str(data), *args])
    out, err = capsys.readouterr()
    return rc, json.loads(out.strip().splitlines()[-1]) if rc == 0 and out.strip() else None, err


def test_compact_without_the_key_refuses_and_touches_nothing(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    snaps, _ = asyncio.run(fill(data))
    before = files(data)
    for extra in ((), ("--dry-run",), ("--no-scrub", "--ttl", "0s")):
        rc, report, err = compact(capsys, monkeypatch, data, "--json", *extra)
        assert rc == 2 and report is None, err
        assert "encrypt" in err and "KVTIER_ENCRYPTION_KEY" in err, err
        assert "quarantine" not in err and "bad manifest magic" not in err, err
        assert files(data) == before  # nothing quarantined, moved, rewritten or deleted
    # A key of the server's id with other material opens nothing: refused the same way.
    rc, _, err = compact(capsys, monkeypatch, data, "--json", key=WRONG)
    assert rc == 2 and "does not open" in err, err
    rc, _, err = compact(capsys, monkeypatch, data, "--json", "--config",
                         str(key_config(tmp_path, KEY, key_id="other")))
    assert rc == 2 and "'env'" in err, err
    assert files(data) == before
    assert asyncio.run(restore_all(data, snaps)) == snaps


def test_compact_with_the_key_expires_demotes_reclaims_and_scrubs(tmp_path, capsys,
                                                                   monkeypatch):
    data = tmp_path / "data"
    snaps, done = asyncio.run(fill(data))
    corrupt = snaps["e"].chunk_keys[1]  # e's own chunk, sealed: flipped in its ciphertext
    flip_value_byte(data, corrupt)
    later = ("--as-of", repr(done + 2 * HOUR))
    rc, report, err = compact(capsys, monkeypatch, data, "--json", "--ttl", "3h",
                              "--demote-after", "1h", *later, key=KEY)
    assert rc == 0, err
    assert report["mode"] == "offline" and report["sessions_expired"] == 0
    # e names the damaged chunk: its demotion fails (reported), every other one moves
    assert sorted(report["demoted"]) == [f"acme/{name}" for name in sorted(set(snaps) - {"e"})]
    assert [why.split(" failed")[0] for why in report["skipped"]] == ["demotion of acme/e"]
    assert report["reclaimed_bytes"] > 0 and report["segments_rewritten"] > 0
    assert report["corrupt_keys"] == [f"disk:{corrupt}"]  # only the one really damaged
    assert report["marked_sessions"] == ["acme/e"]
    assert sorted(p.name for p in (data / "quarantine").iterdir()) == [
        f"disk-{corrupt}.bin", f"disk-{corrupt}.json"]
    intact = sorted(set(snaps) - {"e"})
    assert asyncio.run(restore_all(data, intact)) == {name: snaps[name] for name in intact}

    # A demoted chunk altered in place in the object tier: only authentication can tell.
    victim = snaps["a"].chunk_keys[-1]  # a's own (b and c share its first two)
    [path] = (data / "objects").glob(f"*/{victim}.*")
    sealed = bytearray(path.read_bytes())
    assert sealed.startswith(MAGIC)
    sealed[len(sealed) // 2] ^= 0x01
    path.write_bytes(bytes(sealed))
    rc, scrubbed, err = compact(capsys, monkeypatch, data, "--json", key=KEY)
    assert rc == 0 and scrubbed["corrupt_keys"] == [f"object:{victim}"], err
    assert scrubbed["marked_sessions"] == ["acme/a"]

    # The key from the config's key file, and an expiry: the sessions and their chunks go.
    config = str(key_config(tmp_path, KEY, extra="retain_unreferenced = false\n"))
    rc, again, err = compact(capsys, monkeypatch, data, "--json", "--config", config,
                             "--ttl", "1h", "--as-of", repr(time.time() + 2 * HOUR))
    assert rc == 0 and again["sessions_expired"] == len(snaps), err
    assert again["corrupt_chunks"] == 0 and again["chunks_collected"] > 0
    with pytest.raises(SessionNotFound):
        asyncio.run(restore_all(data, ["a"]))


def test_compact_refuses_a_key_for_a_clear_directory(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    snaps, _ = asyncio.run(fill(data, key=None, delete=()))
    before = files(data)
    rc, _, err = compact(capsys, monkeypatch, data, "--json", key=KEY)
    assert rc == 2 and "in clear" in err, err
    assert files(data) == before
    rc, report, err = compact(capsys, monkeypatch, data, "--json")
    assert rc == 0 and report["corrupt_chunks"] == 0, err
    assert asyncio.run(restore_all(data, snaps, key=None)) == snaps


@pytest.mark.parametrize("where", ["env", "config"])
def test_repair_refuses_the_right_id_with_the_wrong_material(tmp_path, capsys, monkeypatch,
                                                             where):
    data = tmp_path / "data"
    snaps, _ = asyncio.run(fill(data, delete=()))
    (data / "disk" / "index" / "data.mdb").unlink()
    before = files(data)
    monkeypatch.delenv("KVTIER_ENCRYPTION_KEY", raising=False)
    args = ["repair", "--data-dir", str(data), "--json"]
    if where == "env":
        monkeypatch.setenv("KVTIER_ENCRYPTION_KEY", WRONG)
    else:
        args += ["--config", str(key_config(tmp_path, WRONG))]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "does not open" in err and "nothing was changed" in err, err
    assert files(data) == before
    monkeypatch.setenv("KVTIER_ENCRYPTION_KEY", KEY)
    assert cli.main(["repair", "--data-dir", str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["orphans"] == []
    assert asyncio.run(restore_all(data, snaps)) == snaps


@contextlib.contextmanager
def serving(data: Path, log: Path):
    """``kvtier serve`` on ``data`` in its own process, sealing with KEY; its address."""
    command = [sys.executable, "-m", "services.cli", "serve", "--preset", "embedded",
               "--data-dir", str(data), "--listen", "127.0.0.1:0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVTIER_ENCRYPTION_KEY": KEY,
           "KVTIER_RETAIN_UNREFERENCED": "false"}
    with open(log, "w") as err:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                                text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("kvtier serving on "), log.read_text()[-3000:]
        yield line.split()[3].rstrip(",")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_compact_beside_a_live_encrypted_server(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    snaps, _ = asyncio.run(fill(data))
    with serving(data, tmp_path / "serve.log") as address:
        async def listed() -> list[str]:
            async with AsyncClient(address) as kv:
                return sorted(s.session.session_id for s in await kv.list("acme"))

        assert asyncio.run(listed()) == sorted(snaps)
        args = ("--json", "--server", address, "--ttl", "1h",
                "--as-of", repr(time.time() + 2 * HOUR))
        rc, _, err = compact(capsys, monkeypatch, data, *args)
        assert rc == 2 and "encrypted at rest" in err, err
        assert asyncio.run(listed()) == sorted(snaps)
        rc, report, err = compact(capsys, monkeypatch, data, *args, key=KEY)
        assert rc == 0 and report["mode"] == "live", err
        assert sorted(report["expired"]) == sorted(f"acme/{name}" for name in snaps)
        assert report["corrupt_chunks"] == 0 and not (data / "quarantine").exists()
        assert asyncio.run(listed()) == []


def test_the_census_names_what_a_keyring_lacks_and_a_damaged_seal_is_not_clear():
    old = Keyring([MasterKey("k1", bytes(range(32)))])
    new = Keyring([MasterKey("k2", bytes(range(1, 33))), MasterKey("k1", bytes(range(32)))],
                  current="k2")
    census = Census("the test store")
    census.note("a", old.seal("a", "tenant:acme", b"old value"))
    census.note("b", new.seal("b", "tenant:acme", b"new value"))
    census.require(new)  # a rotated keyring opens both generations
    with pytest.raises(InvalidRequest, match=r"\['k1'\]"):
        census.require(Keyring([MasterKey("k2", bytes(range(1, 33)))]))
    with pytest.raises(InvalidRequest, match="no key was given"):
        census.require(None)
    damaged = Census("the test store")
    damaged.note("c", MAGIC + b"\xff" * 60)  # the sealed magic, then no valid header
    with pytest.raises(InvalidRequest, match="1 more with a damaged header"):
        damaged.require(None)
    clear = Census("the test store")
    clear.note("d", b"KVTC" + bytes(60))
    clear.require(None)
    with pytest.raises(InvalidRequest, match="not encrypted"):
        clear.require(new)
    clear.require(new, clear_allowed=True)
