"""The ``kvtier`` command line as a new user meets it: ``--version``, one ``--server``
flag, and the client commands start without importing torch."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOBODY = "127.0.0.1:9"  # discard: nothing listens there


def _kvtier(*argv: str, env: dict[str, str] | None = None,
            importtime: bool = False) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run([sys.executable, *flags, "-m", "services.cli", *argv], cwd=ROOT,
                          env={**clean, **(env or {})}, capture_output=True, text=True,
                          timeout=120)


def _split_importtime(stderr: str) -> tuple[set[str], list[str]]:
    """(modules imported, the other stderr lines) from ``-X importtime`` output."""
    modules, rest = set(), []
    for line in stderr.splitlines():
        if line.startswith("import time:"):
            name = line.rsplit("|", 1)[1].strip()
            if name != "package":  # the header line
                modules.add(name)
        else:
            rest.append(line)
    return modules, rest


def _torch_modules(modules: set[str]) -> set[str]:
    return {m for m in modules if m == "torch" or m.startswith("torch.")}


def test_version_matches_the_package():
    with open(ROOT / "pyproject.toml", "rb") as handle:
        version = tomllib.load(handle)["project"]["version"]
    result = _kvtier("--version")
    assert result.returncode == 0 and result.stdout == f"kvtier {version}\n"


@pytest.mark.parametrize("argv", [
    ["stat", "--server", NOBODY],
    ["list", "--server", NOBODY],
    ["top", "--server", NOBODY, "--iterations", "1"],
])
def test_client_commands_fail_fast_without_torch(argv):
    result = _kvtier(*argv, importtime=True)
    modules, stderr = _split_importtime(result.stderr)
    assert "kvtier.client" in modules  # the import chain ran...
    assert not _torch_modules(modules)  # ...and left torch out
    assert result.returncode == 1 and result.stdout == ""
    assert len(stderr) == 1 and "Traceback" not in stderr[0], stderr
    assert stderr[0].startswith(f"kvtier {argv[0]}: ") and NOBODY in stderr[0]
    assert "--server" in stderr[0]  # says what to do


@pytest.mark.parametrize("argv", [["--version"], ["stat", "--help"], ["top", "--help"],
                                  ["list", "--help"],
                                  ["serve", "--print-config", "--listen", "127.0.0.1:0"]])
def test_cheap_commands_do_not_import_torch(argv):
    result = _kvtier(*argv, importtime=True)
    modules, _ = _split_importtime(result.stderr)
    assert result.returncode == 0
    assert modules and not _torch_modules(modules)


@pytest.mark.parametrize("variable", ["KVTIER_SERVER", "KVTIER_TARGET"])
def test_server_address_from_the_environment(variable):
    result = _kvtier("stat", env={variable: NOBODY})
    assert result.returncode == 1 and NOBODY in result.stderr


@pytest.mark.parametrize("command", ["stat", "top", "list", "generate", "compact"])
def test_one_address_flag(command):
    help_text = _kvtier(command, "--help").stdout
    assert "--server" in help_text and "--target" not in help_text
