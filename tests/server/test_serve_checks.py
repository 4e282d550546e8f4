"""``kvtier serve --print-config`` refuses every configuration ``kvtier serve`` refuses,
with the same status and the same line: both run ``services.server.preflight.check``."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from services.cli.main import main
from services.server.devcerts import write_dev_set

BAD_TOKENS = "[[token]]\nsha256 = 1\n"
NO_KEYS = "nothing = 1\n"


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _certs(tmp_path: Path) -> Path:
    root = tmp_path / "certs"
    write_dev_set(root)
    return root


def _taken(holder: socket.socket) -> int:
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder.getsockname()[1]


# Each case: (tmp_path, a held socket) -> (serve's arguments, config file text or None,
# words the refusal names).
CASES = {
    "wildcard without TLS": lambda t, s: (["--listen", "0.0.0.0:0"], None,
                                          ["0.0.0.0:0", "without TLS", "--insecure"]),
    "metrics off loopback without TLS": lambda t, s: (
        ["--metrics-port", "9"], 'metrics_host = "0.0.0.0"\n',
        ["metrics", "0.0.0.0:9", "without TLS", "--insecure"]),
    "shared metadata without a bucket": lambda t, s: (
        [], 'metadata = "shared"\nnode_id = "n1"\n', ["metadata = 'shared'", "s3_bucket"]),
    "shared metadata on port 0 without node_id": lambda t, s: (
        [], 'metadata = "shared"\ns3_bucket = "b"\n', ["node_id"]),
    "missing TLS files": lambda t, s: (
        [], f'tls_cert = "{t}/no-cert.pem"\ntls_key = "{t}/no-key.pem"\n',
        ["tls_key", "no-key.pem", "cannot read"]),
    "TLS files that are not PEM": lambda t, s: (
        [], f'tls_cert = "{_file(t, "c.pem", "garbage")}"\n'
            f'tls_key = "{_file(t, "k.pem", "garbage")}"\n', ["tls_cert", "no PEM"]),
    "a key of another certificate": lambda t, s: (
        [], f'tls_cert = "{_certs(t)}/server.pem"\ntls_key = "{t}/certs/client-key.pem"\n',
        ["tls_key", "not the key of the certificate"]),
    "a client CA that is not PEM": lambda t, s: (
        [], f'tls_cert = "{_certs(t)}/server.pem"\ntls_key = "{t}/certs/server-key.pem"\n'
            f'tls_client_ca = "{_file(t, "ca.pem", "garbage")}"\n', ["tls_client_ca"]),
    "missing tokens file": lambda t, s: (
        [], f'auth_tokens_file = "{t}/tokens.toml"\n', ["auth_tokens_file", "tokens.toml"]),
    "malformed tokens file": lambda t, s: (
        [], f'auth_tokens_file = "{_file(t, "tokens.toml", BAD_TOKENS)}"\n',
        ["auth_tokens_file", "sha256 must be 64 hex digits"]),
    "bad encryption key file": lambda t, s: (
        [], f'encryption_key_file = "{_file(t, "keys.toml", NO_KEYS)}"\n',
        ["encryption_key_file", "no [[key]] tables"]),
    "data_dir is a file": lambda t, s: (
        ["--data-dir", _file(t, "plain", "x")], None, ["not a directory"]),
    "data_dir under a file": lambda t, s: (
        ["--data-dir", _file(t, "plain", "x") + "/sub"], None, ["not a directory"]),
    "port in use": lambda t, s: (["--listen", f"127.0.0.1:{_taken(s)}"], None,
                                 ["in use", "--listen"]),
    "metrics port in use": lambda t, s: (["--metrics-port", str(_taken(s))], None,
                                         ["in use", "--metrics-port"]),
    "unreadable layouts": lambda t, s: ([], f'layouts = ["{t}/no-layout.json"]\n',
                                        ["config layouts", "no-layout.json"]),
    "audit log in no directory": lambda t, s: ([], f'audit_log = "{t}/none/audit.jsonl"\n',
                                               ["cannot start", "audit.jsonl"]),
    "unknown manager preset": lambda t, s: ([], 'manager_preset = "galactic"\n',
                                            ["manager_preset", "galactic"]),
    "unknown config key": lambda t, s: ([], "no_such_key = 1\n", ["no_such_key"]),
}


def _run(argv: list[str], capsys) -> tuple[int, list[str], str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.err.splitlines(), out.out


@pytest.mark.parametrize("case", sorted(CASES))
def test_print_config_refuses_what_serve_refuses(case, tmp_path, capsys, monkeypatch):
    for name in list(os.environ):
        if name.startswith(("KVTIER_", "AWS_")):
            monkeypatch.delenv(name)
    with socket.socket() as holder:
        args, text, words = CASES[case](tmp_path, holder)
        base = ["serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
                "--log-level", "ERROR"]
        if text is not None:
            base += ["--config", _file(tmp_path, "kvtier.toml", text)]
        served = _run(base + args, capsys)
        printed = _run(base + args + ["--print-config"], capsys)
    assert served[0] == 2, served
    assert len(served[1]) == 1 and served[1][0].startswith("kvtier serve: "), served
    for word in words:
        assert word in served[1][0], (word, served[1][0])
    assert printed == served  # same status, same line, nothing printed on stdout
    assert not (tmp_path / "data").exists()  # neither created the data directory


def test_print_config_prints_what_serve_would_serve(tmp_path, capsys, monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)
    certs = _certs(tmp_path)
    text = (f'tls_cert = "{certs}/server.pem"\ntls_key = "{certs}/server-key.pem"\n'
            f'tls_client_ca = "{certs}/ca.pem"\nauth_tokens_file = "{certs}/tokens.toml"\n')
    code = main(["serve", "--print-config", "--listen", "0.0.0.0:0",
                 "--data-dir", str(tmp_path / "data"), "--config",
                 _file(tmp_path, "kvtier.toml", text)])
    out = capsys.readouterr()
    assert code == 0 and out.err == "", out.err
    assert '"listen": "0.0.0.0:0"' in out.out
    assert not (tmp_path / "data").exists()


def test_settings_from_two_sources_combine(tmp_path, monkeypatch, capsys):
    """A setting that needs another may take it from another source: the checks run on
    the merged configuration."""
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVTIER_S3_BUCKET", "b")
    monkeypatch.setenv("KVTIER_NODE_ID", "n1")
    path = _file(tmp_path, "kvtier.toml", 'metadata = "shared"\n')
    assert main(["serve", "--print-config", "--config", path, "--listen", "127.0.0.1:0",
                 "--data-dir", str(tmp_path / "d")]) == 0, capsys.readouterr().err


def test_a_pair_from_two_sources(tmp_path, monkeypatch, capsys):
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)
    certs = _certs(tmp_path)
    monkeypatch.setenv("KVTIER_TLS_KEY", str(certs / "server-key.pem"))
    path = _file(tmp_path, "kvtier.toml", f'tls_cert = "{certs}/server.pem"\n')
    assert main(["serve", "--print-config", "--config", path, "--listen", "127.0.0.1:0",
                 "--data-dir", str(tmp_path / "d")]) == 0, capsys.readouterr().err


def test_metrics_off_loopback_need_tls_or_insecure(tmp_path, capsys, monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)
    certs = _certs(tmp_path)
    with socket.socket() as holder:
        port = _taken(holder)
    base = ["serve", "--print-config", "--listen", "127.0.0.1:0", "--metrics-port", str(port),
            "--data-dir", str(tmp_path / "data")]
    plain = _file(tmp_path, "plain.toml", 'metrics_host = "0.0.0.0"\n')
    tls = _file(tmp_path, "tls.toml", f'metrics_host = "0.0.0.0"\ntls_cert = '
                f'"{certs}/server.pem"\ntls_key = "{certs}/server-key.pem"\n')
    assert _run(base + ["--config", plain], capsys)[0] == 2
    assert _run(base + ["--config", plain, "--insecure"], capsys)[0] == 0  # said so
    assert _run(base + ["--config", tls], capsys)[0] == 0  # HTTPS with the gRPC certificate
