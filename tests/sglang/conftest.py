"""The SGLang tests run in .venv-sglang (``make sglang``) and skip elsewhere. Their kvtier
server: the real server in a thread of the test process, with a host RAM tier smaller
than a page and no object tier, so every page lives on disk alone (where a test can
damage it)."""

from __future__ import annotations

import pytest

from tests.support.service import threaded_server


@pytest.fixture(scope="session")
def kvtier_server(tmp_path_factory):
    with threaded_server(tmp_path_factory.mktemp("kvtier-sglang"), host_bytes=1024,
                         object_bytes=0) as live:
        yield live
