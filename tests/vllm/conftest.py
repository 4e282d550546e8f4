"""The vLLM tests' kvtier server: the real server on its own event loop in a thread of the
test process (so a test can damage what it stores behind its back), with a host RAM tier
smaller than a chunk and no object tier: every chunk lives on disk alone."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.service import config_for


@dataclass
class ThreadedServer:
    server: object  # services.server.server.KVTierServer
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


@pytest.fixture(scope="session")
def kvtier_server(tmp_path_factory):
    from services.server.server import create_server

    data_dir = tmp_path_factory.mktemp("kvtier-vllm")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="kvtier-server")
    thread.start()
    config = config_for(data_dir, host_bytes=1024, object_bytes=0, listen="127.0.0.1:0")
    server, port = asyncio.run_coroutine_threadsafe(create_server(config), loop).result(120)
    live = ThreadedServer(server, f"127.0.0.1:{port}", data_dir, loop)
    yield live
    live.run(server.stop(0.5))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
