"""Helpers (no tests) for the compaction tests: a data directory filled by the real
server through the real client, snapshots of what restores return, and runs of the real
``kvtier compact`` command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.format.chunk import StreamData
from kvstore.format.errors import SessionNotFound
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk.segments import HEADER_SIZE, segment_path
from kvtier import AsyncClient
from services.server.config_load import load_config
from services.server.server import create_server
from tests.support.service import LAYOUT, streams_for, tokens_for

ROOT = Path(__file__).resolve().parents[2]
CHUNK = LAYOUT.chunk_tokens
TENANT = "acme"


@dataclass(frozen=True)
class Spec:
    session_id: str
    chunks: int
    prefix_of: str | None = None  # shares its first two chunks with this session
    ttl_s: float = 0.0


# Shared prefixes (b and c share a's first two chunks), sessions to delete for dead bytes.
SPECS = (
    Spec("a", 4), Spec("b", 3, prefix_of="a"), Spec("c", 3, prefix_of="a"),
    Spec("d", 4), Spec("e", 2), Spec("f", 3), Spec("g", 2, prefix_of="d"),
)


def tokens_of(spec: Spec, specs=SPECS) -> torch.Tensor:
    count = spec.chunks * CHUNK + 100  # whole chunks and a tail
    own = tokens_for(count, seed=ord(spec.session_id[0]))
    if spec.prefix_of is None:
        return own
    parent = tokens_of(next(s for s in specs if s.session_id == spec.prefix_of), specs)
    return torch.cat([parent[:2 * CHUNK], own[2 * CHUNK:]])


def streams_of(spec: Spec, specs=SPECS) -> dict[str, StreamData]:
    """The session's persistent streams; a shared prefix has its parent's KV (as a model
    gives it), so its chunks are the parent's bytes and dedupe."""
    tokens = tokens_of(spec, specs)
    own = streams_for(LAYOUT, len(tokens), seed=specs.index(spec))
    if spec.prefix_of is None:
        return own
    parent = streams_of(next(s for s in specs if s.session_id == spec.prefix_of), specs)
    out = {}
    for stream in LAYOUT.persistent_streams:
        cut, mine, theirs = stream.entries_for(2 * CHUNK), own[stream.name], parent[stream.name]
        out[stream.name] = StreamData(
            torch.cat([theirs.codes[:, :cut], mine.codes[:, cut:]], dim=1),
            None if mine.scales is None
            else torch.cat([theirs.scales[:, :cut], mine.scales[:, cut:]], dim=1))
    return out


@contextlib.asynccontextmanager
async def embedded_server(data_dir: Path, encryption_key: str | None = None):
    """The real server with the embedded config (what ``kvtier serve`` runs by default)
    over ``data_dir``, on a free loopback port, sealing with ``encryption_key`` (None: in
    clear); yields its address. Retention is off: the compaction tests measure the dead
    records a delete leaves on disk."""
    env = {"KVTIER_ENCRYPTION_KEY": encryption_key} if encryption_key else {}
    config = load_config(preset="embedded", env=env,
                         overrides={"data_dir": data_dir, "listen": "127.0.0.1:0",
                                    "retain_unreferenced": False})
    server, port = await create_server(config)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0.5)


@dataclass(frozen=True)
class Snapshot:
    token_ids: bytes
    chunk_keys: tuple[str, ...]
    chunks: tuple[bytes, ...]
    tail: bytes


async def snapshot(kv: AsyncClient, session_id: str) -> Snapshot:
    restored = await kv.restore(TENANT, session_id, want_window=False, decode=False)
    return Snapshot(restored.token_ids.tobytes(), tuple(restored.chunk_keys),
                    tuple(bytes(c) for c in restored.chunks), bytes(restored.tail))


async def spill_all(kv: AsyncClient, specs=SPECS, *, only=None, generation: int = 1) -> None:
    for spec in specs:
        if only is not None and spec.session_id not in only:
            continue
        await kv.spill(TENANT, spec.session_id, LAYOUT.name, tokens_of(spec, specs),
                       streams_of(spec, specs), generation=generation,
                       ack="durable", ttl_s=spec.ttl_s)


HOUR = 3600.0


async def fill(data_dir: Path, *, delete=("d", "f"), specs=SPECS) -> dict[str, Snapshot]:
    """Spill ``specs`` through a real server, delete ``delete``, and return snapshots of
    the sessions left (as restores return them)."""
    snaps, _ = await fill_idle_and_hot(data_dir, delete=delete, specs=specs)
    return snaps


async def fill_idle_and_hot(data_dir: Path, *, delete=("d", "f"), specs=SPECS, hot=()
                            ) -> tuple[dict[str, Snapshot], float]:
    """``fill``, with the ``hot`` sessions spilled again (generation 2) once the others
    are done. Returns the snapshots and ``hot_since``, the wall-clock time between: every
    other session was last accessed before it, the hot ones after (restores record an
    access at most once a minute), so a compaction ``--as-of hot_since + D`` with
    ``--demote-after D`` demotes exactly the others, with no sleep."""
    async with embedded_server(data_dir) as target, AsyncClient(target) as kv:
        spilled = time.monotonic()
        await spill_all(kv, specs)
        for session_id in delete:
            await kv.delete(TENANT, session_id)
        hot_since = time.time()
        if hot:
            await spill_all(kv, specs, only=hot, generation=2)
        out = {}
        for spec in specs:
            if spec.session_id in delete:
                continue
            try:
                out[spec.session_id] = await snapshot(kv, spec.session_id)
            except SessionNotFound:
                # Only a session whose own TTL can have run out since its spill may be
                # gone; any other is lost, and the snapshots must not hide that.
                if not (spec.ttl_s and time.monotonic() - spilled >= spec.ttl_s):
                    raise
        return out, hot_since


async def restore_all(data_dir: Path, names) -> dict[str, Snapshot]:
    async with embedded_server(data_dir) as target, AsyncClient(target) as kv:
        return {name: await snapshot(kv, name) for name in names}


def compact_command(data_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", "compact", "--data-dir", str(data_dir),
            *args]


def run_compact(data_dir: Path, *args: str, timeout: float = 120
                ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(compact_command(data_dir, *args), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def report_of(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def flip_value_byte(data: Path, key: str) -> None:
    """Flip one byte in the middle of the disk record of ``key`` in ``data``."""
    async def locate():
        disk = DiskTier(data / "disk", 1 << 30, writer=False)
        try:
            return disk.index.lookup(key.encode())
        finally:
            await disk.close()

    entry = asyncio.run(locate())
    path = segment_path(data / "disk" / "segments", entry.seg_id)
    at = entry.offset + HEADER_SIZE + len(key) + entry.value_len // 2
    with open(path, "r+b") as file:
        file.seek(at)
        byte = file.read(1)
        file.seek(at)
        file.write(bytes([byte[0] ^ 0xFF]))
