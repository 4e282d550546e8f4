"""A real vLLM engine (CPU build, one for the module) whose kvtier server is a child process
it cannot count on: the engine starts while the server is down and serves by recomputing
(its log says so); once the server starts, later requests store and then hit; a hung server
(SIGSTOP) neither changes a request's output nor holds its blocks, its lookups answered as
misses by their deadline; and a save queue of one skips the saves beyond it (counted),
every block released. The tests run in order, each leaving the server up."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

pytest.importorskip("vllm")

from kvtier import Client  # noqa: E402
from testing import vllm_models  # noqa: E402
from testing.live_server import Child, free_port  # noqa: E402
from tests.vllm.test_engine import BS, generate, metrics, prompt  # noqa: E402

TENANT = "outage-test"
FINGERPRINT = f"{vllm_models.TINY.name}-{vllm_models.TINY.digest}"
LOOKUP_MS = 500  # generous for a loaded CI box: a lookup in flight is asked again, not waited


class Outage:
    """The server (not started yet) at a port fixed in advance, and the engine's log."""

    def __init__(self, root) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        (root / "data").mkdir()
        self.server = Child(
            [sys.executable, "-m", "services.cli", "serve", "--preset", "test",
             "--data-dir", str(root / "data"), "--listen", self.target,
             "--log-level", "WARNING", "--metrics-port", str(free_port())],
            "kvtier serving on ", root / "server.log", {})
        self.log = root / "engine.log"
        self.llm = None

    def engine_log(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_log(self, text: str, count: int = 1) -> None:
        deadline = time.monotonic() + 60
        while self.engine_log().count(text) < count:
            assert time.monotonic() < deadline, f"the engine never logged {text!r}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def outage(tmp_path_factory):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    state = Outage(tmp_path_factory.mktemp("kvtier-outage"))
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    transfer = KVTransferConfig(
        kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"server": state.target, "tenant": TENANT,
                                   "model_fingerprint": FINGERPRINT, "timeout_s": 5,
                                   "lookup_timeout_ms": LOOKUP_MS, "save_queue_depth": 1,
                                   "breaker_failures": 1, "probe_interval_s": 0.5})
    # The engine's processes inherit stdout (vLLM's log) and stderr as they are spawned:
    # theirs go to a file.
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(state.log, "wb") as log:
        for fd in saved:
            os.dup2(log.fileno(), fd)
        try:
            state.llm = LLM(model=str(vllm_models.tiny_llama()), dtype="bfloat16",
                            max_model_len=2048, enforce_eager=True, skip_tokenizer_init=True,
                            seed=0, kv_transfer_config=transfer, disable_log_stats=False)
        finally:
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
    yield state
    del state.llm
    if state.server.alive():
        os.kill(state.server.pid, signal.SIGCONT)
    state.server.stop()


def held(target: str, tokens) -> int:
    with Client(target) as store:
        # the engine pages layout: its name binds the block arrangement, then the shape
        (info,) = [i for i in store.layouts()
                   if i.spec.name.startswith("vllm-") and "-4x2x64-b128" in i.spec.name]
        return store.lookup(TENANT, info.spec, tokens, model=FINGERPRINT)


def test_an_engine_starts_with_kvtier_down_and_serves_by_recompute(outage):
    # both sides, as soon as their first try fails
    outage.wait_log(f"kvtier unreachable at {outage.target}: serving by recompute", count=2)
    assert f"kvtier connector: server {outage.target}" in outage.engine_log()  # startup line
    p = prompt(3 * BS + 50, seed=21)
    out, cached, _ = generate(outage.llm, p)
    assert cached == 0 and out == generate(outage.llm, p, fresh=True)[0]
    assert metrics(outage.llm)["lookups_down"] >= 1


def test_a_server_that_comes_back_stores_and_then_hits(outage):
    outage.server.start()
    outage.wait_log(f"kvtier connected to {outage.target}", count=2)  # scheduler and worker
    p = prompt(3 * BS + 50, seed=22)
    first, cached, _ = generate(outage.llm, p)
    assert cached == 0
    deadline = time.monotonic() + 60
    while held(outage.target, p) < 3 * BS:
        assert time.monotonic() < deadline, "the saves did not land"
        time.sleep(0.1)
    assert outage.llm.reset_prefix_cache()
    again, cached, _ = generate(outage.llm, p)
    assert cached == 3 * BS and again == first


def test_a_hung_server_neither_stalls_nor_changes_a_request(outage):
    before = metrics(outage.llm)
    stored = prompt(3 * BS + 50, seed=22)  # the previous test's: held by the server
    reference = generate(outage.llm, stored, fresh=True)[0]
    os.kill(outage.server.pid, signal.SIGSTOP)
    try:
        assert outage.llm.reset_prefix_cache()
        out, cached, _ = generate(outage.llm, stored)
        assert cached == 0 and out == reference  # a miss, recomputed
        fresh = prompt(3 * BS + 50, seed=23)
        out, cached, _ = generate(outage.llm, fresh)
        assert cached == 0 and out == generate(outage.llm, fresh, fresh=True)[0]
        # no block waits for a save stuck on the hung server
        assert outage.llm.reset_prefix_cache()
        after = metrics(outage.llm)
        # the first lookup ran out its deadline; the breaker answered the rest at once
        assert after.get("lookup_timeouts", 0) - before.get("lookup_timeouts", 0) >= 1
        assert after.get("lookups_down", 0) > before.get("lookups_down", 0)
    finally:
        os.kill(outage.server.pid, signal.SIGCONT)


def test_a_full_save_queue_skips_saves_and_releases_every_block(outage):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # after the hang, both links are up again once a new prompt is stored
    deadline = time.monotonic() + 120
    for seed in range(40, 100):
        p = prompt(3 * BS + 50, seed=seed)
        generate(outage.llm, p)
        landed = time.monotonic() + 5
        while not held(outage.target, p) and time.monotonic() < landed:
            time.sleep(0.1)
        if held(outage.target, p):
            break
        assert time.monotonic() < deadline, "kvtier never stored again after the hang"
    before = metrics(outage.llm).get("saves_skipped", 0)
    prompts = [prompt(3 * BS + 50, seed=30 + i) for i in range(6)]

    def batch(fresh: bool) -> list[list[int]]:
        """Greedy outputs of the six prompts in one batch (a batch's numerics differ from
        one request's: the reference is the same batch reading no cache)."""
        params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False,
                                skip_reading_prefix_cache=fresh or None)
        replies = outage.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                      params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in replies]

    outputs = batch(fresh=False)
    assert outage.llm.reset_prefix_cache()  # at once: no block waits for a save
    skipped = metrics(outage.llm).get("saves_skipped", 0) - before
    assert skipped >= 1  # six requests' saves in one step, a queue of one
    assert outputs == batch(fresh=True)
