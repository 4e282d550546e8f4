"""The connector's link: open until kvtier first answers, open again after consecutive
failures (said once in the log), closed by a probe on its timer; a link to a server that is
not there yet comes up once it is, without any caller waiting. The breaker alone:
tests/client/test_integration_breaker.py."""

import logging
import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import kvtier  # noqa: E402
from kvtier.integrations.breaker import Link  # noqa: E402
from kvtier.integrations.vllm.layout import CacheShape, rank_layout  # noqa: E402

SPEC = rank_layout(CacheShape(2, 2, 16, 16, 1000, torch.bfloat16, 1, "cpu_attn.vec"), 0, "auto")


def test_a_link_comes_up_when_its_server_does_and_says_so(kvtier_server, down_server, caplog):
    caplog.set_level(logging.INFO, logger="test-link")
    closed = down_server
    started = time.monotonic()
    down = Link(kvtier.Client(closed, retry=kvtier.RetryPolicy(attempts=1), timeout_s=1),
                [SPEC], server=closed, failures=2, probe_interval_s=0.05,
                logger=logging.getLogger("test-link"))
    assert time.monotonic() - started < 0.5  # built without a call
    try:
        deadline = time.monotonic() + 30
        while "unreachable" not in caplog.text:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not down.up and f"kvtier unreachable at {closed}: serving by recompute" \
            in caplog.text
    finally:
        down.close()
    up = Link(kvtier.Client(kvtier_server.target), [SPEC], server=kvtier_server.target,
              failures=2, probe_interval_s=0.05, logger=logging.getLogger("test-link"))
    try:
        deadline = time.monotonic() + 30
        while not up.up:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert f"kvtier connected to {kvtier_server.target}" in caplog.text
        assert SPEC.layout_id in {i.spec.layout_id for i in up.client.layouts()}
        # failures in a row open it (logged), and the probe closes it again
        caplog.clear()
        up.failed("save", RuntimeError("boom"))
        up.failed("save", RuntimeError("boom"))
        assert "kvtier unreachable" in caplog.text
        deadline = time.monotonic() + 30
        while not up.up:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        up.close()
