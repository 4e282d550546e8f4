"""The vLLM tests' server: one ``kvtier serve`` child for the session (no replay worker,
a host RAM tier smaller than a chunk, so chunks are read from disk where a test can damage them)."""

import pytest

from testing.live_server import LiveServer


@pytest.fixture(scope="session")
def kvtier_server(tmp_path_factory):
    """The running ``LiveServer`` (``.target``: its address; its data under ``.data_dir``)."""
    root = tmp_path_factory.mktemp("kvtier-vllm")
    with LiveServer(root / "data", root, replay=False,
                    env={"KVTIER_HOST_BYTES": str(64 << 10)}) as live:
        live.data_dir = root / "data"
        yield live
