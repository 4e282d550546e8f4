"""Shared helpers for the service and client tests: small sessions of a real layout and a
real server on a loopback port (port 0) over a temporary data directory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.format.chunk import StreamData
from kvstore.format.chunk_parts import code_dtype
from kvstore.format.keys import chunk_digest
from kvstore.format.layout import LayoutSpec
from kvstore.format.registry import get_layout
from proto import kvtier_pb2 as pb
from services.server.config_load import load_config
from services.server.server import KVTierServer, create_server

LAYOUT = get_layout("kvtier-bundled")
ROOT = Path(__file__).resolve().parents[2]


def streams_for(spec: LayoutSpec, tokens: int, *, seed: int = 0, streams=None
                ) -> dict[str, StreamData]:
    """Random codes and scales: (layers, entries, *codes_shape), (layers, entries, groups)
    for ``streams`` (default: the persistent ones) covering ``tokens`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for s in spec.persistent_streams if streams is None else streams:
        shape = (s.layers, s.entries_for(tokens), *s.codes_shape)
        dtype = code_dtype(s)
        if s.bits == 16:
            codes = torch.randn(shape, generator=gen).to(dtype)
        else:
            codes = torch.randint(-128 if s.bits == 8 else 0, 128 if s.bits == 8 else 256,
                                  shape, generator=gen, dtype=torch.int16).to(dtype)
        scales = None
        if s.bits < 16:
            scales = torch.rand((s.layers, s.entries_for(tokens), s.scales_per_entry),
                                generator=gen).to(torch.float16)
        out[s.name] = StreamData(codes, scales)
    return out


def window_for(spec: LayoutSpec, num_tokens: int, window: int = 128, *, seed: int = 1
               ) -> dict[str, StreamData]:
    """Window K/V over the last ``window`` tokens and the pending rows of the unfinished
    entry (the last ``num_tokens % m``), as the bundled model keeps them."""
    m = max(s.tokens_per_entry for s in spec.persistent_streams)
    out = streams_for(spec, window, seed=seed,
                      streams=[s for s in spec.ephemeral_streams if not s.pending])
    if num_tokens % m:
        out |= streams_for(spec, num_tokens % m, seed=seed,
                           streams=[s for s in spec.ephemeral_streams if s.pending])
    return out


def tokens_for(count: int, seed: int = 0) -> torch.Tensor:
    """Random ids within LAYOUT's vocabulary (a spill refuses any outside it)."""
    return torch.randint(0, LAYOUT.vocab_size, (count,),
                         generator=torch.Generator().manual_seed(seed))


def assert_streams_equal(got: dict[str, StreamData], want: dict[str, StreamData]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name].codes, want[name].codes), name
        if want[name].scales is None:
            assert got[name].scales is None
        else:
            assert torch.equal(got[name].scales, want[name].scales), name


def raw_spill_header(ref: pb.SessionRef, tokens, enc, **changes) -> pb.SpillHeader:
    """A Spill header as a client states it for ``enc`` (a ``kvtier.codec.EncodedSession``
    keyed for ``ref``'s tenant): chain keys, chunk and tail digests; ``changes`` override."""
    fields = dict(session=ref, layout_id=LAYOUT.name, generation=1, token_ids=tokens.tobytes(),
                  chunk_keys=enc.keys, chunk_digests=enc.digests,
                  tail_digest=chunk_digest(enc.tail) if enc.tail else b"")
    fields.update(changes)
    return pb.SpillHeader(**fields)


def config_for(tmp_path, **overrides):
    return load_config(preset="test", env={}, overrides={"data_dir": tmp_path, **overrides})


@contextlib.asynccontextmanager
async def running_server(tmp_path, **overrides) -> AsyncIterator[tuple[KVTierServer, str]]:
    server, port = await create_server(config_for(tmp_path, **overrides))
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(0.5)


def serve_child(data_dir: Path, config: Path | None = None, log_level: str = "ERROR"
                ) -> tuple[subprocess.Popen, str]:
    """``kvtier serve --preset test`` in a child process over ``data_dir`` with
    ``config`` (no ``KVTIER_*`` of this process), on a free port: (process, address)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--preset", "test",
         *(["--config", str(config)] if config is not None else []),
         "--data-dir", str(data_dir), "--listen", "127.0.0.1:0", "--log-level", log_level],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line.startswith("kvtier serving on "):
        process.kill()
        raise AssertionError(f"server did not start: {line!r}")
    return process, line.split()[3].rstrip(",")  # ", metrics on :PORT" may follow


def stop_child(process: subprocess.Popen) -> None:
    """SIGTERM, a graceful stop of a minute at most, then SIGKILL."""
    process.terminate()
    try:
        process.wait(timeout=60)
    finally:
        process.kill()


@dataclass
class ThreadedServer:
    """The real server on its own event loop in a thread of the test process, so a test
    can damage what it stores behind its back."""

    server: KVTierServer
    target: str
    data_dir: Path
    loop: asyncio.AbstractEventLoop

    def run(self, coro, timeout: float = 60):
        """Run ``coro`` on the server's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def disk(self):
        (tier,) = [t for t in self.server.manager.tiers if t.name == "disk"]
        return tier


@contextlib.contextmanager
def threaded_server(data_dir: Path, **overrides) -> Iterator[ThreadedServer]:
    """A ``ThreadedServer`` over ``data_dir`` on a free loopback port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="kvtier-server")
    thread.start()
    config = config_for(data_dir, listen="127.0.0.1:0", **overrides)
    server, port = asyncio.run_coroutine_threadsafe(create_server(config), loop).result(120)
    live = ThreadedServer(server, f"127.0.0.1:{port}", data_dir, loop)
    try:
        yield live
    finally:
        live.run(server.stop(0.5))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
