"""The vLLM tests' kvtier server: the real server on its own event loop in a thread of the
test process (so a test can damage what it stores behind its back), with a host RAM tier
smaller than a chunk and no object tier: every chunk lives on disk alone."""

from __future__ import annotations

import pytest

from tests.support.service import threaded_server


@pytest.fixture(scope="session")
def kvtier_server(tmp_path_factory):
    with threaded_server(tmp_path_factory.mktemp("kvtier-vllm"), host_bytes=1024,
                         object_bytes=0) as live:
        yield live
