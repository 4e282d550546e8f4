"""``kvtier certs`` and ``kvtier keygen`` as commands (help, argument checks, no silent
overwrite, private files), and the TLS flags applied to ``kvtier stat --metrics-url``:
an https endpoint checked against ``--tls-ca``, one clear line on a verify failure."""

from __future__ import annotations

import http.server
import os
import ssl
import subprocess
import sys
import threading
from argparse import Namespace
from pathlib import Path

import pytest
from cryptography import x509

from kvstore.encryption.seal import keyring_from_file
from kvstore.format.errors import TierUnavailable
from services.cli.stat import fetch_metrics
from services.server.devcerts import DEFAULT_NAMES, output_names, write_dev_set

ROOT = Path(__file__).resolve().parents[2]
PRIVATE = ("ca-key.pem", "server-key.pem", "client-key.pem", "admin.token", "acme.token",
           "beta.token", "replay.token")


def _run(*argv: str, cwd: Path, module: str = "services.cli") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("command", [("certs",), ("keygen",)])
def test_help_prints_help_and_writes_nothing(command, tmp_path):
    for argv, module in (((*command, "--help"), "services.cli"),
                         (("--help",), "services.server.devcerts")):
        if module != "services.cli" and command != ("certs",):
            continue
        result = _run(*argv, cwd=tmp_path, module=module)
        assert result.returncode == 0 and "usage:" in result.stdout, result
        assert list(tmp_path.iterdir()) == []  # no ./--help directory of keys


def test_certs_writes_the_set_for_every_compose_name_with_private_keys(tmp_path):
    result = _run("certs", "dev", "--name", "kv.example.internal", "--name", "10.1.2.3",
                  cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    directory = tmp_path / "dev"
    assert sorted(p.name for p in directory.iterdir()) == sorted(output_names())
    for name in PRIVATE:
        assert (directory / name).stat().st_mode & 0o777 == 0o600, name
    cert = x509.load_pem_x509_certificate((directory / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = set(san.get_values_for_type(x509.DNSName)) | {
        str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert names == {*DEFAULT_NAMES, "kv.example.internal", "10.1.2.3"}
    token = (directory / "admin.token").read_text().strip()
    assert token not in result.stdout + result.stderr


def test_certs_refuses_to_overwrite_without_force(tmp_path):
    write_dev_set(tmp_path / "dev")
    before = _contents(tmp_path / "dev")
    refused = _run("certs", "dev", cwd=tmp_path)
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert _contents(tmp_path / "dev") == before
    forced = _run("certs", "dev", "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    after = _contents(tmp_path / "dev")
    assert set(after) == set(before) and after["ca.pem"] != before["ca.pem"]


@pytest.mark.parametrize("argv, words", [
    (("certs", "--", "-x"), ["'-x'", "starts with '-'"]),
    (("certs", "dev", "--name", "-x"), ["--name"]),
    (("certs", "dev", "--name", "a b"), ["--name"]),
    (("certs", "plain"), ["not a directory"]),
    (("certs",), ["DIR"]),
    (("keygen", "--", "-k.toml"), ["starts with '-'"]),
    (("keygen", "none/k.toml"), ["none", "not a directory"]),
    (("keygen", "k.toml", "--id", "x" * 65), ["key id", "64"]),
])
def test_bad_arguments_are_refused_in_one_line(argv, words, tmp_path):
    (tmp_path / "plain").write_text("a file")
    result = _run(*argv, cwd=tmp_path)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]  # nothing written


def test_keygen_writes_a_private_keyring_the_server_reads_and_prints_no_key(tmp_path):
    result = _run("keygen", "keys.toml", "--id", "k1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    path = tmp_path / "keys.toml"
    assert path.stat().st_mode & 0o777 == 0o600
    keyring = keyring_from_file(path)
    assert keyring.key_ids == ["k1"]
    sealed = keyring.seal("key", "acme", b"hello")
    assert keyring.open("key", sealed)[1] == b"hello"
    material = next(line for line in path.read_text().splitlines()
                    if line.startswith("material")).split('"')[1]
    assert material not in result.stdout + result.stderr
    again = _run("keygen", "other.toml", cwd=tmp_path)  # a new key each time
    assert again.returncode == 0 and material not in (tmp_path / "other.toml").read_text()


def test_keygen_refuses_to_replace_a_keyring(tmp_path):
    assert _run("keygen", "keys.toml", cwd=tmp_path).returncode == 0
    before = (tmp_path / "keys.toml").read_bytes()
    refused = _run("keygen", "keys.toml", cwd=tmp_path)
    assert refused.returncode == 2 and "exists" in refused.stderr
    assert (tmp_path / "keys.toml").read_bytes() == before


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"kvtier_up_for_the_test 1\nother 2\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def https_metrics(tmp_path):
    """A real HTTPS endpoint with the certificate of a fresh development set: (its URL,
    the set's directory)."""
    certs = tmp_path / "certs"
    write_dev_set(certs)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs / "server.pem", certs / "server-key.pem")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_port}/metrics", certs
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _flags(ca: Path | None, cert: Path | None = None, key: Path | None = None) -> Namespace:
    return Namespace(tls_ca=ca and str(ca), tls_cert=cert and str(cert),
                     tls_key=key and str(key))


def test_metrics_over_https_use_the_tls_flags(https_metrics, tmp_path):
    url, certs = https_metrics
    text = fetch_metrics(url, _flags(certs / "ca.pem", certs / "client.pem",
                                     certs / "client-key.pem"))
    assert "kvtier_up_for_the_test 1" in text
    foreign = tmp_path / "foreign"
    write_dev_set(foreign)
    for flags in (_flags(foreign / "ca.pem"), _flags(None)):  # another CA; the system's
        with pytest.raises(TierUnavailable, match="does not verify.*--tls-ca"):
            fetch_metrics(url, flags)
