"""``kvtier compact`` beside a serving ``kvtier serve`` on the same data directory.

The server runs as its own process with a host tier too small for a chunk, so every
restore reads the disk (or, once demoted, the object) tier. While a compaction process
rewrites segments, expires and demotes sessions through the server, the test restores
every live session in a loop: none may fail and all must be byte-identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.format.errors import SessionNotFound
from kvstore.tiers.disk import DiskTier
from kvtier import AsyncClient
from services import cli
from services.server.address_file import SERVER_ADDRESS_FILE
from tests.support.compaction import (
    HOUR,
    ROOT,
    SPECS,
    TENANT,
    Snapshot,
    Spec,
    compact_command,
    fill,
    snapshot,
)


@contextlib.contextmanager
def serving(data: Path, log: Path) -> Iterator[str]:
    """``kvtier serve`` on ``data`` in its own process; yields its address."""
    command = [sys.executable, "-m", "services.cli", "serve", "--preset", "embedded",
               "--data-dir", str(data), "--listen", "127.0.0.1:0", "--host-bytes", "1KiB"]
    with open(log, "w") as err:
        # retention off: the tests measure the dead records deletes leave on disk
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                                text=True, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                "KVTIER_RETAIN_UNREFERENCED": "false"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("kvtier serving on "), log.read_text()[-3000:]
        yield line.split()[3].rstrip(",")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


async def compact_while_restoring(data: Path, address: str, snaps: dict[str, Snapshot],
                                  *args: str) -> tuple[dict, int]:
    """Run the compaction process and restore ``snaps``' sessions until it exits.
    Returns (its report, restores done while it ran)."""
    proc = await asyncio.create_subprocess_exec(
        *compact_command(data, "--json", *args), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    waiting = asyncio.ensure_future(proc.communicate())
    restores = 0
    async with AsyncClient(address) as kv:
        while not waiting.done():
            for name, want in snaps.items():
                assert await snapshot(kv, name) == want, f"{name} restored different bytes"
                restores += 1
    out, err = await waiting
    assert proc.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1]), restores


async def restores(address: str, names) -> dict[str, Snapshot]:
    async with AsyncClient(address) as kv:
        return {name: await snapshot(kv, name) for name in names}


def test_rewrite_and_expiry_beside_a_live_server(tmp_path, capsys):
    data = tmp_path / "data"
    specs = (*SPECS, Spec("t", 3, prefix_of="a", ttl_s=HOUR))
    snaps = asyncio.run(fill(data, specs=specs, delete=()))
    # t's TTL runs out only as the live compaction below judges it (an hour on); that one
    # deletes it through the server.
    del snaps["t"]
    assert cli.main(["compact", "--data-dir", str(data), "--json"]) == 0  # seals segment 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["expired"] == []
    with serving(data, tmp_path / "serve.log") as address:
        async def delete_some():
            async with AsyncClient(address) as kv:
                for name in ("d", "f"):  # dead bytes in the sealed segment
                    await kv.delete(TENANT, name)

        asyncio.run(delete_some())
        live = {n: s for n, s in snaps.items() if n not in ("d", "f")}
        an_hour_on = repr(time.time() + HOUR)
        report, during = asyncio.run(compact_while_restoring(data, address, live,
                                                             "--server", address,
                                                             "--as-of", an_hour_on))
        assert report["mode"] == "live" and during > 0
        assert report["segments_rewritten"] >= 1 and report["reclaimed_bytes"] > 0
        assert report["rewritten_bytes"] > 0 and report["corrupt_chunks"] == 0
        assert report["expired"] == ["acme/t"]
        assert any("unreferenced-chunk collection" in why for why in report["skipped"])
        assert asyncio.run(restores(address, live)) == live
        with pytest.raises(SessionNotFound):
            asyncio.run(restores(address, ["t"]))
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


@pytest.mark.slow
def test_demotion_beside_a_live_server_through_its_recorded_address(tmp_path, capsys):
    data = tmp_path / "data"
    snaps = asyncio.run(fill(data, delete=()))
    recorded = data / SERVER_ADDRESS_FILE
    with serving(data, tmp_path / "serve.log") as address:
        assert recorded.read_text() == address + "\n"  # the server records where it listens
        # With the record gone the address is unknown: session steps are skipped and the
        # report says why.
        recorded.rename(tmp_path / "aside")
        assert cli.main(["compact", "--data-dir", str(data), "--json",
                         "--demote-after", "0s"]) == 0
        skipped = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert skipped["mode"] == "live" and skipped["sessions_demoted"] == 0
        assert any("--server" in why for why in skipped["skipped"])

        (tmp_path / "aside").rename(recorded)
        # Restored (so promoted again) meanwhile; d and g share chunks with no other session.
        busy = {n: snaps[n] for n in ("d", "g")}
        report, during = asyncio.run(compact_while_restoring(data, address, busy,
                                                             "--demote-after", "0s"))
        assert during > 0
        assert sorted(report["demoted"]) == sorted(f"{TENANT}/{name}" for name in snaps)
        quiet = [n for n in snaps if n not in busy]

        async def placed_then_restored():
            async with AsyncClient(address) as kv:
                placed = {n: list((await kv.stat(TENANT, n)).session.tiers) for n in quiet}
                restored = {n: await kv.restore(TENANT, n, want_window=False, decode=False)
                            for n in quiet}
                return placed, restored

        placed, restored = asyncio.run(placed_then_restored())
        assert all(tiers == ["object"] for tiers in placed.values()), placed
        assert {n: r.tier for n, r in restored.items()} == {n: "object" for n in quiet}
        assert asyncio.run(restores(address, snaps)) == snaps

        async def record():
            disk = DiskTier(data / "disk", 1 << 30, writer=False)
            try:
                return json.loads(await disk.meta.get(f"demoted/{TENANT}/a"))
            finally:
                await disk.close()

        assert asyncio.run(record())["by"] == f"the server at {address}"
    assert not recorded.exists()  # removed when the server stopped
