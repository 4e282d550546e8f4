"""The Node client (clients/node, written from docs/wire-format.md and the proto alone)
against the golden vectors and a real kvtier server: it registers the vectors' layout
(RegisterLayout) and checks every listed layout's id (ListLayouts), encodes the vectors'
session, spills it, restores it whole and layer by layer, verifies every byte, checksum and digest,
decodes the values, and reads error classes from the kvtier-error trailer."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore.format import registry as layouts
from tests.support.service import running_server
from tests.vectors.generate import wire_layout

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed (make test "
                                "installs Debian's nodejs when run as root)")


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """clients/node's locked dependencies (``make test`` installs them; else npm ci here)."""
    modules = NODE_DIR / "node_modules"
    if not modules.is_dir():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("clients/node/node_modules is missing and npm is not installed")
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                       cwd=NODE_DIR, check=True, timeout=300)
    return modules


@contextlib.contextmanager
def forgets_wire_test_layout():
    """The Node client registers the vectors' layout with RegisterLayout, into this
    process's registry (the server runs in it): forget it afterwards unless an earlier test
    of this process registered it, since other tests enumerate the registry (bench.codec
    reports every layout)."""
    name = wire_layout().name
    known_before = name in {spec.name for spec in layouts.all_layouts()}
    try:
        yield
    finally:
        if not known_before:
            layouts._REGISTRY.pop(name, None)


async def run_node(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        NODE, "test.js", *args, cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
    except TimeoutError:
        proc.kill()
        raise
    return proc.returncode, out.decode()


async def test_node_client_round_trips_through_a_real_server(tmp_path, node_modules):
    with forgets_wire_test_layout():
        async with running_server(tmp_path) as (_, address):
            code, out = await run_node(address)
    assert code == 0, out
    # every check ran: none failed, none skipped (a skipped suite is marked "# SKIP")
    assert "# fail 0" in out and "# SKIP" not in out, out
    assert "ok 2 - against a live server" in out, out
