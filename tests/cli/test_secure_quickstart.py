"""README's "A secured server in five commands", run as written from a clean directory:
``kvtier certs``, ``kvtier keygen``, ``kvtier serve --config deploy/secure.toml`` (a real
server over TLS with tokens, encryption, quotas and an audit log), and client calls with
``--tls-ca`` and ``--token-file``, the metrics over HTTPS included."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from services.server.config_load import load_config
from services.serving.tls import exposure_problem, metrics_exposure_problem
from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "secure.toml"
CLIENT = ["--tls-ca", "secure/ca.pem", "--token-file", "secure/admin.token"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _kvtier(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *argv], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=120)


def _readme_commands() -> list[str]:
    """The ``kvtier`` lines of the README's quickstart block."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### A secured server in five commands", 1)[1]
    block = section.split("```", 2)[1]
    return [line.split("#")[0].strip() for line in block.splitlines()
            if line.strip().startswith("kvtier ")]


def test_the_readme_shows_these_five_commands():
    commands = _readme_commands()
    assert len(commands) == 5
    assert commands[:3] == ["kvtier certs ./secure", "kvtier keygen ./secure/keyring.toml",
                            "kvtier serve --config deploy/secure.toml"]
    for command in commands[3:]:
        assert "--tls-ca secure/ca.pem" in command and "--token-file secure/" in command


def test_the_secure_config_is_complete_and_safe_off_loopback():
    config = load_config(CONFIG, env={})
    assert config.tls and config.authenticates and config.encrypts
    assert config.audit_log and config.quota["default"]
    assert config.listen == "127.0.0.1:50051"  # loopback until the operator opens it
    opened = CONFIG.read_text().replace('#   listen = "0.0.0.0:50051"', 'listen = "0.0.0.0:50051"')
    opened = opened.replace('listen = "127.0.0.1:50051"', "")
    wide = load_config(None, env={}, overrides={**tomllib.loads(opened)})
    assert wide.listen == "0.0.0.0:50051"  # the comment says how, and it is safe so
    assert exposure_problem(wide.listen, wide.tls, wide.authenticates) is None
    assert metrics_exposure_problem(config.metrics_host, config.metrics_port, True) is None
    for path in (config.tls_cert, config.tls_key, config.auth_tokens_file,
                 config.encryption_key_file, config.audit_log, str(config.data_dir)):
        assert path.startswith("secure/"), path  # what the quickstart makes


def _wait_for_serving(process: subprocess.Popen) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        match = re.search(r"kvtier serving on [\d.]+:(\d+)", line)
        if match:
            return int(match.group(1))
    process.kill()
    raise AssertionError(f"the server did not start: {process.communicate()[1][-2000:]}")


def _argv(command: str, address: str = "", metrics_port: int = 0) -> list[str]:
    """A README command's arguments, its ports the test's (another test may hold 50051)."""
    command = command.replace("127.0.0.1:50051", address).replace(
        "127.0.0.1:9100", f"127.0.0.1:{metrics_port}")
    return command.split()[1:]


def test_five_commands_from_a_clean_directory(tmp_path):
    certs, keygen, serve, *clients = _readme_commands()
    for command in (certs, keygen):
        done = _kvtier(*_argv(command), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert _argv(serve) == ["serve", "--config", "deploy/secure.toml"]
    checked = _kvtier("serve", "--config", str(CONFIG), "--listen", "127.0.0.1:0",
                      "--metrics-port", "0", "--print-config", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["encryption_key_file"] == "secure/keyring.toml"

    metrics_port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--config", str(CONFIG), "--listen",
         "127.0.0.1:0", "--metrics-port", str(metrics_port), "--log-level", "WARNING"],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{_wait_for_serving(server)}"
        stat, listed = (_kvtier(*_argv(c, address, metrics_port), cwd=tmp_path)
                        for c in clients)
        assert stat.returncode == 0, stat.stderr
        assert "host" in stat.stdout and "kvtier_tier_up" in stat.stdout  # HTTPS metrics
        assert listed.returncode == 0 and "0 sessions" in listed.stdout, listed.stderr

        # without the token, or without the CA: refused in one line, no traceback
        for argv in (["--tls-ca", "secure/ca.pem"], ["--token-file", "secure/admin.token"]):
            refused = _kvtier("stat", "--server", address, *argv, cwd=tmp_path)
            assert refused.returncode == 1 and "Traceback" not in refused.stderr
            assert refused.stderr.splitlines()[-1].startswith("kvtier stat: ")
        plain = _kvtier("stat", "--server", address, *CLIENT, "--metrics-url",
                        f"http://127.0.0.1:{metrics_port}/metrics", cwd=tmp_path)
        assert plain.returncode == 1 and "Traceback" not in plain.stderr  # HTTPS only
        assert plain.stderr.splitlines()[-1].startswith("kvtier stat: --metrics-url")
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=60)
    assert server.returncode == 0, stderr[-2000:]
    audit = [json.loads(line) for line in
             (tmp_path / "secure" / "audit.jsonl").read_text().splitlines()]
    assert any(e.get("role") == "admin" for e in audit)
    assert any(e.get("kind", "").startswith("auth") for e in audit)  # the tokenless call
    assert (tmp_path / "secure" / "data").is_dir()
