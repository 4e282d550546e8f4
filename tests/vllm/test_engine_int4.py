"""value_format int4 on a real vLLM engine (CPU build) serving the trained Llama test model
(model/weights/llama_test): a stored prompt of held-out text is an external hit whose
blocks come back from int4 K/V at 0.28x the bf16 bytes, and the greedy continuation stays
the one of a run without a hit for all but a few tokens (4 bits round; bench.hf measures
the fidelity, the bound here is loose)."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("vllm")

from kvtier import Client  # noqa: E402
from model.data import corpus  # noqa: E402
from model.train_llama import LLAMA_TEST_DIR  # noqa: E402
from tests.vllm.test_engine import generate, reset  # noqa: E402

TENANT = "engine-test-int4"
FINGERPRINT = "llama-test-int4"
BS = 128  # vLLM's block size on the CPU


@pytest.fixture(scope="module")
def engine(kvtier_server):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    transfer = KVTransferConfig(
        kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"server": kvtier_server.target, "tenant": TENANT,
                                   "model_fingerprint": FINGERPRINT, "ack": "durable",
                                   "value_format": "int4", "timeout_s": 60,
                                   "lookup_timeout_ms": 10000})
    llm = LLM(model=str(LLAMA_TEST_DIR), dtype="bfloat16", max_model_len=2048,
              enforce_eager=True, skip_tokenizer_init=True, seed=0, kv_transfer_config=transfer)
    yield llm
    del llm


def test_an_int4_hit_keeps_the_greedy_continuation(engine, kvtier_server):
    text = list(corpus(held_out=True)[20000:20000 + 4 * BS + 30])
    first, cached, _ = generate(engine, text)
    assert cached == 0
    with Client(kvtier_server.target) as store:
        (layout,) = [i.spec for i in store.layouts() if i.spec.name.endswith("-b128-int4-v256")]
        assert layout.name == "vllm-4x2x64-b128-int4-v256"
        assert layout.persistent_bytes_per_token / layout.bf16_baseline_bytes_per_token \
            == 0.28125
        deadline = time.monotonic() + 60
        while store.lookup(TENANT, layout, text, model=FINGERPRINT) < 4 * BS:
            assert time.monotonic() < deadline, "the saves did not land"
            time.sleep(0.1)
    reset(engine)
    again, cached, _ = generate(engine, text)
    assert cached == 4 * BS  # loaded from int4, not recomputed
    assert sum(a == b for a, b in zip(again, first, strict=True)) >= len(first) - 2, \
        (again, first)
