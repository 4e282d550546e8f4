"""``kvtier repair`` on an encrypted data directory: its manifests are sealed, so the
references are recounted from them opened with the server's key (given by ``--config``
or ``KVTIER_ENCRYPTION_KEY``, as the server takes it); without it repair refuses in one
line and changes nothing, since every chunk would look unreferenced (and be collected).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

from kvstore.format.errors import IndexCorrupt
from kvstore.tiers.disk import DiskTier
from services.server.config_load import load_config
from services.server.store import open_manager
from tests.support.manager import make_session, random_tokens

ROOT = Path(__file__).resolve().parents[2]
KEY = base64.b64encode(bytes(range(7, 39))).decode()
SESSIONS = [("acme", "s0"), ("acme", "s1"), ("globex", "s2"), ("globex", "s3")]


def server_config(data_dir: Path):
    return load_config(preset="test", env={"KVTIER_ENCRYPTION_KEY": KEY},
                       overrides={"data_dir": data_dir})


async def build(managers, data_dir: Path) -> dict[tuple[str, str], dict]:
    """Durable sessions of two tenants in an encrypted data directory, its index lost."""
    manager = managers.adopt(await open_manager(server_config(data_dir)))
    sessions = {}
    for i, (tenant, name) in enumerate(SESSIONS):
        args = make_session(random_tokens(16 * 4 + i, seed=70 + i), seed=i, window=False,
                            tenant=tenant)
        await manager.spill(tenant, name, generation=1, ack="durable", **args)
        sessions[tenant, name] = args
    await managers.close(manager)
    (data_dir / "disk" / "index" / "data.mdb").unlink()
    return sessions


def run_repair(data_dir: Path, *extra: str, key: str | None = None
               ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    if key is not None:
        env["KVTIER_ENCRYPTION_KEY"] = key
    return subprocess.run([sys.executable, "-m", "services.cli", "repair", "--data-dir",
                           str(data_dir), "--json", *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file's bytes but the lock files' (they name the pid that last held them)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix != ".lock"}


async def check_restores(data_dir: Path, sessions: dict[tuple[str, str], dict]) -> None:
    manager = await open_manager(server_config(data_dir))
    try:
        for (tenant, name), args in sessions.items():
            result = await manager.restore(tenant, name)
            assert [bytes(c) for c in result.chunks] == [bytes(c) for _, c in args["chunks"]]
            assert bytes(result.manifest.tail) == bytes(args["tail"])
        # the recounted references hold: a delete frees its own chunks only
        await manager.delete(*SESSIONS[0])
        for tenant, name in SESSIONS[1:]:
            assert await manager.restore(tenant, name)
    finally:
        await manager.close()


async def test_repair_without_the_key_refuses_and_changes_nothing(tmp_path, managers, opened):
    data_dir = tmp_path / "data"
    await build(managers, data_dir)
    before = snapshot(data_dir)
    assert any(name.startswith("disk/segments/") for name in before)
    done = run_repair(data_dir)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "['env']" in lines[0] and "KVTIER_ENCRYPTION_KEY" in lines[0]
    wrong = base64.b64encode(bytes(32)).decode()  # a key of another id is no better
    done = run_repair(data_dir, "--config", str(key_config(tmp_path, "other", wrong)))
    assert done.returncode == 2 and "['env']" in done.stderr, done.stderr
    assert snapshot(data_dir) == before
    try:
        opened.adopt(DiskTier(data_dir / "disk", 1 << 26))
    except IndexCorrupt:
        pass  # still lost, as it was: nothing was rebuilt without the key
    else:
        raise AssertionError("the lost index was rebuilt without the key")


def key_config(tmp_path: Path, key_id: str, material: str) -> Path:
    key_file = tmp_path / f"{key_id}.keys.toml"
    key_file.write_text(f'[[key]]\nid = "{key_id}"\nmaterial = "{material}"\n')
    config = tmp_path / f"{key_id}.toml"
    config.write_text(f'encryption_key_file = "{key_file}"\n')
    return config


async def test_repair_with_the_key_from_the_environment_restores_every_session(tmp_path,
                                                                              managers):
    data_dir = tmp_path / "data"
    sessions = await build(managers, data_dir)
    done = run_repair(data_dir, key=KEY)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert sorted(report["sessions"]) == sorted(f"{t}/{s}" for t, s in SESSIONS)
    assert report["orphans"] == [] and report["corrupt_manifests"] == []
    await check_restores(data_dir, sessions)


async def test_repair_with_the_key_file_of_the_config_restores_every_session(tmp_path,
                                                                             managers):
    data_dir = tmp_path / "data"
    sessions = await build(managers, data_dir)
    done = run_repair(data_dir, "--config", str(key_config(tmp_path, "env", KEY)))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["orphans"] == []
    await check_restores(data_dir, sessions)
