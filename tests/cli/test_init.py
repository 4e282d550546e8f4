"""``kvtier init``: a working setup from the installed package alone. The test writes one
with ``--secure``, starts ``kvtier serve`` from the written config in a child process,
and spills and restores a session over TLS with the written token; the files are 0600
and the directories 0700; a directory that is not empty is refused without ``--force``,
which never replaces the keyring; the deploy files are the shipped ones."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from kvtier import AsyncClient, Unauthenticated
from services.cli.init import DEPLOY_FILES, deploy_file
from services.cli.main import main
from services.server.config_load import load_config
from testing.live_server import Child
from tests.support.service import LAYOUT, assert_streams_equal, streams_for, tokens_for

ROOT = Path(__file__).resolve().parents[2]
TOKENS = LAYOUT.chunk_tokens + 20


def _modes(root: Path) -> dict[str, int]:
    return {str(path.relative_to(root)) or ".": stat.S_IMODE(path.stat().st_mode)
            for path in [root, *root.rglob("*")]}


async def test_init_secure_then_serve_and_spill_over_tls_with_the_written_token(
        tmp_path, capsys):
    root = tmp_path / "kv"
    # port 0 for the test: the default is 127.0.0.1:50051 and metrics on 9100
    assert main(["init", str(root), "--secure", "--listen", "127.0.0.1:0",
                 "--metrics-port", "0"]) == 0
    said = capsys.readouterr().out
    assert f"kvtier serve --config {root / 'kvtier.toml'}" in said
    modes = _modes(root)
    assert {m for path, m in modes.items() if (root / path).is_dir()} == {0o700}
    assert {m for path, m in modes.items() if (root / path).is_file()} == {0o600}
    config = load_config(root / "kvtier.toml", env={})
    assert config.tls and config.authenticates and config.encrypts and config.audit_log
    for name in DEPLOY_FILES:
        assert (root / "deploy" / name).read_bytes() == deploy_file(name)

    server = Child([sys.executable, "-m", "services.cli", "serve", "--config",
                    str(root / "kvtier.toml"), "--log-level", "WARNING"],
                   "kvtier serving on ", tmp_path / "serve.log",
                   {"PYTHONPATH": str(ROOT)})
    target = server.start()
    try:
        token = (root / "tls" / "acme.token").read_text().strip()
        ca = str(root / "tls" / "ca.pem")
        async with AsyncClient(target, tls_ca=ca, token=token) as kv:
            streams = streams_for(LAYOUT, TOKENS)
            await kv.spill("acme", "s1", LAYOUT.name, tokens_for(TOKENS), streams,
                           generation=1, ack="durable")
            got = await kv.restore("acme", "s1")
            assert got.token_ids.tolist() == tokens_for(TOKENS).tolist()
            assert_streams_equal(got.persistent, streams)
        async with AsyncClient(target, tls_ca=ca, token="not-the-token") as kv:
            with pytest.raises(Unauthenticated):
                await kv.list("acme")
    finally:
        server.stop()


def test_init_refuses_a_directory_that_is_not_empty_and_force_keeps_the_keyring(
        tmp_path, capsys):
    root = tmp_path / "kv"
    assert main(["init", str(root), "--secure", "--metrics-port", "0"]) == 0
    keyring = (root / "keyring.toml").read_bytes()
    config = (root / "kvtier.toml").read_bytes()
    capsys.readouterr()
    assert main(["init", str(root)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (root / "kvtier.toml").read_bytes() == config  # untouched
    (root / "notes.txt").write_text("mine")
    (root / "notes.txt").chmod(0o644)
    assert main(["init", str(root), "--secure", "--force", "--metrics-port", "0"]) == 0
    assert (root / "keyring.toml").read_bytes() == keyring  # sealed data stays readable
    assert stat.S_IMODE((root / "notes.txt").stat().st_mode) == 0o644  # not init's: as it was


def test_init_plain_listens_on_loopback_and_refuses_to_open_up_without_secure(
        tmp_path, capsys):
    assert main(["init", str(tmp_path / "plain")]) == 0
    config = load_config(tmp_path / "plain" / "kvtier.toml", env={})
    assert config.listen == "127.0.0.1:50051" and not config.tls and not config.encrypts
    assert config.metrics_port == 9100 and config.metrics_host == "127.0.0.1"
    assert not (tmp_path / "plain" / "tls").exists()
    capsys.readouterr()
    assert main(["init", str(tmp_path / "open"), "--listen", "0.0.0.0:50051"]) == 2
    assert "--secure" in capsys.readouterr().err and not (tmp_path / "open").exists()
